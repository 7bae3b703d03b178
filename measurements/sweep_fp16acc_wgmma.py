"""The Gluon FP16-accumulate GEMM (k6fast/kernels/fp16acc_wgmma.py) at the W1 shapes, beside cuBLAS BF16 and the Triton
fp16acc kernel in the same process, over its tiles.

Per shape: cuBLAS BF16 (F.linear), the Triton kernel (`fp16acc_linear_triton`, autotuned), the bf16 -> fp16
activation conversion alone, each Gluon tile on fp16 activations, and `fp16acc_linear` on bf16 activations as the
runtime calls it on sm_90 (conversion + the default tile). Every variant is checked against the fp32 product of the
fp16 operands on 2,348 rows before it is timed (p50 of CUDA-event timings); odd shapes (ragged M, N, K; bias) too.

Run (GPU, sm_90):  python measurements/sweep_fp16acc_wgmma.py --out wgmma.json [--rep-ms 60]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from bench_common import W1_M, W1_SHAPES, environment, quantiles_ms, rel_l2

from k6fast.kernels.fp16acc_linear import fp16acc_linear, fp16acc_linear_ref, fp16acc_linear_triton
from k6fast.kernels.fp16acc_wgmma import WgmmaTile, fp16acc_wgmma

TILES = [
    WgmmaTile(128, 256, 8, 4, 8),  # the default: two warpgroups side by side along N, one CTA an SM (192 KB)
    WgmmaTile(128, 256, 8, 3, 8),
    WgmmaTile(128, 128, 4, 3, 8),  # one warpgroup, two CTAs an SM (232 registers, 96 KB each)
    WgmmaTile(128, 128, 4, 3, 16),
]
ODD = [(217, 136, 200, True), (1, 4096, 4096, False), (3000, 4104, 120, True), (50220, 64, 72, False)]


def tile_name(t: WgmmaTile) -> str:
    return f"gluon_{t.block_m}x{t.block_n}_w{t.num_warps}_s{t.stages}_g{t.group_m}"


def run_shape(k: int, n: int, g: torch.Generator, rep_ms: int, rows_out: list) -> None:
    x = torch.randn(W1_M, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    w16 = w.half()
    x16 = x.half()
    rows = torch.cat([torch.arange(2048), torch.arange(W1_M - 300, W1_M)]).cuda()
    exact = fp16acc_linear_ref(x[rows], w16, out_dtype=torch.float32)
    limit = 2 * rel_l2(F.linear(x[rows], w), exact) + 1e-3
    flop = 2.0 * W1_M * n * k

    def emit(name, fn, err=None, base=None):
        p50 = quantiles_ms(fn, rep_ms)[1]
        row = {"k": k, "n": n, "variant": name, "p50_ms": p50, "tflops": flop / p50 / 1e9}
        if base is not None:
            row["vs_cublas"] = base / p50
        if err is not None:
            row |= {"rel_l2": err, "limit": limit, "ok": err <= limit}
        rows_out.append(row)
        ratio = f"{base / p50:5.2f}x" if base else "     "
        check = "" if err is None else f"  rel {err:.1e}" + ("" if err <= limit else " FAILED")
        tflops = flop / p50 / 1e9
        print(f"K={k:<6} N={n:<6} {name:<34} {p50:8.3f} ms {tflops:5.0f} TF/s {ratio}{check}", flush=True)
        return p50

    base = emit("cublas_bf16", lambda: F.linear(x, w))
    err = rel_l2(fp16acc_linear_triton(x, w16)[rows], exact)
    emit("triton_fp16acc_c64", lambda: fp16acc_linear_triton(x, w16), err, base)
    emit("convert_x_bf16_to_fp16", lambda: x.half(), None, base)
    for tile in TILES:
        err = rel_l2(fp16acc_wgmma(x16, w16, tile=tile)[rows], exact)
        emit(tile_name(tile), lambda t=tile: fp16acc_wgmma(x16, w16, tile=t), err, base)
    # What the runtime runs on sm_90: fp16acc_linear on bf16 activations (conversion + the default tile).
    err = rel_l2(fp16acc_linear(x, w16)[rows], exact)
    emit("fp16acc_linear_op_sm90", lambda: fp16acc_linear(x, w16), err, base)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rep-ms", type=int, default=60)
    args = ap.parse_args()
    record = {"command": " ".join(sys.argv), "environment": environment(), "rows": [], "odd": []}
    g = torch.Generator(device="cuda").manual_seed(0)

    for m, k, n, with_bias in ODD:  # correctness first: ragged tiles, K not a multiple of 64, bias
        x = torch.randn(m, k, device="cuda", generator=g).half()
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.05).half()
        bias = torch.randn(n, device="cuda", generator=g) if with_bias else None
        exact = fp16acc_linear_ref(x, w, bias, out_dtype=torch.float32)
        for tile in TILES:
            err = rel_l2(fp16acc_wgmma(x, w, bias, tile=tile, out_dtype=torch.float32), exact)
            ok = err < 2e-3
            record["odd"].append({"m": m, "k": k, "n": n, "bias": with_bias, "tile": tile_name(tile), "rel_l2": err})
            print(f"odd M={m} K={k} N={n} bias={with_bias} {tile_name(tile)} rel {err:.1e}{'' if ok else ' FAILED'}")

    for k, n in W1_SHAPES:
        run_shape(k, n, g, args.rep_ms, record["rows"])

    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print("\nbest Gluon tile per shape (fp16 activations):")
    for k, n in W1_SHAPES:
        cand = [r for r in record["rows"] if r["k"] == k and r["n"] == n and r["variant"].startswith("gluon")]
        cand = [r for r in cand if r.get("ok")]
        if cand:
            best = max(cand, key=lambda r: r["vs_cublas"])
            print(f"  K={k:<6} N={n:<6} {best['variant']:<34} {best['vs_cublas']:.3f}x")


if __name__ == "__main__":
    main()
