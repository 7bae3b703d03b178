"""The pipeline's video decode by K6_VIDEO_DECODE on the tiny checkpoint (CPU, fp32): `exact` (the default) equals
diffusers' untiled decode and makes room by sending the DiT off the device when the budget needs it, or the request
fails (up front where it can tell); `tiled` is diffusers' tiled decode; `streamed` decodes in slabs inside what the
budget leaves beside the DiT."""

from __future__ import annotations

import pytest
import torch

from k6fast.allocator import held_after_release
from k6fast.pipeline import Pipeline, Request, RequestError
from k6fast.switches import load_options
from k6fast.telemetry import Telemetry
from k6fast.vae import decode_video
from k6fast.video_decode import decode_video_fast, plan_video_decode


@pytest.fixture(scope="module")
def pipe(tiny_distill):
    pipe = Pipeline(tiny_distill, load_options(environ={}), device="cpu")
    yield pipe
    pipe.close()


def _latents(pipe, t: int = 5, h: int = 8, w: int = 8) -> torch.Tensor:
    c = pipe.vae.config.latent_channels
    return torch.randn(1, t, h, w, c, generator=torch.Generator().manual_seed(3))


def _untiled(vae, latents: torch.Tensor) -> torch.Tensor:
    saved = vae.use_tiling, vae.use_framewise_decoding
    vae.use_tiling = vae.use_framewise_decoding = False
    try:
        return decode_video(vae, latents)
    finally:
        vae.use_tiling, vae.use_framewise_decoding = saved


def test_default_decode_is_exact_and_equals_diffusers_untiled(pipe) -> None:
    latents = _latents(pipe)  # 5 latent frames: past diffusers' framewise threshold (4)
    telemetry = Telemetry()
    frames = pipe.decode_video_latents(latents, telemetry)
    reference = _untiled(pipe.vae, latents)
    assert frames.shape == reference.shape == (1, 17, 64, 64, 3)
    assert (frames - reference).abs().max().item() < 1e-5
    assert "exact" in telemetry.video_decode
    # diffusers' own default (framewise past 4 latent frames) is another decode, not a rounding of this one.
    assert (decode_video(pipe.vae, latents) - reference).abs().max().item() > 1e-3
    assert not pipe.vae.use_tiling  # loaded untiled: the reference image's encode is one whole frame


def test_tiled_mode_is_diffusers_tiled_decode(pipe, monkeypatch) -> None:
    # diffusers' tiles shrunk from 256 px (stride 192) to 64 px (stride 48), so a 96 px clip of 9 frames is decoded in
    # 2x2 spatial tiles: the same tiled code path at a fraction of the pixels the default tiles would need.
    for name, value in (("min_height", 64), ("min_width", 64), ("stride_height", 48), ("stride_width", 48)):
        monkeypatch.setattr(pipe.vae, f"tile_sample_{name}", value)
    latents = _latents(pipe, 3, 12, 12)
    monkeypatch.setattr(pipe, "options", pipe.options.replace(video_decode="tiled"))
    telemetry = Telemetry()
    frames = pipe.decode_video_latents(latents, telemetry)
    pipe.vae.enable_tiling()
    try:
        expected = decode_video(pipe.vae, latents)
    finally:
        pipe.vae.disable_tiling()
    assert torch.equal(frames, expected) and telemetry.video_decode.startswith("tiled")
    assert (frames - _untiled(pipe.vae, latents)).abs().max().item() > 1e-3  # tiles: not the untiled decode
    assert not pipe.vae.use_tiling  # tiling is on for that decode only


# At 5x16x16 latents (128 px) only a streamed plan fits SMALL (the planner keeps 256 MiB aside); ROOM fits the exact
# decode.
SHAPE, SMALL, ROOM = (5, 16, 16), 338 << 20, 2 << 30


def test_small_fits_a_streamed_plan_only(pipe) -> None:
    small = plan_video_decode(pipe.vae, SHAPE, budget_bytes=SMALL)
    assert small.mode == "streamed" and not small.exact
    assert plan_video_decode(pipe.vae, SHAPE, budget_bytes=ROOM).exact


