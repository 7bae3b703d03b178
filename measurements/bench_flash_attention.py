"""k6fast's exact Gluon attention (kernels/flash_attention_wgmma.py) beside cuDNN and flash SDPA, on the DiT's layout.

Correctness first, by the flash-attention rule: at odd shapes (batch 2, 3 heads, both tensor layouts the kernel
takes) and at W1, the kernel's error against FP32 attention must be no worse than twice cuDNN SDPA's (rel. L2 and
max abs, + 1e-6). Timing: p50 of do_bench on [B, N, H, D] tensors as the DiT hands them over (SDPA takes them
transposed, as the block calls it), per launch config.

Run (GPU, sm_90):  python measurements/bench_flash_attention.py --out flash.json [--head-dim 64 --heads 64]
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F
from bench_common import attention_arg_parser
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from k6fast.kernels.flash_attention_wgmma import flash_attention
from k6fast.kernels.quant_attention import attention_fp32

CONFIGS = "128:3,128:2,64:4,64:6"  # block_n:stages, ...
ODD = [(218, 218), (1000, 1), (1, 1000), (300, 129), (1000, 4100), (129, 257), (128, 256), (200, 385)]
RULE_FACTOR = 2.0


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


def main() -> None:
    ap = attention_arg_parser()
    ap.add_argument("--configs", default=CONFIGS)
    args = ap.parse_args()
    configs = [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")]
    seed = int.from_bytes(os.urandom(4), "little")
    record = {"command": " ".join(sys.argv), "seed": seed, "odd": [], "w1": []}
    cudnn = sdpa_bnhd(SDPBackend.CUDNN_ATTENTION)
    ok_all = True
    for m, n in [] if args.skip_odd else ODD:
        q, k, v = inputs(2, 3, m, n, args.head_dim, seed)
        exact = exact_bnhd(q, k, v)
        ref = sdpa_bnhd(SDPBackend.EFFICIENT_ATTENTION)(q, k, v)  # cuDNN refuses some odd shapes
        layouts = {"token_major": (q, k, v)}
        layouts["head_major"] = tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        for layout, (q_, k_, v_) in layouts.items():
            for bn, st in configs:
                out = flash_attention(q_, k_, v_, block_n=bn, stages=st)
                ok, err = rule_check(out, ref, exact)
                ok_all &= ok
                record["odd"].append({"m": m, "n": n, "layout": layout, "config": [bn, st], **err, "ok": ok})
                print(f"odd M={m:<5} N={n:<5} {layout:<11} n{bn}/s{st}: rel {err['rel']:.2e} "
                      f"(sdpa {err['sdpa_rel']:.2e}) max {err['max']:.2e} (sdpa {err['sdpa_max']:.2e}) "
                      f"{'ok' if ok else 'FAILED'}", flush=True)  # fmt: skip

    q, k, v = inputs(1, args.heads, 50220, 50220, args.head_dim, seed)
    exact = exact_bnhd(q, k, v)
    flops = 4.0 * args.heads * 50220 * 50220 * args.head_dim
    cudnn_out = cudnn(q, k, v)
    flash = sdpa_bnhd(SDPBackend.FLASH_ATTENTION)
    rows = [("sdpa_cudnn", lambda: cudnn(q, k, v)), ("sdpa_flash", lambda: flash(q, k, v))]
    for bn, st in configs:
        rows.append((f"k6_n{bn}_s{st}", lambda c=(bn, st): flash_attention(q, k, v, block_n=c[0], stages=c[1])))
    base = None
    for name, fn in rows:
        ok, err = rule_check(fn(), cudnn_out, exact)
        ok_all &= ok
        p50 = do_bench(fn, warmup=200, rep=args.rep_ms, quantiles=[0.5])
        p50 = p50[0] if isinstance(p50, list) else p50
        base = p50 if name == "sdpa_cudnn" else base
        record["w1"].append({"name": name, "p50_ms": p50, "tflops": flops / p50 / 1e9, "vs_cudnn": base / p50, **err,
                             "ok": ok})  # fmt: skip
        print(f"W1 {name:<22} {p50:8.2f} ms {flops / p50 / 1e9:6.0f} TF/s {base / p50:5.3f}x rel {err['rel']:.2e} "
              f"max {err['max']:.2e} {'ok' if ok else 'FAILED'}", flush=True)  # fmt: skip
    record["ok"] = ok_all
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
