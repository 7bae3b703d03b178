"""The residency planner's activation estimate held against what one Pro-size fused block really allocates on the
GPU, for each arm's kernels (exact reference, fused elementwise, the lossy fp8 + quantized-attention path).

The block runs at a reduced token count (the activations scale with tokens; the estimate is per token) with random
weights of the real Pro shapes; the peak is measured above the weights and inputs, as the planner counts it.
"""

from __future__ import annotations

import pytest
import torch

from k6fast.bench.workload import Geometry, block_inputs
from k6fast.dit.config import DiTConfig, fused_block_shapes, is_fp32_tensor
from k6fast.stream.plan import activation_estimate
from k6fast.testing.synthetic import transformer_config

# 864x480 at 17 frames: 5 latent frames, 8,100 video tokens; the audio stream of that clip.
GEOMETRY = Geometry(864, 480, 17)
AUDIO_TOKENS = 31


def _pro_block(device: torch.device) -> tuple[DiTConfig, dict[str, torch.Tensor]]:
    cfg = DiTConfig.from_dict(transformer_config("pro-distill", 1))
    g = torch.Generator(device=device).manual_seed(0)
    weights = {}
    for name, shape in fused_block_shapes(cfg).items():
        dtype = torch.float32 if is_fp32_tensor(name) else torch.bfloat16
        weights[name] = (torch.randn(shape, device=device, generator=g) * 0.02).to(dtype)
    return cfg, weights


ARMS = {
    "reference": {},
    "fused": {"fused_elementwise": True},
    "fast-eager": {"fused_elementwise": True, "gemm": "fp8", "attn": "k6", "quant_attn_sites": "self"},
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arm", list(ARMS))
def test_activation_estimate_covers_a_pro_blocks_measured_peak_gpu(arm: str) -> None:
    from k6fast.dit.backend import SwitchedBackend
    from k6fast.dit.blocks import fused_block
    from k6fast.switches import Options

    device = torch.device("cuda", torch.cuda.current_device())
    cfg, weights = _pro_block(device)
    inputs = block_inputs(cfg, GEOMETRY, AUDIO_TOKENS, device, torch.bfloat16, seed=0)
    options = Options().replace(gemm_min_rows=1, **ARMS[arm])
    backend = SwitchedBackend(options, device)
    backend.begin_step(1)
    backend.begin_block(30, 60)  # a middle block of a later step: where the lossy kernels run
    with torch.no_grad():
        fused_block(backend, cfg, weights, inputs.vis, inputs.aud, inputs.shared)  # warm-up: kernels, workspaces
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fused_block(backend, cfg, weights, inputs.vis, inputs.aud, inputs.shared)
        torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    tokens = inputs.vis.shape[1]
    estimate = activation_estimate(tokens, AUDIO_TOKENS, cfg.model_dim, cfg.model_dim_a, ff_dim=cfg.ff_dim,
                                   fp8_gemm=options.gemm == "fp8", quant_attention=options.attn != "exact")  # fmt: skip
    print(f"{arm}: measured {measured / tokens:.0f} B/token, estimate {estimate / tokens:.0f} B/token")
    assert out[0].shape == inputs.vis.shape
    assert measured <= estimate, (
        f"{arm}: the block peaked {measured / 2**20:.0f} MiB above its inputs, the planner allows "
        f"{estimate / 2**20:.0f} MiB"
    )
    # Not so loose that the planner gives away resident blocks for nothing.
    assert estimate <= 2.5 * measured, f"{arm}: estimate {estimate / 2**20:.0f} MiB vs measured {measured / 2**20:.0f}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_whole_card_means_what_is_free_less_what_cuda_adds_gpu(caplog) -> None:
    from k6fast.allocator import device_budget
    from k6fast.memory import OUTSIDE_ALLOCATOR_BYTES

    device = torch.device("cuda", torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(device)
    available = free + torch.cuda.memory_reserved(device) - OUTSIDE_ALLOCATOR_BYTES
    whole = device_budget(device, 0)
    assert abs(whole - available) < 64 * 2**20 and whole < total  # within what other work moved meanwhile
    too_big = device_budget(device, 2 * total / 2**30)  # more than the card: lowered, with a warning
    assert too_big <= available + 64 * 2**20 and "more than this GPU has free" in caplog.text
    assert device_budget(device, 4.0) == 4 * 2**30
    torch.cuda.set_per_process_memory_fraction(1.0, device)  # leave the process as the other tests expect it
