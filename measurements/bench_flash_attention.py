"""Exact attention on the DiT's layout: cuDNN and flash SDPA and flash-attn-4 (k6fast/kernels/fa4_attention.py, where
installed), at the Pro and Lite head dims.

Correctness first, by the flash-attention rule: at odd shapes (batch 2, 3 heads) and at every W1 shape, a kernel's
error against FP32 attention must be no worse than twice SDPA's (rel. L2 and max abs, + 1e-6; the memory-efficient
backend at the odd shapes, some of which cuDNN refuses, cuDNN at W1). Timing: p50 of do_bench on [B, N, H, D] tensors
as the DiT hands them over (SDPA takes them transposed, as the block calls it). The last thing printed is one table
per W1 shape: ms, TFLOP/s, speed-up over cuDNN, rel. L2 against FP32.

Run (GPU; the flash-attn-4 rows need the package and sm_90/sm_100/sm_120):
    python measurements/bench_flash_attention.py --out flash.json                   # Pro 32x128 and Lite 28x64
    python measurements/bench_flash_attention.py --shapes 64x64 --out flash_d64.json  # the earlier records' shape
A few minutes on an H200 (flash-attn-4 compiles each shape on first use).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F
from bench_common import attention_arg_parser, environment
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from k6fast.kernels.fa4_attention import fa4_attention, fa4_unavailable_reason, fa4_version
from k6fast.kernels.quant_attention import attention_fp32

SHAPES = "32x128,28x64"  # heads x head_dim: Pro (model_dim 4096), Lite (model_dim 1792)
ODD = [(218, 218), (1000, 1), (1, 1000), (300, 129), (1000, 4100), (129, 257), (128, 256), (200, 385)]
RULE_FACTOR = 2.0
W1_TOKENS = 50220


def sdpa_bnhd(backend):
    def run(q, k, v):
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            return out.transpose(1, 2)

    return run


def inputs(b, h, m, n, d, seed, dtype=torch.bfloat16):
    """DiT-like q, k, v in [B, N, H, D]: K with per-channel offsets (as after RoPE'd projections)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, m, h, d, generator=g, device="cuda")
    k = torch.randn(b, n, h, d, generator=g, device="cuda") + 3.0 * torch.randn(h, d, generator=g, device="cuda")
    v = torch.randn(b, n, h, d, generator=g, device="cuda")
    return q.to(dtype), k.to(dtype), v.to(dtype)


def errors(out, exact):
    diff = out.float() - exact
    return (diff.norm() / exact.norm()).item(), diff.abs().max().item()


def rule_check(out, ref, exact) -> tuple[bool, dict]:
    rel, mx = errors(out, exact)
    rel_ref, mx_ref = errors(ref, exact)
    ok = rel <= RULE_FACTOR * rel_ref + 1e-6 and mx <= RULE_FACTOR * mx_ref + 1e-6
    return ok, {"rel": rel, "max": mx, "sdpa_rel": rel_ref, "sdpa_max": mx_ref}


def exact_bnhd(q, k, v):
    return attention_fp32(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def odd_shapes(head_dim, seed, record) -> bool:
    """flash-attn-4 against FP32 attention at odd shapes, by the rule (memory-efficient SDPA's error the yardstick)."""
    ok_all = True
    for m, n in ODD:
        q, k, v = inputs(2, 3, m, n, head_dim, seed)
        exact = exact_bnhd(q, k, v)
        ref = sdpa_bnhd(SDPBackend.EFFICIENT_ATTENTION)(q, k, v)  # cuDNN refuses some odd shapes
        ok, err = rule_check(fa4_attention(q, k, v), ref, exact)
        ok_all &= ok
        record["odd"].append({"d": head_dim, "m": m, "n": n, "kernel": "flash_attn_4", **err, "ok": ok})
        print(f"odd D={head_dim} M={m:<5} N={n:<5} flash_attn_4 rel {err['rel']:.2e} (sdpa {err['sdpa_rel']:.2e}) "
              f"max {err['max']:.2e} (sdpa {err['sdpa_max']:.2e}) {'ok' if ok else 'FAILED'}", flush=True)  # fmt: skip
    return ok_all


def w1(heads, head_dim, use_fa4, seed, rep_ms) -> list[dict]:
    q, k, v = inputs(1, heads, W1_TOKENS, W1_TOKENS, head_dim, seed)
    exact = exact_bnhd(q, k, v)
    flops = 4.0 * heads * W1_TOKENS * W1_TOKENS * head_dim
    cudnn = sdpa_bnhd(SDPBackend.CUDNN_ATTENTION)
    cudnn_out = cudnn(q, k, v)
    flash = sdpa_bnhd(SDPBackend.FLASH_ATTENTION)
    rows = [("sdpa_cudnn", lambda: cudnn(q, k, v)), ("sdpa_flash", lambda: flash(q, k, v))]
    if use_fa4:
        rows.append(("flash_attn_4", lambda: fa4_attention(q, k, v)))
    out, base = [], None
    for name, fn in rows:
        ok, err = rule_check(fn(), cudnn_out, exact)
        p50 = None
        if ok:  # a kernel that fails its check is not timed
            p50 = do_bench(fn, warmup=200, rep=rep_ms, quantiles=[0.5])
            p50 = p50[0] if isinstance(p50, list) else p50
            base = p50 if name == "sdpa_cudnn" else base
        row = {"shape": f"1x{heads}x{W1_TOKENS}x{head_dim}", "name": name, "p50_ms": p50, **err, "ok": ok}
        if p50 is not None:
            row.update(tflops=flops / p50 / 1e9, vs_cudnn=base / p50 if base else None)
        out.append(row)
        print(f"W1 {row['shape']} {name:<16} {p50 or float('nan'):8.2f} ms rel {err['rel']:.2e} "
              f"{'ok' if ok else 'FAILED (not timed)'}", flush=True)  # fmt: skip
    return out


def main() -> None:
    ap = attention_arg_parser()
    ap.add_argument("--shapes", default=SHAPES, help="heads x head_dim at W1's 50,220 tokens, comma-separated")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes.split(",")]
    why_not = fa4_unavailable_reason(torch.device("cuda"))
    use_fa4 = why_not is None
    seed = int.from_bytes(os.urandom(4), "little")
    record = {"command": " ".join(sys.argv), "env": environment(), "fa4": fa4_version(), "fa4_unavailable": why_not,
              "seed": seed, "odd": [], "w1": []}  # fmt: skip
    ok_all = True
    if use_fa4 and not args.skip_odd:
        for head_dim in sorted({d for _, d in shapes}):
            ok_all &= odd_shapes(head_dim, seed, record)
    for heads, head_dim in shapes:
        record["w1"] += w1(heads, head_dim, use_fa4, seed, args.rep_ms)
        torch.cuda.empty_cache()  # the shape's tensors died with w1's frame
    ok_all &= all(r["ok"] for r in record["w1"])
    record["ok"] = ok_all
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    env = record["env"]
    print(f"\n{env['gpu']} ({env['capability']}), torch {env['torch']}, triton {env['triton']}, flash-attn-4 "
          f"{record['fa4'] or 'not installed'}{'' if use_fa4 else f' ({why_not})'}")  # fmt: skip
    print(f"{'shape':<20} {'kernel':<16} {'ms':>8} {'TFLOP/s':>8} {'vs cuDNN':>9} {'rel L2 vs fp32':>15}  check")
    for r in record["w1"]:
        ms = f"{r['p50_ms']:8.2f}" if r["p50_ms"] is not None else f"{'-':>8}"
        tf = f"{r['tflops']:8.0f}" if r.get("tflops") else f"{'-':>8}"
        vs = f"{r['vs_cudnn']:8.3f}x" if r.get("vs_cudnn") else f"{'-':>9}"
        print(f"{r['shape']:<20} {r['name']:<16} {ms} {tf} {vs} {r['rel']:15.3e}  {'ok' if r['ok'] else 'FAILED'}")
    print(f"odd shapes: {sum(r['ok'] for r in record['odd'])}/{len(record['odd'])} within the rule")
    if not ok_all:
        raise SystemExit("some kernels failed the flash-attention rule")


if __name__ == "__main__":
    main()
