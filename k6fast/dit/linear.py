"""Linear-layer dispatch: cuBLAS bf16 (reference), Triton fp16-accumulate, or fp8 e4m3 row-wise, per layer.

Modulation, time-embedding and pooled-text layers always stay exact (fp32): one row each, and their outputs scale
every residual update. Layers with fewer rows than `K6_GEMM_MIN_ROWS` stay bf16 too: below a few thousand rows the
quantization passes cost more than the faster GEMM saves (the audio stream's 218 tokens, text tokens).
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch import Tensor

from ..switches import Options

EXACT_LAYERS = ("modulation", "time_embeddings", "pooled_text_embeddings")


class LinearDispatch:
    def __init__(self, options: Options):
        self.kind = options.gemm
        self.min_rows = options.gemm_min_rows
        self.counts: Counter[str] = Counter()  # backend → calls

    def use_fast(self, rows: int, weight_shape: tuple[int, ...], name: str) -> bool:
        """The policy alone: which layers the fast GEMM takes (the caller also requires CUDA tensors)."""
        if self.kind == "bf16" or any(part in name for part in EXACT_LAYERS):
            return False
        # fp8 row-wise scaled_mm needs K and N multiples of 16.
        return rows >= self.min_rows and weight_shape[0] % 16 == 0 and weight_shape[1] % 16 == 0

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None, *, name: str) -> Tensor:
        """x: [..., K]; weight: [N, K]; bias: [N] or None → [..., N] in x.dtype."""
        counting = not torch.compiler.is_compiling()  # Python state would become a compile guard
        if not (x.is_cuda and self.use_fast(x.numel() // x.shape[-1], tuple(weight.shape), name)):
            if counting:
                self.counts["bf16"] += 1
            return F.linear(x, weight, bias)
        if counting:
            self.counts[self.kind] += 1
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        if self.kind == "fp8":
            from ..kernels.fp8_linear import fp8_linear, quantize_weight_fp8

            # Weights are quantized at use: streamed blocks arrive in reused slots, so a cache keyed by tensor would
            # go stale; the pass reads each weight once (≈ 0.3 % of the block's time at W1). A pre-quantized
            # checkpoint removes it.
            wq, w_scale = quantize_weight_fp8(weight)
            out = fp8_linear(flat, wq, w_scale, bias=None if bias is None else bias.to(x.dtype), out_dtype=x.dtype)
        else:
            from ..kernels.fp8_linear import fp16acc_linear

            out = fp16acc_linear(flat, weight, bias, out_dtype=x.dtype)
        return out.reshape(*x.shape[:-1], weight.shape[0])
