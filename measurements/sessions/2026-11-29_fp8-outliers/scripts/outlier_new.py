"""Runs 16-17: the Triton channel choice (kernels/fp8_outliers.py) against torch's (the previous implementation), and
the whole fp8 layer with each, at the W1 shapes (triton.testing.do_bench medians, us)."""

import torch
import torch.nn.functional as F
import triton

from k6fast.kernels.fp8_linear import fp8_linear, quantize_rows_fp8, quantize_weight_fp8
from k6fast.kernels.fp8_outliers import outlier_columns, outlier_columns_ref


def torch_topk(x, c):  # the previous implementation (commit d75d9cf)
    flat = x.reshape(-1, x.shape[-1])
    top = flat[::64].abs().amax(dim=0).topk(c).indices.to(torch.int32)
    return torch.cat([top, top.new_full((128 - top.numel(),), -1)])


def b(fn):
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median") * 1e3


def shape(k, n):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(50220, k, device="cuda", generator=g)
    x[:, torch.randperm(k, device="cuda", generator=g)[: k // 512]] *= 30
    x = x.bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    cols = outlier_columns(x, 32)
    assert torch.equal(cols, outlier_columns_ref(x, 32))
    wq, ws = quantize_weight_fp8(w)
    wq2, ws2 = quantize_weight_fp8(w, residual_cols=cols)
    r = {
        "cols_torch_topk": b(lambda: torch_topk(x, 32)),
        "cols_triton": b(lambda: outlier_columns(x, 32)),
        "bf16": b(lambda: F.linear(x, w)),
        "fp8": b(lambda: fp8_linear(x, wq, ws, fast_accum=True)),
        "fp8_outlier32_old": b(lambda: fp8_linear(quantize_rows_fp8(x, torch_topk(x, 32)), wq2, ws2, fast_accum=True)),
        "fp8_outlier32": b(lambda: fp8_linear(quantize_rows_fp8(x, outlier_columns(x, 32)), wq2, ws2, fast_accum=True)),
    }
    print(f"K={k} N={n} " + " ".join(f"{a}={v:.1f}" for a, v in r.items()) + " us (do_bench medians)", flush=True)


for k, n in [(4096, 4096), (4096, 16384), (16384, 4096)]:
    shape(k, n)
