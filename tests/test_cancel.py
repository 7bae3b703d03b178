"""Cancellation in every phase, on the tiny checkpoint on the CPU: a stop asked for during the denoise, the video decode
or the mux takes effect before the next DiT block, decode op or encoded frame, leaves nothing behind, releases the
job's tensors, and (through the server) is logged with its phase while the next job runs.

Faults are injected by wrapping the unit of work of each phase (the DiT's fused block, the decoder's ops, the mux's
frame conversion) so that the stop is asked for from inside one unit; the test then counts the units that ran after.
"""

from __future__ import annotations

import gc
import logging
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from dit_testing import tiny_dit
from server_testing import DEADLINE_S, until

from k6fast import media
from k6fast.cancel import Cancelled
from k6fast.output import write_result
from k6fast.pipeline import Pipeline, Request
from k6fast.switches import Options
from k6fast.video_decode import run_ops

REQUEST = Request(prompt="a drum roll", width=64, height=64, frames=9, steps=3, seed=3)


@pytest.fixture(scope="module")
def pipe(tiny_distill: Path) -> Pipeline:
    return Pipeline(tiny_distill, Options(), device="cpu")


class Units:
    """Counts calls of a phase's unit of work; asks for the stop from inside call number `stop_at`."""

    def __init__(self, stop_at: int):
        self.stop_at = stop_at
        self.calls = 0
        self.stop = threading.Event()
        self.output_ref: weakref.ref | None = None  # the output of the unit that asked for the stop

    def wrap(self, fn: Callable) -> Callable:
        def unit(*args, **kwargs):
            self.calls += 1
            out = fn(*args, **kwargs)
            if self.calls == self.stop_at:
                self.stop.set()
                first = out[0] if isinstance(out, tuple) else out
                if isinstance(first, torch.Tensor):
                    self.output_ref = weakref.ref(first)
            return out

        return unit


def _cancelled(run: Callable[[], object]) -> Cancelled:
    """Run until Cancelled; a copy of it, without the traceback that would hold the job's tensors."""
    try:
        run()
    except Cancelled as exc:
        return Cancelled(exc.phase, exc.where)
    raise AssertionError("the run was not cancelled")


def test_denoise_stops_before_the_next_dit_block(pipe: Pipeline, monkeypatch) -> None:
    blocks = pipe.ckpt.dit.num_visual_blocks
    units = Units(stop_at=blocks + 1)  # the first block of the second step
    monkeypatch.setattr(pipe.dit, "fused_block", units.wrap(pipe.dit.fused_block))
    exc = _cancelled(lambda: pipe.generate(REQUEST, should_stop=units.stop.is_set))
    assert units.calls == blocks + 1, "no block ran after the stop was asked for"
    assert exc.phase == "denoise" and exc.where == f"step 2 of 3, before fused block 2 of {blocks}"
    assert pipe.dit.should_stop is None, "the request's stop check does not outlive it"
    gc.collect()
    assert units.output_ref() is None, "the cancelled job's activations are released"


def test_video_decode_stops_before_the_next_op(pipe: Pipeline, monkeypatch) -> None:
    units = Units(stop_at=4)
    for kind, fn in list(run_ops.OP_RUNNERS.items()):
        monkeypatch.setitem(run_ops.OP_RUNNERS, kind, units.wrap(fn))
    blocks = Units(stop_at=0)
    monkeypatch.setattr(pipe.dit, "fused_block", blocks.wrap(pipe.dit.fused_block))
    exc = _cancelled(lambda: pipe.generate(REQUEST, should_stop=units.stop.is_set))
    assert units.calls == 4, "no decoder op ran after the stop was asked for"
    assert blocks.calls == 3 * pipe.ckpt.dit.num_visual_blocks, "the denoise ran whole"
    assert exc.phase == "video_decode" and exc.where.startswith("before decoder op ")
    gc.collect()
    assert units.output_ref() is None, "the decode's activations are released"


def test_mux_stops_before_the_next_frame_and_leaves_no_file(pipe: Pipeline, tmp_path: Path, monkeypatch) -> None:
    result = pipe.generate(REQUEST)
    units = Units(stop_at=3)
    monkeypatch.setattr(media, "video_frame", units.wrap(media.video_frame))
    out = tmp_path / "clip.mp4"
    exc = _cancelled(lambda: write_result(result, out, Options(), REQUEST, "tiny", "distill", units.stop.is_set))
    assert units.calls == 3 and exc.phase == "mux" and exc.where == "before frame 4 of 9"
    assert list(tmp_path.iterdir()) == [], "neither the clip, its sidecar nor a temporary file is left"


def test_a_stop_before_the_request_starts_runs_nothing(pipe: Pipeline, monkeypatch) -> None:
    blocks = Units(stop_at=0)
    monkeypatch.setattr(pipe.dit, "fused_block", blocks.wrap(pipe.dit.fused_block))
    exc = _cancelled(lambda: pipe.generate(REQUEST, should_stop=lambda: True))
    assert exc.phase == "text_encode" and blocks.calls == 0


