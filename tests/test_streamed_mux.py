"""Decode, audio and mux as one stream (output.generate_to_mp4), on the tiny checkpoint on the CPU: the video decode
hands each frame over once, in order, as soon as it is final; the encoder works on its own thread while the decode
goes on; the MP4 is byte for byte the one the sequential `generate` + `write_result` writes for the same frames and
audio; a stop or an encoder error mid-stream leaves no file, partial or temporary, and no encoder thread behind.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from k6fast import media
from k6fast.cancel import Cancelled
from k6fast.media import probe_mp4
from k6fast.output import frames_to_uint8, generate_to_mp4, sidecar_path, tensor_to_uint8, write_result
from k6fast.pipeline import Pipeline, Request
from k6fast.switches import Options
from k6fast.vae import load_video_vae
from k6fast.video_decode import decode_video_fast, decode_with_plan, plan_video_decode, run_ops

HUGE = 1 << 40  # a decode budget that holds anything here
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def pipe(tiny_distill: Path) -> Pipeline:
    pipe = Pipeline(tiny_distill, Options(), device="cpu")
    yield pipe
    pipe.close()


def _request(frames: int = 9, audio: bool = True, seed: int = 5) -> Request:
    return Request(prompt="a kettle whistles", width=64, height=64, frames=frames, steps=2, seed=seed, audio=audio)


def _decode_in_slabs(pipe: Pipeline, monkeypatch) -> None:
    """The streamed decode in slabs of one latent frame: the frames are handed over slab by slab (1, 4, 4, ...)."""
    monkeypatch.setattr(pipe, "options", pipe.options.replace(video_decode="streamed"))
    monkeypatch.setattr(
        pipe, "plan_decode", lambda shape: plan_video_decode(pipe.vae, shape, budget_bytes=HUGE, chunk_latent_frames=1)
    )


def _mux_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("k6fast-mux")]


# ---------------------------------------------------------------------------------------------------------------
# The frames the decode hands over
# ---------------------------------------------------------------------------------------------------------------


def test_tensor_to_uint8_is_frames_to_uint8() -> None:
    # The streamed path converts on the decode's device, the sequential one with numpy on the host: the same uint8
    # for every float32 at and next to each rounding boundary (k + 0.5) / 255 and each level k / 255, the ends of
    # [0, 1] and beyond them, and a million uniform draws.
    levels = np.arange(256, dtype=np.float64)
    centres = np.concatenate([(levels[:-1] + 0.5) / 255, levels / 255, [0.0, 1.0, -0.01, 1.01]]).astype(np.float32)
    near = [centres]
    for _ in range(4):
        near.append(np.nextafter(near[-1], np.float32(2)))
        near.insert(0, np.nextafter(near[0], np.float32(-1)))
    uniform = np.random.default_rng(0).random(1_000_000, dtype=np.float32)
    values = np.concatenate([*near, uniform])
    expected = frames_to_uint8(values)
    got = tensor_to_uint8(torch.from_numpy(values)).numpy()
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, expected)


@pytest.fixture(scope="module")
def tiny_vae(tiny_distill: Path):
    return load_video_vae(tiny_distill, torch.device("cpu"), torch.float32)


PLANS = {
    "whole-clip": lambda vae, shape: plan_video_decode(vae, shape, budget_bytes=HUGE),
    "whole-clip lean": lambda vae, shape: plan_video_decode(vae, shape, budget_bytes=HUGE, upsample_fusion="stored"),
    "slabs": lambda vae, shape: plan_video_decode(vae, shape, budget_bytes=HUGE, chunk_latent_frames=2),
    "slabs x tiles": lambda vae, shape: plan_video_decode(
        vae, shape, budget_bytes=HUGE, chunk_latent_frames=1, min_grid=2, split=12
    ),
}


@pytest.mark.parametrize("kind", list(PLANS))
def test_the_decode_hands_over_each_frame_once_in_order_as_it_returns_them(tiny_vae, kind: str) -> None:
    latents = torch.randn(1, 4, 12, 12, 16, generator=torch.Generator().manual_seed(1))
    plan = PLANS[kind](tiny_vae, (4, 12, 12))
    assert (plan.mode, len(plan.tiles) > 1) == {
        "whole-clip": ("whole-clip", False),
        "whole-clip lean": ("whole-clip lean", False),
        "slabs": ("streamed", False),
        "slabs x tiles": ("streamed", True),
    }[kind], plan.describe()
    chunks: list[tuple[int, int, torch.Tensor]] = []
    # Chunks of at most 2 frames: a whole-clip decode, too, hands its frames over chunk by chunk of the last op.
    returned, _ = decode_with_plan(
        tiny_vae, latents, plan, max_chunk_frames=2, on_frames=lambda f0, f1, y: chunks.append((f0, f1, y.clone()))
    )
    alone, _ = decode_with_plan(tiny_vae, latents, plan, max_chunk_frames=2)
    assert torch.equal(returned, alone), "handing the frames over changes nothing in them"
    assert [f0 for f0, _, _ in chunks] == [0] + [f1 for _, f1, _ in chunks[:-1]] and chunks[-1][1] == 13
    assert len(chunks) >= 7  # 13 frames, at most 2 a chunk
    assert all(y.shape == (f1 - f0, 96, 96, 3) for f0, f1, y in chunks)
    assert torch.equal(torch.cat([y for _, _, y in chunks]), returned[0])
    assert returned.min() >= 0 and returned.max() <= 1


def test_frames_are_handed_over_before_the_decode_has_finished(tiny_vae) -> None:
    # Slab by slab: the first slab's frames come before the last slab's ops run.
    latents = torch.randn(1, 3, 8, 8, 16, generator=torch.Generator().manual_seed(2))
    plan = plan_video_decode(tiny_vae, (3, 8, 8), budget_bytes=HUGE, chunk_latent_frames=1)
    ops_run, seen_at = [0], []

    def counted(fn):
        def op(*args, **kwargs):
            ops_run[0] += 1
            return fn(*args, **kwargs)

        return op

    with pytest.MonkeyPatch.context() as mp:
        for kind, fn in list(run_ops.OP_RUNNERS.items()):
            mp.setitem(run_ops.OP_RUNNERS, kind, counted(fn))
        decode_video_fast(tiny_vae, latents, plan=plan, on_frames=lambda f0, f1, y: seen_at.append((f1, ops_run[0])))
    assert [f1 for f1, _ in seen_at] == [1, 5, 9]
    assert seen_at[0][1] < seen_at[1][1] < seen_at[2][1] == ops_run[0]


def test_on_frames_needs_a_batch_of_one(tiny_vae) -> None:
    latents = torch.zeros(2, 2, 4, 4, 16)
    plan = plan_video_decode(tiny_vae, (2, 4, 4), budget_bytes=HUGE)
    with pytest.raises(ValueError, match="expected a batch of 1, found 2"):
        decode_video_fast(tiny_vae, latents, plan=plan, on_frames=lambda *a: None)


# ---------------------------------------------------------------------------------------------------------------
# The streamed MP4
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("frames", "audio", "slabs"),
    [(17, True, False), (9, False, False), (13, True, True)],
    ids=["audio-whole-clip", "no-audio", "audio-13-frames-in-slabs-1+4+4+4"],
)
def test_streamed_mp4_is_byte_identical_to_the_sequential_write(
    pipe: Pipeline, tmp_path: Path, monkeypatch, frames: int, audio: bool, slabs: bool
) -> None:
    if slabs:
        _decode_in_slabs(pipe, monkeypatch)
    request = _request(frames, audio)
    streamed_path, sequential_path = tmp_path / "streamed.mp4", tmp_path / "sequential.mp4"
    streamed = generate_to_mp4(pipe, request, streamed_path, "tiny")
    sequential = pipe.generate(request)
    # The Result is the same whichever way the clip is written (its frames are kept for the gate and the bench).
    assert np.array_equal(streamed.frames, sequential.frames) and streamed.frames.shape == (frames, 64, 64, 3)
    assert (streamed.audio is None) == (not audio)
    if audio:
        assert np.array_equal(streamed.audio, sequential.audio)
    write_result(sequential, sequential_path, pipe.options, request, "tiny", "distill")
    assert streamed_path.read_bytes() == sequential_path.read_bytes()

    info = probe_mp4(streamed_path)
    assert info.frame_count == frames and (info.audio_codec == "aac") == audio
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [streamed_path.name, sidecar_path(streamed_path).name, sequential_path.name, sidecar_path(sequential_path).name]
    )
    sidecar = json.loads(sidecar_path(streamed_path).read_text())
    assert sidecar["model"] == "tiny" and sidecar["request"]["frames"] == frames
    assert sidecar["telemetry"]["mux_streamed"] is True
    assert not _mux_threads()


def test_the_encoder_works_while_the_decode_goes_on(pipe: Pipeline, tmp_path: Path, monkeypatch) -> None:
    # The last slab's output op waits for the encoder to have converted the first frame: it can only see that if the
    # encoder runs beside the decode (a sequential mux starts after the last op and would time out here).
    _decode_in_slabs(pipe, monkeypatch)
    first_encoded, outs = threading.Event(), [0]
    real_frame, real_out = media.video_frame, run_ops.OP_RUNNERS["out"]

    def video_frame(rgb):
        first_encoded.set()
        return real_frame(rgb)

    def out_op(*args, **kwargs):
        outs[0] += 1
        if outs[0] == 3:  # 9 frames = 3 latent frames: the third slab is the last
            assert first_encoded.wait(DEADLINE_S), "no frame was encoded before the decode's last slab"
        return real_out(*args, **kwargs)

    monkeypatch.setattr(media, "video_frame", video_frame)
    monkeypatch.setitem(run_ops.OP_RUNNERS, "out", out_op)
    result = generate_to_mp4(pipe, _request(9), tmp_path / "clip.mp4", "tiny")
    assert outs[0] == 3
    t = result.telemetry
    assert t.mux_streamed and t.mux_encode_s > 0 and t.mux_exposed_s >= 0
    assert {"audio_decode", "video_decode", "mux"} <= set(t.phases)
    assert list(t.phases).index("audio_decode") < list(t.phases).index("video_decode")  # the audio comes first
    record = t.as_dict()
    assert record["mux_exposed_s"] == round(t.mux_exposed_s, 6) and record["mux_streamed"] is True
    assert "mux: streamed beside the video decode" in t.summary()


def test_the_sequential_write_records_its_mux_as_all_exposed(pipe: Pipeline, tmp_path: Path) -> None:
    result = pipe.generate(_request(5))
    write_result(result, tmp_path / "clip.mp4", pipe.options, _request(5), "tiny", "distill")
    t = result.telemetry
    assert not t.mux_streamed and t.mux_exposed_s == t.mux_encode_s > 0
    assert "mux: after the video decode" in t.summary()


class _StopAfter:
    """A stop asked for from inside the n-th call of a unit of work (an encoded frame, a decoder op)."""

    def __init__(self, n: int):
        self.n, self.calls, self.stop = n, 0, threading.Event()

    def wrap(self, fn):
        def unit(*args, **kwargs):
            self.calls += 1
            if self.calls == self.n:
                self.stop.set()
            return fn(*args, **kwargs)

        return unit


def test_a_stop_in_the_encoder_mid_stream_leaves_no_file(pipe: Pipeline, tmp_path: Path, monkeypatch) -> None:
    _decode_in_slabs(pipe, monkeypatch)
    out = tmp_path / "clip.mp4"
    out.write_bytes(b"the previous clip")
    units = _StopAfter(3)
    monkeypatch.setattr(media, "video_frame", units.wrap(media.video_frame))
    with pytest.raises(Cancelled) as caught:
        generate_to_mp4(pipe, _request(13), out, "tiny", should_stop=units.stop.is_set)
    # The encoder saw the stop before frame 4, or the decode did before its next op: either way nothing is left.
    assert caught.value.phase in ("mux", "video_decode"), caught.value
    assert [p.name for p in tmp_path.iterdir()] == ["clip.mp4"] and out.read_bytes() == b"the previous clip"
    assert not _mux_threads()


def test_a_stop_in_the_decode_after_frames_were_encoded_leaves_no_file(
    pipe: Pipeline, tmp_path: Path, monkeypatch
) -> None:
    _decode_in_slabs(pipe, monkeypatch)
    encoded, stop, outs = threading.Event(), threading.Event(), [0]
    real_frame, real_out = media.video_frame, run_ops.OP_RUNNERS["out"]

    def video_frame(rgb):
        encoded.set()
        return real_frame(rgb)

    def out_op(*args, **kwargs):
        outs[0] += 1
        if outs[0] == 2:  # the second slab: the first slab's frame is in the encoder
            assert encoded.wait(DEADLINE_S), "the first slab's frame was not encoded during the decode"
            stop.set()
        return real_out(*args, **kwargs)

    monkeypatch.setattr(media, "video_frame", video_frame)
    monkeypatch.setitem(run_ops.OP_RUNNERS, "out", out_op)
    with pytest.raises(Cancelled) as caught:
        generate_to_mp4(pipe, _request(13), tmp_path / "clip.mp4", "tiny", should_stop=stop.is_set)
    # The decode stops before its next op, or the encoder before the second slab's first frame.
    assert caught.value.phase in ("video_decode", "mux"), caught.value
    assert outs[0] == 2 and list(tmp_path.iterdir()) == []
    assert not _mux_threads()


def test_an_encoder_error_stops_the_request_and_leaves_no_file(pipe: Pipeline, tmp_path: Path, monkeypatch) -> None:
    _decode_in_slabs(pipe, monkeypatch)
    calls = [0]
    real_frame = media.video_frame

    def failing(rgb):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("encoder exploded")
        return real_frame(rgb)

    monkeypatch.setattr(media, "video_frame", failing)
    with pytest.raises(RuntimeError, match="encoder exploded"):
        generate_to_mp4(pipe, _request(13), tmp_path / "clip.mp4", "tiny")
    assert list(tmp_path.iterdir()) == [] and not _mux_threads()
