"""Each request planned for its own geometry: the DiT's residency follows the request (a larger one streams more
blocks, the next smaller one brings them back, the output bit-identical throughout), and a request that cannot fit
the budget is refused before any work with the largest size and length that do fit."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from dit_testing import dit_inputs, tiny_dit

from k6fast.checkpoint import open_checkpoint
from k6fast.fit import largest_frames, largest_size, oversize_message
from k6fast.safetensors_index import index_safetensors
from k6fast.stream.plan import RESERVE_BYTES, GiB, activation_estimate, index_footprint
from k6fast.stream.runtime import build_dit

SMALL = (100, 10)  # (video, audio) tokens


def _larger(ckpt, blocks: float) -> tuple[int, int]:
    """SMALL plus enough video tokens for their activations to take `blocks` fused blocks' bytes."""
    cfg = ckpt.dit
    _, block = index_footprint(index_safetensors(ckpt.transformer_files), cfg.num_visual_blocks, 4)
    per_token = activation_estimate(1, 0, cfg.model_dim, cfg.model_dim_a, ff_dim=cfg.ff_dim)
    return SMALL[0] + -(-int(blocks * block) // per_token), SMALL[1]


def _budget_for(ckpt, tokens: tuple[int, int], resident: int) -> int:
    """The budget at which `resident` blocks plus two streaming slots just fit beside `tokens`' activations."""
    cfg = ckpt.dit
    fixed, block = index_footprint(index_safetensors(ckpt.transformer_files), cfg.num_visual_blocks, 4)
    act = activation_estimate(*tokens, cfg.model_dim, cfg.model_dim_a, ff_dim=cfg.ff_dim)
    return fixed + act + RESERVE_BYTES + (resident + 2) * block


def test_a_larger_request_streams_more_blocks_and_the_next_smaller_one_brings_them_back(tiny_distill) -> None:
    ckpt = open_checkpoint(tiny_distill)
    n = ckpt.dit.num_visual_blocks
    runtime = tiny_dit(ckpt)  # every block resident at its base geometry
    reference = tiny_dit(ckpt)
    base_planner = runtime.planner
    large = (SMALL[0] * 4, SMALL[1])
    # A tiny DiT has too few blocks for a budget to leave room for some resident blocks and two slots, so the
    # larger geometry's plan is the real planner's with the residency capped: `fit` is what is under test here.
    runtime.planner = lambda tokens: replace(base_planner(tokens), resident_blocks=0, slots=2) if tokens == large \
        else base_planner(tokens)  # fmt: skip
    try:
        assert runtime.streamer is None and runtime.plan.resident_blocks == n
        kwargs = dit_inputs(ckpt.dit, 1)
        want = reference.dit(**kwargs)
        assert runtime.plan_for(large).streamed_blocks == n
        runtime.fit(large)
        assert runtime.plan.resident_blocks == 0 and runtime.streamer is not None
        assert runtime.dit.blocks.streamer is runtime.streamer and not runtime.dit.blocks.resident
        for _ in range(2):  # the slots rotate through the cycle
            got = runtime.dit(**kwargs)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        runtime.fit(SMALL)  # back to the base plan: every block resident again, the stream closed
        assert runtime.plan == runtime.base_plan and runtime.streamer is None
        assert runtime.dit.blocks.streamer is None
        assert sorted(runtime.dit.blocks.resident) == list(range(n))
        got = runtime.dit(**kwargs)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    finally:
        runtime.close()
        reference.close()


def test_a_smaller_request_keeps_the_base_residency(tiny_distill) -> None:
    ckpt = open_checkpoint(tiny_distill)
    runtime = tiny_dit(ckpt, max_resident=0)  # built streaming every block
    base_planner = runtime.planner
    runtime.planner = lambda tokens: replace(base_planner(tokens), resident_blocks=ckpt.dit.num_visual_blocks, slots=0)
    try:
        assert runtime.plan.resident_blocks == 0
        assert runtime.plan_for((10, 1)) == runtime.base_plan  # more would fit; blocks are not moved for it
    finally:
        runtime.close()


def test_a_request_that_cannot_fit_even_streaming_is_refused_by_the_planner(tiny_distill) -> None:
    from k6fast.stream.plan import ResidencyError

    ckpt = open_checkpoint(tiny_distill)
    budget = _budget_for(ckpt, SMALL, resident=ckpt.dit.num_visual_blocks)
    runtime = build_dit(ckpt.transformer_files, ckpt.dit, "cpu", torch.float32, budget_bytes=budget, tokens=SMALL)
    try:
        with pytest.raises(ResidencyError, match="at least"):
            runtime.plan_for(_larger(ckpt, 2.5))
    finally:
        runtime.close()


def _fits_tokens(limit: int):
    """A stand-in for the planners: fits while width/16 x height/16 x latent frames stays within `limit`."""
    return lambda w, h, f: (w // 16) * (h // 16) * ((f - 1) // 4 + 2) <= limit


def test_largest_frames_and_size_are_the_exact_boundaries() -> None:
    fits = _fits_tokens(54 * 30 * 20)  # at 864x480: 19 latent frames + the tail, 73 frames
    assert largest_frames(fits, 864, 480) == 73
    assert fits(864, 480, 73) and not fits(864, 480, 77)
    assert largest_frames(fits, 864, 480, limit=41) == 41
    assert largest_frames(_fits_tokens(0), 864, 480) is None
    w, h = largest_size(fits, 1280, 720, 121)
    assert fits(w, h, 121) and w % 16 == 0 and h % 16 == 0 and w > h
    assert not fits(w + 16, round((w + 16) * 9 / 16 / 16) * 16, 121)  # the next size up does not fit
    assert largest_size(fits, 720, 1280, 121) == (h, w)  # portrait: the same sizes, turned
    assert largest_size(_fits_tokens(0), 1280, 720, 121) is None


def test_the_oversize_message_names_what_fits() -> None:
    fits = _fits_tokens(54 * 30 * 20)
    message = oversize_message(fits, 1280, 720, 241, "a 32.0 GiB budget")
    assert message.startswith("1280x720 with 241 frames does not fit a 32.0 GiB budget")
    most = largest_frames(fits, 1280, 720, 241)
    w, h = largest_size(fits, 1280, 720, 241)
    assert f"at 1280x720 at most {most} frames" in message and f"at 241 frames at most {w}x{h}" in message


def _pipeline_at_budget(root, budget_bytes: int):
    from k6fast.pipeline import Pipeline
    from k6fast.switches import load_options

    return Pipeline(root, load_options({"K6_VRAM_BUDGET_GB": f"{budget_bytes / GiB!r}"}), device="cpu")


def test_the_pipeline_refuses_a_request_that_cannot_fit_before_any_work(tiny_distill) -> None:
    from k6fast.request import Request, RequestError, dit_tokens

    ckpt = open_checkpoint(tiny_distill)
    cfg = ckpt.dit
    fixed, block = index_footprint(index_safetensors(ckpt.transformer_files), cfg.num_visual_blocks, 4)
    # Room for the fixed weights, two streaming slots and the activations of 512x512x65 (more than the text phase
    # takes), and no more.
    act = activation_estimate(*dit_tokens(512, 512, 65), cfg.model_dim, cfg.model_dim_a, ff_dim=cfg.ff_dim)
    assert act > _text_bytes(tiny_distill)
    pipe = _pipeline_at_budget(tiny_distill, fixed + act + RESERVE_BYTES + 2 * block + 1024)
    try:
        assert pipe.fits(512, 512, 65) and not pipe.fits(512, 512, 69) and not pipe.fits(528, 528, 65)
        pipe.resolve(Request(prompt="a fox", width=512, height=512, frames=65))  # fits: no error
        with pytest.raises(RequestError) as err:
            pipe.generate(Request(prompt="a fox", width=768, height=768, frames=97))
        message = str(err.value)
        assert message.startswith("768x768 with 97 frames does not fit the VRAM budget of")
        assert "at 768x768 at most" in message and "at 97 frames at most" in message
        assert "K6_VRAM_BUDGET_GB" in message
        assert largest_frames(pipe.fits, 512, 512) == 65
    finally:
        pipe.close()


def _text_bytes(root) -> int:
    """The text phase's peak in fp32 (the CPU's compute dtype): the plan keeps room for it or the activations."""
    from k6fast.text_plan import text_footprint, text_weights

    return text_footprint(text_weights(root), "F32").device_bytes
