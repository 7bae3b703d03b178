"""The pipeline's video decode by K6_VIDEO_DECODE on the tiny checkpoint (CPU, fp32): `exact` (the default) equals
diffusers' untiled decode and makes room by sending the DiT off the device when the budget needs it; `tiled` is
diffusers' tiled decode; `streamed` decodes in slabs inside what the budget leaves."""

from __future__ import annotations

import logging

import pytest
import torch

from k6fast.pipeline import Pipeline
from k6fast.switches import load_options
from k6fast.telemetry import Telemetry
from k6fast.vae import decode_video
from k6fast.video_decode import plan_video_decode


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
    frames = pipe._decode_video(latents, telemetry)
    reference = _untiled(pipe.vae, latents)
    assert frames.shape == reference.shape == (1, 17, 64, 64, 3)
    assert (frames - reference).abs().max().item() < 1e-5
    assert "exact" in telemetry.video_decode
    # diffusers' own default (framewise past 4 latent frames) is another decode, not a rounding of this one.
    assert (decode_video(pipe.vae, latents) - reference).abs().max().item() > 1e-3
    assert not pipe.vae.use_tiling  # loaded untiled: the reference image's encode is one whole frame


def test_tiled_mode_is_diffusers_tiled_decode(pipe, monkeypatch) -> None:
    latents = _latents(pipe)
    monkeypatch.setattr(pipe, "options", pipe.options.replace(video_decode="tiled"))
    telemetry = Telemetry()
    frames = pipe._decode_video(latents, telemetry)
    pipe.vae.enable_tiling()
    try:
        expected = decode_video(pipe.vae, latents)
    finally:
        pipe.vae.disable_tiling()
    assert torch.equal(frames, expected) and telemetry.video_decode.startswith("tiled")
    assert not pipe.vae.use_tiling  # tiling is on for that decode only


def test_exact_decode_sends_the_dit_away_when_the_budget_needs_it(tiny_distill, caplog) -> None:
    pipe = Pipeline(tiny_distill, load_options(environ={}), device="cpu")
    try:
        latents = _latents(pipe, 5, 32, 32)
        small, room = 400 << 20, 2 << 30  # 400 MiB: only a streamed plan fits (the planner keeps 256 MiB aside)
        assert not plan_video_decode(pipe.vae, (5, 32, 32), budget_bytes=small).exact
        budgets = iter([small, room, room])  # too small beside the DiT; room once it has gone
        pipe._free_budget = lambda: next(budgets)
        telemetry = Telemetry()
        frames = pipe._decode_video(latents, telemetry)
        assert pipe.runtime is None  # the DiT left; the next request reloads it ("dit_load")
        assert "exact" in telemetry.video_decode
        assert (frames - _untiled(pipe.vae, latents)).abs().max().item() < 1e-5

        # Where even an empty device cannot hold the exact decode, it streams and says so.
        pipe._free_budget = lambda: small
        with caplog.at_level(logging.WARNING, logger="k6fast.pipeline"):
            pipe._decode_video(latents, telemetry)
        assert "does not fit the VRAM budget" in caplog.text
        assert telemetry.video_decode.startswith("streamed")
    finally:
        pipe.close()