def test_a_streamed_dit_stopped_between_blocks_runs_the_next_forward_exactly(tiny_distill: Path) -> None:
    from k6fast.checkpoint import open_checkpoint

    ckpt = open_checkpoint(tiny_distill)
    cfg = ckpt.dit
    g = torch.Generator().manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, 3, 4, 6, cfg.visual_in_channels, generator=g),
        encoder_hidden_states=torch.randn(1, 5, cfg.in_text_dim, generator=g),
        pooled_projections=torch.randn(1, cfg.in_text_dim2, generator=g),
        timestep=torch.tensor([500.0]),
        audio_hidden_states=torch.randn(1, 4, cfg.in_audio_dim, generator=g),
    )
    resident, streamed = tiny_dit(ckpt), tiny_dit(ckpt, max_resident=0)
    try:
        assert streamed.streamer is not None
        units = Units(stop_at=1)
        streamed.dit.fused_block = units.wrap(streamed.dit.fused_block)
        streamed.dit.should_stop = units.stop.is_set
        exc = _cancelled(lambda: streamed.dit(**inputs))
        assert units.calls == 1 and exc.where == f"before fused block 2 of {cfg.num_visual_blocks}"
        streamed.dit.should_stop = None
        expected = resident.dit(**inputs)
        got = streamed.dit(**inputs)
        assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])
    finally:
        resident.close()
        streamed.close()


class Pause:
    """Wraps a phase's units: the first call holds until `proceed`, so the test can DELETE the job mid-phase; the
    units started after it are counted."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.proceed = threading.Event()
        self.after = 0
        self._held = False

    def wrap(self, fn: Callable) -> Callable:
        def unit(*args, **kwargs):
            if not self._held:
                self._held = True
                self.reached.set()
                assert self.proceed.wait(DEADLINE_S), "the test never let the job go on"
            else:
                self.after += 1
            return fn(*args, **kwargs)

        return unit


@pytest.mark.parametrize("phase", ["denoise", "video_decode", "mux"])
def test_delete_stops_the_running_job_in_every_phase(
    phase: str, pipe: Pipeline, tmp_path: Path, monkeypatch, caplog
) -> None:
    pytest.importorskip("fastapi")  # the server's extra; the rest of this file needs none of it
    from fastapi.testclient import TestClient

    from k6fast.server.app import create_app
    from k6fast.server.config import ServerConfig

    pause = Pause()
    if phase == "denoise":
        monkeypatch.setattr(pipe.dit, "fused_block", pause.wrap(pipe.dit.fused_block))
    elif phase == "video_decode":
        for kind, fn in list(run_ops.OP_RUNNERS.items()):
            monkeypatch.setitem(run_ops.OP_RUNNERS, kind, pause.wrap(fn))
    else:
        monkeypatch.setattr(media, "video_frame", pause.wrap(media.video_frame))
    caplog.set_level(logging.INFO, logger="k6fast.server")
    config = ServerConfig(model="tiny", served_model_name="tiny", data_dir=tmp_path / "data", default_size=(64, 64))
    fields = {"prompt": "a gong", "size": "64x64", "num_frames": "9", "num_inference_steps": "3"}
    with TestClient(create_app(config, Options(), load=lambda: pipe)) as client:
        until(lambda: client.get("/health").status_code == 200, "the server to be ready")
        video_id = client.post("/v1/videos", data=fields).json()["id"]
        assert pause.reached.wait(DEADLINE_S), f"the job never reached {phase}"
        assert client.delete(f"/v1/videos/{video_id}").json()["deleted"] is True
        pause.proceed.set()
        state = client.app.state.k6
        until(lambda: state.worker.current_job_id is None, "the worker to drop the deleted job")
        assert pause.after == 0, f"{pause.after} unit(s) of {phase} ran after the DELETE"
        stopped = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"job {video_id}: cancelled")]
        assert len(stopped) == 1 and f"cancelled (deleted) during {phase} (" in stopped[0], stopped
        assert not state.files.folder(video_id).exists()
        after = client.post("/v1/videos", data=fields).json()["id"]
        done = until(
            lambda: (v := client.get(f"/v1/videos/{after}").json())["status"] in ("completed", "failed") and v,
            "the next job",
        )
        assert done["status"] == "completed", done["error"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("phase", ["denoise", "video_decode"])
def test_on_cuda_a_cancelled_request_gives_its_memory_back(phase: str, tiny_distill: Path, monkeypatch) -> None:
    """Every block streamed (the lean budget path): a stop mid-phase leaves no tensor of the request allocated, and
    the next request runs as before it (a stream left out of step would give other frames)."""
    import numpy as np

    pipe = Pipeline(tiny_distill, Options().replace(max_resident_blocks=0), device="cuda")
    assert pipe.runtime.streamer is not None
    before = pipe.generate(REQUEST)  # also warms every lazily allocated cache
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    if phase == "denoise":
        units = Units(stop_at=pipe.ckpt.dit.num_visual_blocks + 1)
        monkeypatch.setattr(pipe.dit, "fused_block", units.wrap(pipe.dit.fused_block))
    else:
        units = Units(stop_at=4)
        for kind, fn in list(run_ops.OP_RUNNERS.items()):
            monkeypatch.setitem(run_ops.OP_RUNNERS, kind, units.wrap(fn))
    exc = _cancelled(lambda: pipe.generate(REQUEST, should_stop=units.stop.is_set))
    assert exc.phase == phase
    monkeypatch.undo()
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    left = torch.cuda.memory_allocated()
    assert left <= baseline, f"{(left - baseline) / 2**20:.1f} MiB of the cancelled request is still allocated"
    after = pipe.generate(REQUEST)
    # Same kernels and seed; cuDNN's timed convolution algorithms may differ between runs, hence not bit-equality.
    assert np.abs(after.frames - before.frames).max() < 1e-2
    pipe.close()
