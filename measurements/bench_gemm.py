"""GEMM micro-benchmark at the K6 W1 linear-layer shapes: cuBLAS BF16 vs FP8 row-wise vs FP16-accumulate.

M = 50220 video tokens; (K, N) = (4096, 4096) attention projections, (4096, 16384) FFN up, (16384, 4096) FFN down.
Variants per shape, each checked for correctness before it is timed:
  cublas_bf16         F.linear(x, w), bf16: the baseline and the BF16 ceiling
  cublas_fp16         F.linear on fp16 copies (fp32 accumulation): the ceiling for fp16 operands
  fp8                 fp8_linear(x, wq, w_scale, fast_accum=True): Triton row quantization of x + torch._scaled_mm
                      with fast accumulation, what a layer of the fp8 arm costs (k6fast/dit/linear.py)
  fp8_outlier32       fp8 with 32 outlier columns (k6fast/kernels/fp8_outliers.py), what a layer of the fp8
                      arm costs on bf16 weights: channel choice + row quantization with the extra columns + a K+128
                      GEMM (the weight's residual columns are built outside the timing, as the weight itself is)
  fp8_exact_accum     the same with fp32-promoted accumulation (use_fast_accum=False)
  fp8_gemm            torch._scaled_mm alone on pre-quantized x: the FP8 ceiling
  fp8_gemm_fast_accum the same with use_fast_accum=True
  fp8_quantize        quantize_rows_fp8(x) alone (reported in GB/s too)
  fp16acc_k32/k64     fp16acc_linear(x bf16, w fp16, k_chunk=32/64): A converted to fp16 inside the kernel
  fp16acc_k32_fp16x   the same on an fp16 x: the GEMM alone
  fp8_fp16acc         k6fast/kernels/fp8_fp16acc.py on operands quantized to its range (±44), the GeForce fp8 path
                      (K6_GEMM=fp8 on sm_89/sm_120); runs on any sm_89+ GPU, so an H200 checks its numerics
  mxfp8, nvfp4        blockscaled_linear with the activation quantization (torchao), weights pre-quantized:
                      torch._scaled_mm's block-scaled path, sm_100/sm_120 only (skipped elsewhere)
Targets: fp8 (with quantization) ≥ 1.6× cublas_bf16; fp16acc within 10% of cublas_bf16 on H200 (FP16-accumulate MMA
is not faster than FP32-accumulate on datacenter cards; the kernel exists for GeForce sm_89/sm_120).

Run:  python measurements/bench_gemm.py --out measurements/results/gemm_h200.json
      (--shapes 4096x4096 picks shapes, --m the row count)
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from bench_common import gemm_shapes_main, quantiles_ms, rel_l2

from k6fast.kernels.fp8_fp16acc import DEFAULT_CHUNK, FP16_CHUNK_QMAX, fp8_fp16acc_linear
from k6fast.kernels.fp8_linear import (
    fp8_linear,
    fp8_linear_ref,
    fp16acc_linear,
    fp16acc_linear_ref,
    quantize_rows_fp8,
    quantize_rows_fp8_ref,
    quantize_weight_fp8,
)
from k6fast.kernels.fp8_outliers import outlier_columns

# e4m3 rounding floor for DiT-like data ≈ 3.5% relative L2 vs the bf16 product (see tests/test_fp8_linear.py).
FP8_REL_L2_LIMIT = 0.045


def dit_like(m: int, k: int, n: int, seed: int = 0):
    """x [m, k] bf16 with a few outlier channels (×30), w [n, k] bf16 ~ N(0, 0.02²), on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g)
    outliers = torch.randperm(k, device="cuda", generator=g)[: max(1, k // 512)]
    x[:, outliers] *= 30.0
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    return x.bfloat16(), w.bfloat16()


def bench_shape(m: int, k: int, n: int, rep_ms: int) -> list[dict]:
    x, w = dit_like(m, k, n)
    w16, x16 = w.half(), x.half()
    wq, ws = quantize_weight_fp8(w)
    xq, xs = quantize_rows_fp8(x)
    # References on the first 2048 rows and the last 300 (partial last tile); full-size fp32 products cost GBs.
    rows = torch.cat([torch.arange(2048), torch.arange(m - 300, m)]).cuda()
    exact = x[rows].float() @ w.float().t()
    exact_quantized = fp8_linear_ref((xq[rows], xs[rows]), wq, ws, out_dtype=torch.float32)
    exact_fp16 = fp16acc_linear_ref(x[rows], w16, out_dtype=torch.float32)
    err_cublas = rel_l2(F.linear(x[rows], w), exact)
    cols = outlier_columns(x, 32)
    wq_out, ws_out = quantize_weight_fp8(w, residual_cols=cols)
    exact_quantized_out = fp8_linear_ref(quantize_rows_fp8(x[rows], cols), wq_out, ws_out, out_dtype=torch.float32)

    def fp8_outlier32():
        return fp8_linear(quantize_rows_fp8(x, outlier_columns(x, 32)), wq_out, ws_out, fast_accum=True)

    def scaled_mm(fast_accum: bool):
        return lambda: torch._scaled_mm(
            xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16, use_fast_accum=fast_accum
        )

    qmax = FP16_CHUNK_QMAX[DEFAULT_CHUNK]
    wq16, ws16 = quantize_weight_fp8(w, qmax=qmax)
    exact_fp16_chunks = fp8_linear_ref(quantize_rows_fp8(x[rows], qmax=qmax), wq16, ws16, out_dtype=torch.float32)
    variants = {
        "cublas_bf16": (lambda: F.linear(x, w), lambda y: (rel_l2(y[rows], exact), 2 * err_cublas + 1e-6)),
        "cublas_fp16": (lambda: F.linear(x16, w16), lambda y: (rel_l2(y[rows], exact), 2 * err_cublas + 1e-6)),
        "fp8": (lambda: fp8_linear(x, wq, ws, fast_accum=True), lambda y: (rel_l2(y[rows], exact_quantized), 2e-2)),
        "fp8_outlier32": (fp8_outlier32, lambda y: (rel_l2(y[rows], exact_quantized_out), 2e-2)),
        "fp8_exact_accum": (lambda: fp8_linear(x, wq, ws), lambda y: (rel_l2(y[rows], exact_quantized), 5e-3)),
        "fp8_gemm": (scaled_mm(False), lambda y: (rel_l2(y[rows], exact_quantized), 5e-3)),
        "fp8_gemm_fast_accum": (scaled_mm(True), lambda y: (rel_l2(y[rows], exact_quantized), 2e-2)),
        "fp8_quantize": (lambda: quantize_rows_fp8(x), None),
        "fp16acc_k32": (
            lambda: fp16acc_linear(x, w16, k_chunk=32),
            lambda y: (rel_l2(y[rows], exact_fp16), 2 * err_cublas + 1e-3),
        ),
        "fp16acc_k64": (
            lambda: fp16acc_linear(x, w16, k_chunk=64),
            lambda y: (rel_l2(y[rows], exact_fp16), 2 * err_cublas + 1e-3),
        ),
        "fp16acc_k32_fp16x": (
            lambda: fp16acc_linear(x16, w16, k_chunk=32),
            lambda y: (rel_l2(y[rows], exact_fp16), 2 * err_cublas + 1e-3),
        ),
        "fp8_fp16acc": (
            lambda: fp8_fp16acc_linear(quantize_rows_fp8(x, qmax=qmax), wq16, ws16),
            lambda y: (rel_l2(y[rows], exact_fp16_chunks), 1e-2),
        ),
    }
    variants |= _blockscaled_variants(x, w, rows, exact)
    flop = 2.0 * m * n * k
    results = []
    for name, (fn, check) in variants.items():
        row = {"shape": f"M={m} K={k} N={n}", "variant": name}
        if check is not None:
            err, limit = check(fn())  # the first call also runs the fp16acc autotuner
            row |= {"rel_l2": err, "limit": limit, "ok": err <= limit}
        else:
            q, s = fn()
            q_ref, s_ref = quantize_rows_fp8_ref(x[rows])
            ok = torch.equal(q[rows].view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s[rows], s_ref)
            row |= {"ok": ok}
        if name in ("fp8", "fp8_outlier32", "fp8_fp16acc"):
            row["rel_l2_vs_bf16"] = rel_l2(fn()[rows], exact)
            row["ok"] = row["ok"] and row["rel_l2_vs_bf16"] <= FP8_REL_L2_LIMIT
        if not row["ok"]:
            results.append(row)
            print(f"FAILED correctness: {row}", file=sys.stderr)
            continue
        p20, p50, p80 = quantiles_ms(fn, rep_ms)
        row |= {"p20_ms": p20, "p50_ms": p50, "p80_ms": p80}
        if name == "fp8_quantize":
            row["GBps"] = (m * k * 2 + m * k + m * 4) / (p50 * 1e-3) / 1e9
        else:
            row["TFLOPs"] = flop / (p50 * 1e-3) / 1e12
        results.append(row)
        print(f"  {row['shape']:<24} {name:<20} p50 {p50:8.3f} ms", flush=True)
    base = next(r for r in results if r["variant"] == "cublas_bf16")
    fp8_ceiling = next(r for r in results if r["variant"] == "fp8_gemm")
    for r in results:
        if "p50_ms" in r and "p50_ms" in base:
            r["speedup_vs_cublas_bf16"] = base["p50_ms"] / r["p50_ms"]
        if r["variant"].startswith("fp8") and "p50_ms" in r and "p50_ms" in fp8_ceiling:
            r["fraction_of_fp8_ceiling"] = fp8_ceiling["p50_ms"] / r["p50_ms"]
    return results


def _blockscaled_variants(x, w, rows, exact) -> dict:
    """mxfp8 / nvfp4 on sm_100 / sm_12x (torch._scaled_mm block-scaled), checked against the exact product within the
    formats' layer-error bounds (tests/test_blockscaled.py)."""
    if torch.cuda.get_device_capability()[0] not in (10, 12):
        print("  mxfp8, nvfp4: skipped (no block-scaled tensor cores on this GPU)", flush=True)
        return {}
    from k6fast.kernels.blockscaled import blockscaled_linear, quantize_weight

    out = {}
    for fmt, limit in (("mxfp8", 0.039), ("nvfp4", 0.135)):
        wq = quantize_weight(w, fmt)
        out[fmt] = (lambda wq=wq, fmt=fmt: blockscaled_linear(fmt, x, wq),
                    lambda y, limit=limit: (rel_l2(y[rows], exact), limit))  # fmt: skip
    return out


def print_table(env: dict, results: list[dict]) -> None:
    print(f"\n{env['gpu']} ({env['capability']}), torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}")
    header = f"{'shape':<24} {'variant':<20} {'p20 ms':>8} {'p50 ms':>8} {'p80 ms':>8} {'TFLOP/s':>8} {'vs bf16':>8}"
    print(header + "  check")
    for r in results:
        if "p50_ms" not in r:
            print(f"{r['shape']:<24} {r['variant']:<20} {'FAILED correctness':>44}  {r}")
            continue
        rate = f"{r['TFLOPs']:8.0f}" if "TFLOPs" in r else f"{r['GBps']:6.0f}GB"
        check = f"rel {r['rel_l2']:.1e} ≤ {r['limit']:.1e}" if "rel_l2" in r else "bit-exact"
        if "rel_l2_vs_bf16" in r:
            check += f"; vs bf16 {r['rel_l2_vs_bf16']:.3f}"
        print(
            f"{r['shape']:<24} {r['variant']:<20} {r['p20_ms']:8.3f} {r['p50_ms']:8.3f} {r['p80_ms']:8.3f} "
            f"{rate} {r.get('speedup_vs_cublas_bf16', float('nan')):7.2f}x  {check}"
        )
    print("targets: fp8 ≥ 1.60x cublas_bf16 (quantization included); fp16acc ≥ 0.90x cublas_bf16 on H200; on an")
    print("RTX 5090 (modelled, measurements/model_5090.md): fp8_fp16acc, mxfp8 ≈ 4x and fp16acc ≈ 1.5-2x cublas_bf16")


if __name__ == "__main__":
    gemm_shapes_main("gemm", __doc__, bench_shape, print_table)