def test_exact_decode_sends_the_dit_away_when_the_budget_needs_it(tiny_distill) -> None:
    pipe = Pipeline(tiny_distill, load_options(environ={}), device="cpu")
    try:
        latents = _latents(pipe, *SHAPE)
        assert not plan_video_decode(pipe.vae, SHAPE, budget_bytes=SMALL).exact
        budgets = iter([SMALL, ROOM])  # too small beside the DiT; room once it has gone
        pipe.free_budget = lambda: next(budgets)
        drops, drop = [], pipe.drop_dit
        pipe.drop_dit = lambda **kw: (drops.append(kw), drop(**kw))[1]
        telemetry = Telemetry()
        frames = pipe.decode_video_latents(latents, telemetry)
        assert pipe.runtime is None  # the DiT left; the next request reloads it ("dit_load")
        assert drops == [{"release": False}]  # its memory stays mapped for the decode (free_budget counts it free)
        assert "exact" in telemetry.video_decode and "the DiT's memory" not in telemetry.video_decode  # CUDA's only
        assert (frames - _untiled(pipe.vae, latents)).abs().max().item() < 1e-5

        # Where even an emptied device cannot hold the exact decode, the request fails and says what to change.
        pipe.free_budget = lambda: SMALL
        with pytest.raises(RequestError, match="K6_VIDEO_DECODE=streamed"):
            pipe.decode_video_latents(latents, telemetry)
    finally:
        pipe.close()


def test_streamed_mode_keeps_the_dit_when_a_streamed_plan_fits(tiny_distill) -> None:
    pipe = Pipeline(tiny_distill, load_options(environ={}).replace(video_decode="streamed"), device="cpu")
    try:
        latents = _latents(pipe, *SHAPE)
        pipe.free_budget = lambda: SMALL
        telemetry = Telemetry()
        frames = pipe.decode_video_latents(latents, telemetry)
        assert pipe.runtime is not None and telemetry.video_decode.startswith("streamed")
        plan = plan_video_decode(pipe.vae, SHAPE, budget_bytes=SMALL)
        assert torch.equal(frames, decode_video_fast(pipe.vae, latents, plan=plan))
        budgets = iter([1 << 20, SMALL])  # nothing fits beside the DiT: it leaves, then a streamed plan fits
        pipe.free_budget = lambda: next(budgets)
        pipe.decode_video_latents(latents, telemetry)
        assert pipe.runtime is None
    finally:
        pipe.close()


def test_a_request_whose_exact_decode_cannot_fit_fails_before_any_work(tiny_distill, monkeypatch) -> None:

    pipe = Pipeline(tiny_distill, load_options(environ={}), device="cpu")
    try:
        pipe.budget_bytes = 300 << 20  # below what the tiny decode needs at 64x64x17 (~330 MiB with its reserve)
        monkeypatch.setattr(pipe.text, "encode", lambda *a, **k: pytest.fail("text encoded"))
        with pytest.raises(RequestError, match="64x64 with 17 frames does not fit.*the exact video decode is what"):
            pipe.generate(Request(prompt="a cat", width=64, height=64, frames=17, steps=2))
    finally:
        pipe.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_sending_the_dit_away_frees_its_memory_and_the_next_request_reloads_it(tiny_distill) -> None:
    pipe = Pipeline(tiny_distill, load_options(environ={}), device="cuda")
    try:
        weights = int(0.9 * pipe.runtime.plan.weight_bytes)  # the planner's footprint; allocations round up
        before = torch.cuda.memory_allocated(pipe.device)
        free_before = pipe.free_budget()
        pipe.drop_dit()
        assert torch.cuda.memory_allocated(pipe.device) <= before - weights
        # The budget counts reserved memory. The tiny DiT's weights (under 1 MB) live in the allocator's 2 MiB
        # small-block segments beside other tensors, so their segments need not be released (the first run on an
        # H200 showed free room unchanged); a real DiT's weights fill whole large segments, which empty_cache returns.
        assert pipe.free_budget() >= free_before
        result = pipe.generate(Request(prompt="a cat", width=64, height=64, frames=17, steps=2))
        assert pipe.runtime is not None and "dit_load" in result.telemetry.phases
        assert "exact" in result.telemetry.video_decode

        # A decode that sends the DiT away says whether its memory stayed mapped (allocator.held_after_release could
        # count it) or was given back first.
        counted = held_after_release(pipe.device) is not None
        budgets = iter([lambda: 0, pipe.free_budget])  # nothing fits beside the DiT, then the real count
        pipe.free_budget = lambda: next(budgets)()
        telemetry = Telemetry()
        pipe.decode_video_latents(_latents(pipe, *SHAPE).to(pipe.device), telemetry)
        assert pipe.runtime is None and pipe.kept_mapped == counted
        kept = "kept mapped for it" if counted else "given back first (empty_cache)"
        assert telemetry.video_decode.endswith(f"; the DiT's memory {kept}")
    finally:
        pipe.close()
