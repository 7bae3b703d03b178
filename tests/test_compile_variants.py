"""A compiled block with quantized attention (the `fast` arm's shape of things) compiles its two variants, exact and
quantized, once: no graph break inside the quantized attention, and a second request compiles nothing (it once
recompiled the exact first step, 5-7 s per W1 request on the H200). Tiny checkpoint, CPU: the k6 kernel's
head-dim check is widened to the tiny model's 16 so that the quantized path (its PyTorch reference on the CPU) is
traced as on the GPU."""

from __future__ import annotations

import pytest
import torch

from k6fast.pipeline import Pipeline, Request
from k6fast.switches import load_options

pytestmark = pytest.mark.slow


def test_second_request_compiles_nothing(tiny_distill, monkeypatch) -> None:
    from torch._dynamo.utils import counters

    import k6fast.dit.attention as dispatch
    import k6fast.kernels.quant_attention_prologue as qp

    monkeypatch.setattr(dispatch, "SUPPORTED_HEAD_DIMS", (16, 64, 128))
    monkeypatch.setattr(qp, "SUPPORTED_HEAD_DIMS", (16, 64, 128))
    torch._dynamo.reset()
    counters.clear()
    # The tiny model has 2 fused blocks: `fast`'s exact first and last 2 would leave none lossy. Compile on whatever
    # the arm file says: this test is about the compiled block.
    environ = {"K6_EXACT_ATTN_BLOCKS": "0", "K6_COMPILE": "1"}
    pipe = Pipeline(tiny_distill, load_options(environ=environ, arm="fast"), device="cpu")
    try:
        request = Request(prompt="a lighthouse in fog", width=64, height=64, frames=9, steps=10)
        pipe.generate(request)
        graphs = counters["stats"]["unique_graphs"]
        assert graphs >= 2, "expected the exact and the quantized variants of the compiled block"
        assert not counters["graph_break"], dict(counters["graph_break"])
        pipe.generate(request)
        assert counters["stats"]["unique_graphs"] == graphs, "the second request compiled again"
    finally:
        pipe.close()
        torch._dynamo.reset()


def test_prompts_of_other_lengths_reuse_the_compiled_block(tiny_distill) -> None:
    # The prompt's token count is a symbol of the compiled block: a served stream of prompts compiled the block once
    # per new length (2.3-3.1 s each on the H200, with a warm cache) and, past Dynamo's recompile limit, would have
    # run it uncompiled. A length seen before gives the latents it gave then.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    pipe = Pipeline(tiny_distill, load_options(environ={"K6_COMPILE": "1"}, arm="final"), device="cpu")
    try:
        prompts = ("a lighthouse in fog", "a lighthouse in fog at night, waves crashing on the rocks below it", "cat")
        latents = []
        for prompt in (*prompts, prompts[0]):
            result = pipe.generate(Request(prompt=prompt, width=64, height=64, frames=9, steps=10))
            latents.append(result.latents["video"])
            assert counters["stats"]["unique_graphs"] == 1, f"{prompt!r} compiled the block again"
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert torch.equal(latents[0], latents[-1])
        assert not torch.equal(latents[0], latents[1])  # the prompt reached the block
    finally:
        pipe.close()
        torch._dynamo.reset()
