"""Run 15's breakdown of the outlier-column layer (at commit d75d9cf, where `outlier_columns` lived in fp8_linear and
used torch's topk): channel choice (torch, and a vector_norm variant), quantization, and the GEMM at K + 32/64/128."""

import torch
import torch.nn.functional as F
import triton

from k6fast.kernels.fp8_linear import fp8_linear, outlier_columns, quantize_rows_fp8, quantize_weight_fp8


def cols_v2(x, count):
    flat = x.reshape(-1, x.shape[-1])
    amax = torch.linalg.vector_norm(flat[::64], ord=float("inf"), dim=0)
    idx = amax.topk(count, sorted=False).indices
    return F.pad(idx.to(torch.int32), (0, 128 - count), value=-1)


def b(fn):
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median") * 1e3


def shape(k, n):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(50220, k, device="cuda", generator=g)
    x[:, torch.randperm(k, device="cuda", generator=g)[: k // 512]] *= 30
    x = x.bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    cols = outlier_columns(x, 32)
    c2 = cols_v2(x, 32)
    assert set(cols[:32].tolist()) == set(c2[:32].tolist()) and (c2[32:] == -1).all()
    wq, ws = quantize_weight_fp8(w)
    wq2, ws2 = quantize_weight_fp8(w, residual_cols=cols)
    xq, xs = quantize_rows_fp8(x)
    xq2, xs2 = quantize_rows_fp8(x, cols)
    r = {
        "bf16": b(lambda: F.linear(x, w)),
        "cols": b(lambda: outlier_columns(x, 32)),
        "cols_v2": b(lambda: cols_v2(x, 32)),
        "quant": b(lambda: quantize_rows_fp8(x)),
        "quant_cols": b(lambda: quantize_rows_fp8(x, cols)),
        "gemm_K": b(lambda: fp8_linear((xq, xs), wq, ws, fast_accum=True)),
        "gemm_K128": b(lambda: fp8_linear((xq2, xs2), wq2, ws2, fast_accum=True)),
    }
    for extra in (32, 64):  # the first K + extra columns of the 128-wide operands: timing only
        a, bw = xq2[:, : k + extra].contiguous(), wq2[:, : k + extra].contiguous()
        r[f"gemm_K{extra}"] = b(lambda a=a, bw=bw: fp8_linear((a, xs2), bw, ws2, fast_accum=True))
    r["fp8"] = b(lambda: fp8_linear(x, wq, ws, fast_accum=True))
    r["outlier"] = b(lambda: fp8_linear(quantize_rows_fp8(x, outlier_columns(x, 32)), wq2, ws2, fast_accum=True))
    r["outlier_v2"] = b(lambda: fp8_linear(quantize_rows_fp8(x, cols_v2(x, 32)), wq2, ws2, fast_accum=True))
    print(f"K={k} N={n} " + " ".join(f"{a}={v:.1f}" for a, v in r.items()) + " (us)", flush=True)


for k, n in [(4096, 4096), (4096, 16384), (16384, 4096)]:
    shape(k, n)
