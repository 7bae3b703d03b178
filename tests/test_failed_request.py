"""A request that fails inside the DiT leaves the runtime clean: the next forward on the same runtime gives what a
fresh runtime gives, and the streamer's timing bookkeeping holds only finished blocks.

CPU: a fault injected in a chosen block of a streamed forward. GPU: a real CUDA out-of-memory error raised inside a
block, then the streamer's CUDA-event timings collected and the next forward served.
"""

from __future__ import annotations

import pytest
import torch
from dit_testing import tiny_dit

from k6fast.checkpoint import open_checkpoint
from k6fast.dit.backend import ExactBackend


class _FailingBackend(ExactBackend):
    """The exact backend, raising `error()` in the feed-forward of one block of the next forward it sees."""

    def __init__(self, fail_block: int, error):
        self.fail_block, self.error, self.armed, self.block = fail_block, error, False, -1

    def begin_block(self, block: int, num_blocks: int) -> None:
        self.block = block

    def gelu(self, x):
        if self.armed and self.block == self.fail_block:
            self.armed = False
            raise self.error()
        return super().gelu(x)


def _inputs(cfg, device, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    kw = dict(
        hidden_states=torch.randn(1, 3, 4, 6, cfg.visual_in_channels, generator=g),
        encoder_hidden_states=torch.randn(1, 5, cfg.in_text_dim, generator=g),
        pooled_projections=torch.randn(1, cfg.in_text_dim2, generator=g),
        timestep=torch.tensor([500.0]),
        audio_hidden_states=torch.randn(1, 4, cfg.in_audio_dim, generator=g),
    )
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() and k != "timestep" else v.dtype)
            for k, v in kw.items()}  # fmt: skip


@pytest.mark.parametrize("fail_block", [0, 1])
def test_a_forward_that_raises_in_a_block_leaves_the_stream_usable(tiny_distill, fail_block: int) -> None:
    ckpt = open_checkpoint(tiny_distill)
    cpu = torch.device("cpu")
    backend = _FailingBackend(fail_block, lambda: RuntimeError("injected fault"))
    fresh = tiny_dit(ckpt, cpu, torch.float32)
    failing = tiny_dit(ckpt, cpu, torch.float32, backend=backend, max_resident=0)
    try:
        kwargs = _inputs(ckpt.dit, cpu, torch.float32, seed=3)
        backend.armed = True
        with pytest.raises(RuntimeError, match="injected fault"):
            failing.dit(**kwargs)
        assert not backend.armed  # the fault fired inside the block asked for
        for seed in (3, 4):  # the failed request's inputs again, then another request
            kwargs = _inputs(ckpt.dit, cpu, torch.float32, seed=seed)
            a, b = fresh.dit(**kwargs), failing.dit(**kwargs)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    finally:
        fresh.close()
        failing.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_real_oom_in_a_streamed_block_fails_only_that_request_gpu(tiny_distill) -> None:
    ckpt = open_checkpoint(tiny_distill)
    cuda = torch.device("cuda")

    def oom():  # a genuine allocation the card cannot satisfy, not a hand-made exception object
        return torch.empty(1 << 50, dtype=torch.uint8, device=cuda)

    backend = _FailingBackend(1, oom)
    fresh = tiny_dit(ckpt, cuda, torch.bfloat16)
    failing = tiny_dit(ckpt, cuda, torch.bfloat16, backend=backend, max_resident=0)
    try:
        streamer = failing.streamer
        kwargs = _inputs(ckpt.dit, cuda, torch.bfloat16, seed=1)
        failing.dit(**kwargs)
        assert len(streamer.collect_timings()) == ckpt.dit.num_visual_blocks  # a clean forward: every block timed
        backend.armed = True
        with pytest.raises(torch.OutOfMemoryError):
            failing.dit(**kwargs)
        assert streamer.collect_timings() == []  # nothing of the failed forward, and no unrecorded CUDA event
        for seed in (1, 2):
            kwargs = _inputs(ckpt.dit, cuda, torch.bfloat16, seed=seed)
            a, b = fresh.dit(**kwargs), failing.dit(**kwargs)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            assert len(streamer.collect_timings()) == ckpt.dit.num_visual_blocks
    finally:
        fresh.close()
        failing.close()
