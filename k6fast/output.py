"""Writing a result: the MP4 (with what made it in its metadata) and a sidecar JSON, both atomically.

Two ways, one file: `write_result` encodes a finished `Result`'s frames after the request; `generate_to_mp4` runs the
request with an `Mp4Sink`, which encodes the frames on its own thread as the video decode hands them over, so the
MP4 is finished soon after the last frame. For the same frames and audio both write the same bytes.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .atomic import sidecar_path, write_json_atomic
from .cancel import StopCheck
from .media import Mp4Writer, prepare_audio, write_mp4
from .pipeline import Pipeline, Request, Result
from .sampler import StepEvent
from .switches import Options, provenance


def frames_to_uint8(frames: np.ndarray) -> np.ndarray:
    """float [F, H, W, 3] in [0, 1] → uint8, rounded."""
    return np.clip(np.rint(frames * 255.0), 0, 255).astype(np.uint8)


def tensor_to_uint8(frames: torch.Tensor) -> torch.Tensor:
    """`frames_to_uint8` on a tensor, on its device: fp32 [F, H, W, 3] → uint8, the same values (the float32 product
    with 255, rounded half to even, clamped)."""
    return (frames * 255.0).round_().clamp_(0, 255).to(torch.uint8)


def mp4_metadata(options: Options) -> dict[str, str]:
    """What made the clip, stored in the MP4. The arm's *name* stays in the sidecar: two runs with the same
    switches (e.g. `--arm reference` and every switch explicitly off) must write identical files."""
    prov = provenance(options)
    return {
        "k6fast_version": str(prov["k6fast_version"]),
        "k6fast_commit": str(prov["git_commit"]),
        "k6fast_arm_hash": str(prov["arm_hash"]),
        "k6fast_switches": json.dumps(prov["switches"], sort_keys=True),
    }


def write_result(
    result: Result,
    out: Path,
    options: Options,
    request: Request,
    model: str,
    variant: str,
    should_stop: StopCheck | None = None,
    *,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write `out` (MP4) and `out.json` (provenance, request, telemetry, and `extra`: what the caller knows of the
    run, such as the load time and the residency plan). Returns the sidecar's content.
    `should_stop`: checked between the MP4's frames (`write_mp4`); a stop leaves neither file behind."""
    out = Path(out)
    telemetry = result.telemetry
    audio = None if result.audio is None else prepare_audio(result.audio, options.audio_norm)
    start = time.perf_counter()
    with telemetry.phase("mux"):
        write_mp4(
            out,
            frames_to_uint8(result.frames),
            result.fps,
            audio,
            result.sample_rate,
            mp4_metadata(options),
            should_stop=should_stop,
        )
    telemetry.mux_streamed = False
    telemetry.mux_encode_s = telemetry.mux_exposed_s = time.perf_counter() - start
    return _write_sidecar(result, out, options, request, model, variant, extra)


def generate_to_mp4(
    pipe: Pipeline,
    request: Request,
    out: Path,
    model: str,
    *,
    on_step: Callable[[StepEvent], None] | None = None,
    should_stop: StopCheck | None = None,
    initial_noise: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    extra: dict[str, Any] | None = None,
    stop_after_steps: int | None = None,
) -> Result:
    """`pipe.generate(request)` then `write_result(...)`, the MP4 encoded while the video decodes (`Mp4Sink`): the
    same files, bytes and Result (its frames included). The "mux" phase is the wait for the encoder after the
    decode; `telemetry.mux_encode_s` the encoder's work, `mux_exposed_s` how much of it came after the last frame.
    `should_stop` is checked by the request and between the MP4's frames; a stop or any error leaves neither file."""
    out = Path(out)
    with Mp4Sink(out, pipe.options, should_stop) as sink:
        result = pipe.generate(request, on_step=on_step, should_stop=should_stop, initial_noise=initial_noise,
                               frame_sink=sink, stop_after_steps=stop_after_steps)  # fmt: skip
        with result.telemetry.phase("mux"):
            sink.finish()
    telemetry = result.telemetry
    telemetry.mux_streamed = True
    telemetry.mux_encode_s, telemetry.mux_exposed_s = sink.encode_s, sink.exposed_s
    _write_sidecar(result, out, pipe.options, request, model, pipe.ckpt.variant, extra)
    return result


