"""Tile and chunk sweep of the FP16-accumulate GEMM at the W1 shapes, beside cuBLAS BF16 in the same process.

Each (tile, num_warps, num_stages, maxnreg, k_chunk) is launched directly (no autotuner), checked against the fp32
product of the fp16 operands on 2,348 rows, then timed (p50 of CUDA-event timings). What the autotuner's config list
and the default chunk in k6fast/kernels/fp8_linear.py are chosen from. A plain Triton GEMM with FP32 accumulation (same
loads) is timed beside them: what Triton's own code generation reaches on this GPU.

Run (GPU):  python measurements/sweep_fp16acc.py --out fp16acc_sweep.json [--rep-ms 60]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from bench_common import W1_M, W1_SHAPES, environment, quantiles_ms, rel_l2

from k6fast.kernels.fp16acc_linear import _fp16acc_linear_kernel, fp16acc_chunk_steps, fp16acc_linear_ref
from k6fast.kernels.tiles import store_tile, wrapped_tile

# (BLOCK_M, BLOCK_N, num_warps, num_stages, maxnreg, k_chunk). Shared memory per CTA is num_stages x k_chunk x
# (BLOCK_M + BLOCK_N) x 2 bytes (a chunk's loads are one pipeline stage). The maxnreg=128 entries fit two 8-warp CTAs
# per SM (registers 2 x 256 x 128 = 64 K, shared memory <= 113 KB each), so one CTA's chunk flush (wait for its
# MMAs, fp16 -> fp32 add) can overlap the other's MMAs.
TILES = [
    (128, 256, 8, 3, None, 64),
    (256, 128, 8, 3, None, 128),
    (128, 256, 8, 3, None, 128),
    (128, 128, 8, 3, 128, 64),
    (128, 128, 8, 4, 128, 32),
    (128, 128, 8, 3, 128, 32),
    (128, 128, 8, 2, 128, 64),
    (128, 128, 4, 3, 128, 64),
    (64, 256, 4, 3, 128, 64),
]


@triton.jit
def _bf16_gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """A plain Triton GEMM (FP32 accumulation, same loads as the fp16acc kernel): what Triton itself reaches here."""
    offs_m, offs_n, rm, rn = wrapped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, 8)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + rn[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, tl.cdiv(K, BLOCK_K)):
        acc = tl.dot(tl.load(x_ptrs), tl.load(w_ptrs), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    store_tile(y_ptr, acc, y_ptr, offs_m, offs_n, M, N, stride_ym, False)


def launch_bf16(x, w, y):
    m, k = x.shape
    n = w.shape[0]
    grid = (triton.cdiv(m, 128) * triton.cdiv(n, 256),)
    _bf16_gemm_kernel[grid](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                            BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)  # fmt: skip
    return y


def launch(x, w16, y, tile):
    bm, bn, warps, stages, maxnreg, k_chunk = tile
    m, k = x.shape
    n = w16.shape[0]
    block_k, steps = fp16acc_chunk_steps(k_chunk)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}
    _fp16acc_linear_kernel[grid](
        x, w16, y, y, m, n, k, x.stride(0), w16.stride(0), y.stride(0),
        HAS_BIAS=False, EVEN_K=k % k_chunk == 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=block_k, CHUNK_STEPS=steps,
        GROUP_M=8, num_warps=warps, num_stages=stages, **extra,
    )  # fmt: skip
    return y


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rep-ms", type=int, default=60)
    args = ap.parse_args()
    record = {"command": " ".join(sys.argv), "environment": environment(), "rows": []}
    g = torch.Generator(device="cuda").manual_seed(0)
    for k, n in W1_SHAPES:
        x = torch.randn(W1_M, k, device="cuda", generator=g).bfloat16()
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
        w16 = w.half()
        rows = torch.cat([torch.arange(2048), torch.arange(W1_M - 300, W1_M)]).cuda()
        exact = fp16acc_linear_ref(x[rows], w16, out_dtype=torch.float32)
        limit = 2 * rel_l2(F.linear(x[rows], w), exact) + 1e-3
        flop = 2.0 * W1_M * n * k
        base = quantiles_ms(lambda x=x, w=w: F.linear(x, w), args.rep_ms)[1]
        record["rows"].append({"k": k, "n": n, "variant": "cublas_bf16", "p50_ms": base, "tflops": flop / base / 1e9})
        print(f"K={k:<6} N={n:<6} cublas_bf16            {base:8.3f} ms {flop / base / 1e9:6.0f} TFLOP/s", flush=True)
        y = torch.empty(W1_M, n, device="cuda", dtype=torch.bfloat16)
        err = rel_l2(launch_bf16(x, w, y)[rows], x[rows].float() @ w.float().t())
        p50 = quantiles_ms(lambda x=x, w=w, y=y: launch_bf16(x, w, y), args.rep_ms)[1]
        record["rows"].append({"k": k, "n": n, "variant": "triton_bf16_fp32acc", "rel_l2": err, "p50_ms": p50,
                               "tflops": flop / p50 / 1e9, "vs_cublas": base / p50})  # fmt: skip
        print(f"K={k:<6} N={n:<6} {'triton_bf16_fp32acc':<34} {p50:8.3f} ms {base / p50:5.2f}x  rel {err:.1e}")
        for tile in TILES:
            bm, bn, warps, stages, maxnreg, k_chunk = tile
            name = f"fp16acc_c{k_chunk}_{bm}x{bn}_w{warps}_s{stages}" + (f"_r{maxnreg}" if maxnreg else "")
            row = {"k": k, "n": n, "variant": name, "k_chunk": k_chunk, "tile": tile}
            try:
                err = rel_l2(launch(x, w16, y, tile)[rows], exact)
            except Exception as exc:  # out of shared memory / registers: recorded, not fatal
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                record["rows"].append(row)
                print(f"K={k:<6} N={n:<6} {name:<34} {row['error'][:60]}", flush=True)
                continue
            p50 = quantiles_ms(lambda x=x, w16=w16, y=y, t=tile: launch(x, w16, y, t), args.rep_ms)[1]
            row |= {"rel_l2": err, "limit": limit, "ok": err <= limit, "p50_ms": p50,
                    "tflops": flop / p50 / 1e9, "vs_cublas": base / p50}  # fmt: skip
            record["rows"].append(row)
            print(f"K={k:<6} N={n:<6} {name:<34} {p50:8.3f} ms {base / p50:5.2f}x  rel {err:.1e}"
                  f"{'' if err <= limit else ' FAILED'}", flush=True)  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print("\nbest per shape:")
    for k, n in W1_SHAPES:
        rows = [r for r in record["rows"] if r["k"] == k and r["n"] == n and r.get("ok")]
        if rows:
            best = max(rows, key=lambda r: r["vs_cublas"])
            print(f"  K={k:<6} N={n:<6} {best['variant']:<34} {best['vs_cublas']:.3f}x")


if __name__ == "__main__":
    main()
