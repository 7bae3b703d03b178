"""NVFP4 linear micro-benchmark at the K6 W1 shapes: the Triton dequantize-in-prologue GEMM vs cuBLAS BF16.

M = 50220 video tokens; (K, N) = (4096, 4096) attention projections, (4096, 16384) FFN up, (16384, 4096) FFN down.
Variants per shape, each checked for correctness before it is timed:
  cublas_bf16        F.linear(x, w), bf16: the baseline
  nvfp4              nvfp4_linear(x, packed, block_scales, global_scale): the Triton dequantize-in-prologue GEMM
                     (checked against the fp32 product of the dequantized weight, and against the bf16 product)
  nvfp4_dequant      dequantize_nvfp4 + F.linear: what the DiT runtime runs for an nvfp4 checkpoint's layer
  fp8_stored         fp8_linear(x, wq, w_scale) on a pre-quantized e4m3 weight: an fp8 checkpoint's layer
The nvfp4 kernel exists to cut the bytes a streamed block moves (0.28x of bf16), not for speed: there is no target
against cuBLAS; the numbers say what the streamed-byte saving costs in GEMM time.

Run:  python measurements/bench_nvfp4.py --out measurements/results/nvfp4_h200.json
      (--shapes 4096x4096 picks shapes, --m the row count)
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from bench_common import gemm_shapes_main, quantiles_ms, rel_l2

from k6fast.kernels.fp8_linear import fp8_linear, fp8_linear_ref, quantize_rows_fp8, quantize_weight_fp8
from k6fast.kernels.nvfp4 import dequantize_nvfp4, nvfp4_linear, nvfp4_linear_ref, quantize_nvfp4

# E2M1 + e4m3 block scales: ≈ 9.5% relative L2 vs the bf16 product on DiT-like data (tests/test_nvfp4.py).
NVFP4_REL_L2_LIMIT = 0.12
FP8_REL_L2_LIMIT = 0.045


def dit_like(m: int, k: int, n: int, seed: int = 0):
    """x [m, k] bf16 with a few outlier channels (×30), w [n, k] bf16 ~ N(0, 0.02²) with a few outliers (×20)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g)
    x[:, torch.randperm(k, device="cuda", generator=g)[: max(1, k // 512)]] *= 30.0
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    w.view(-1)[torch.randperm(n * k, device="cuda", generator=g)[: max(1, n * k // 4096)]] *= 20.0
    return x.bfloat16(), w.bfloat16()


def bench_shape(m: int, k: int, n: int, rep_ms: int) -> list[dict]:
    x, w = dit_like(m, k, n)
    q = quantize_nvfp4(w)
    wq, ws = quantize_weight_fp8(w)
    # References on the first 2048 rows and the last 300 (partial last tile); full-size fp32 products cost GBs.
    rows = torch.cat([torch.arange(2048), torch.arange(m - 300, m)]).cuda()
    exact = x[rows].float() @ w.float().t()
    exact_nvfp4 = nvfp4_linear_ref(x[rows].float(), *q)
    xq, xs = quantize_rows_fp8(x[rows])
    exact_fp8 = fp8_linear_ref((xq, xs), wq, ws, out_dtype=torch.float32)
    err_cublas = rel_l2(F.linear(x[rows], w), exact)

    variants = {
        "cublas_bf16": (lambda: F.linear(x, w), [(exact, 2 * err_cublas + 1e-6)]),
        "nvfp4": (lambda: nvfp4_linear(x, *q), [(exact_nvfp4, 5e-3), (exact, NVFP4_REL_L2_LIMIT)]),
        "nvfp4_dequant": (lambda: F.linear(x, dequantize_nvfp4(*q)), [(exact_nvfp4, 5e-3)]),
        "fp8_stored": (lambda: fp8_linear(x, wq, ws), [(exact_fp8, 5e-3), (exact, FP8_REL_L2_LIMIT)]),
    }
    weight_bytes = {
        "cublas_bf16": 2 * n * k,
        "nvfp4": n * k // 2 + n * k // 16 + 4,
        "nvfp4_dequant": n * k // 2 + n * k // 16 + 4,
        "fp8_stored": n * k + 4 * n,
    }
    flop = 2.0 * m * n * k
    results = []
    for name, (fn, checks) in variants.items():
        row = {"shape": f"M={m} K={k} N={n}", "variant": name, "weight_bytes": weight_bytes[name]}
        y = fn()[rows]  # the first call also runs the nvfp4 autotuner
        row["checks"] = [{"rel_l2": rel_l2(y, ref), "limit": limit} for ref, limit in checks]
        row["ok"] = all(c["rel_l2"] <= c["limit"] for c in row["checks"])
        if not row["ok"]:
            results.append(row)
            print(f"FAILED correctness: {row}", file=sys.stderr)
            continue
        p20, p50, p80 = quantiles_ms(fn, rep_ms)
        row |= {"p20_ms": p20, "p50_ms": p50, "p80_ms": p80, "TFLOPs": flop / (p50 * 1e-3) / 1e12}
        results.append(row)
        print(f"  {row['shape']:<24} {name:<14} p50 {p50:8.3f} ms", flush=True)
    base = next(r for r in results if r["variant"] == "cublas_bf16")
    for r in results:
        if "p50_ms" in r and "p50_ms" in base:
            r["speedup_vs_cublas_bf16"] = base["p50_ms"] / r["p50_ms"]
    return results


def print_table(env: dict, results: list[dict]) -> None:
    print(f"\n{env['gpu']} ({env['capability']}), torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}")
    print(
        f"{'shape':<24} {'variant':<14} {'p20 ms':>8} {'p50 ms':>8} {'p80 ms':>8} {'TFLOP/s':>8} {'vs bf16':>8} "
        f"{'weight MB':>9}  checks (rel L2 ≤ limit)"
    )
    for r in results:
        checks = "; ".join(f"{c['rel_l2']:.1e} ≤ {c['limit']:.1e}" for c in r["checks"])
        if "p50_ms" not in r:
            print(f"{r['shape']:<24} {r['variant']:<14} {'FAILED correctness':>44}  {checks}")
            continue
        print(
            f"{r['shape']:<24} {r['variant']:<14} {r['p20_ms']:8.3f} {r['p50_ms']:8.3f} {r['p80_ms']:8.3f} "
            f"{r['TFLOPs']:8.0f} {r.get('speedup_vs_cublas_bf16', float('nan')):7.2f}x "
            f"{r['weight_bytes'] / 1e6:9.1f}  {checks}"
        )
    print("no speed target: nvfp4 buys streamed bytes (0.28x of bf16), the table says what it costs in GEMM time")


if __name__ == "__main__":
    gemm_shapes_main("nvfp4", __doc__, bench_shape, print_table)