class Mp4Sink:
    """A frame sink (k6fast.frame_sink) that writes the MP4 at `out` as the frames come: each handed-over chunk is
    turned into uint8 on the decode's device, copied to the host and queued for an encoder thread (`Mp4Writer`; x264
    and the muxer release the GIL, so the decode goes on beside it). `finish()` waits for the encoder and publishes
    the file; leaving a `with` block without it (an error, a stop) removes everything. An encoder error reaches the
    decode at its next chunk, or `finish()`."""

    def __init__(self, out: Path, options: Options, should_stop: StopCheck | None = None):
        self.out, self.options, self.should_stop = Path(out), options, should_stop
        self.encode_s = 0.0  # the encoder thread's working time
        self.exposed_s: float | None = None  # from the last frame handed over to the finished file
        self._writer: Mp4Writer | None = None
        self._queue: queue.SimpleQueue[np.ndarray | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._abandon = threading.Event()
        self._last_frame_at: float | None = None
        self._done = False

    def __enter__(self) -> Mp4Sink:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        self.abort()

    def begin(
        self, num_frames: int, height: int, width: int, fps: float, audio: np.ndarray | None, sample_rate: int
    ) -> None:
        if self._writer is not None:
            raise RuntimeError(f"Mp4Sink: {self.out} has begun already")
        wave = None if audio is None else prepare_audio(audio, self.options.audio_norm)
        self._writer = Mp4Writer(
            self.out, num_frames, height, width, fps, wave, sample_rate, mp4_metadata(self.options), self._stop
        )
        self._thread = threading.Thread(target=self._encode, name=f"k6fast-mux {self.out.name}", daemon=True)
        self._thread.start()

    def frames(self, start: int, stop: int, frames: torch.Tensor) -> None:
        self._raise_failure()
        if self._writer is None:
            raise RuntimeError("Mp4Sink: frames handed over before begin()")
        self._queue.put(tensor_to_uint8(frames).cpu().numpy())
        if stop == self._writer.num_frames:
            self._last_frame_at = time.perf_counter()

    def finish(self) -> None:
        """Wait for the encoder to write the last frame and publish the file at `out`."""
        if self._thread is None or self._last_frame_at is None:
            raise RuntimeError(f"Mp4Sink: finish() before the last frame of {self.out} was handed over")
        self._queue.put(None)
        self._thread.join()
        self._raise_failure()
        self.exposed_s = time.perf_counter() - self._last_frame_at
        self._done = True

    def abort(self) -> None:
        """Stop the encoder and remove the temporary file; nothing happens after `finish()`."""
        if self._done or self._writer is None:
            return
        self._abandon.set()
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join()
        self._writer.abort()
        self._done = True

    def _stop(self) -> bool:
        return self._abandon.is_set() or (self.should_stop is not None and self.should_stop())

    def _encode(self) -> None:
        try:
            while (rgb := self._queue.get()) is not None:
                start = time.perf_counter()
                self._writer.write(rgb)
                self.encode_s += time.perf_counter() - start
            if not self._abandon.is_set():
                start = time.perf_counter()
                self._writer.close()
                self.encode_s += time.perf_counter() - start
        except BaseException as exc:  # handed to the decode's thread; the writer has removed its file
            self._failure = exc

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure


def _write_sidecar(
    result: Result,
    out: Path,
    options: Options,
    request: Request,
    model: str,
    variant: str,
    extra: dict[str, Any] | None,
) -> dict[str, Any]:
    record = {
        "provenance": provenance(options),
        "model": model,
        "variant": variant,
        "request": {**request.to_dict(), "steps": result.steps, "guidance": result.guidance},  # as resolved
        "telemetry": result.telemetry.as_dict(),
        **(extra or {}),
    }
    write_json_atomic(sidecar_path(out), record)
    return record
