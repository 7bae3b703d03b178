"""The Gluon attention core (k6fast/kernels/quant_attention_wgmma.py) beside cuDNN SDPA and the Triton k6 kernel.

Correctness first: at odd shapes the Gluon core against `attention_quantized_ref` (the same quantized inputs, FP32
maths; cosine >= 0.9999, rel. L2 <= 1 %) and against exact FP32 attention (`odd_ok` in the JSON). At W1 every row's
cosine and rel. L2 against exact FP32 attention are recorded beside its p50 (do_bench): cuDNN SDPA, `quant_attention`,
the Triton op and core, the prologue, and the Gluon core per launch config, alone and with the prologue.

Run (GPU, sm_90):  python measurements/bench_attention_wgmma.py --out attn_wgmma.json [--head-dim 64 --heads 64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from bench_attention import FP8_PV_BOUND, MIN_COSINE, cosine_and_rel_l2, dit_like_inputs, sdpa
from bench_common import attention_arg_parser
from torch.nn.attention import SDPBackend
from triton.testing import do_bench

from k6fast.kernels import quant_attention as qa
from k6fast.kernels import quant_attention_core as qc
from k6fast.kernels.quant_attention_wgmma import attention_quantized_wgmma

CONFIGS = [(128, 2, False), (128, 3, False), (128, 4, False), (128, 2, True)]  # (key tile, ring stages, ping-pong)
ODD = [(218, 218), (1000, 1), (1, 1000), (300, 129), (1000, 4100), (129, 257), (128, 256), (200, 385)]


def main() -> None:
    ap = attention_arg_parser()
    args = ap.parse_args()
    seed = int.from_bytes(os.urandom(4), "little")
    record = {"command": " ".join(sys.argv), "seed": seed, "odd": [], "w1": []}
    shape = argparse.Namespace(batch=1, heads=2, head_dim=args.head_dim, dtype="bf16", v_offset=0.0)
    ok_all = True
    for m, n in [] if args.skip_odd else ODD:
        shape.q_len, shape.kv_len = m, n
        q, k, v = dit_like_inputs(shape, seed)
        exact = qa.attention_fp32(q, k, v)
        for bn, st, pp in CONFIGS:
            qkv = qa.quantize_qkv(q, k, v, pv_fp8=True, k_block=bn)
            ref = qa.attention_quantized_ref(qkv)
            out = attention_quantized_wgmma(qkv, stages=st, pingpong=pp)
            cos_r, rel_r = cosine_and_rel_l2(out, ref.float())
            cos_e, rel_e = cosine_and_rel_l2(out, exact)
            ok = cos_r >= 0.9999 and rel_r <= 0.01 and cos_e >= MIN_COSINE and rel_e <= FP8_PV_BOUND
            ok_all &= ok
            record["odd"].append({"m": m, "n": n, "config": [bn, st, pp], "vs_ref": [cos_r, rel_r],
                                  "vs_exact": [cos_e, rel_e], "ok": ok})  # fmt: skip
            print(f"odd M={m:<5} N={n:<5} n{bn}/s{st}/pp{int(pp)}: vs ref cos {cos_r:.6f} "
                  f"rel {rel_r:.2e}; "
                  f"vs exact cos {cos_e:.6f} rel {rel_e:.2%} {'ok' if ok else 'FAILED'}", flush=True)  # fmt: skip

    shape.heads, shape.q_len, shape.kv_len = args.heads, 50220, 50220
    q, k, v = dit_like_inputs(shape, seed)
    exact = qa.attention_fp32(q, k, v)
    flops = 4.0 * args.heads * 50220 * 50220 * args.head_dim
    qkv = {128: qa.quantize_qkv(q, k, v, pv_fp8=True, k_block=128)}
    keyed = {128: qa.quantize_qkv(q, k, v, pv_fp8=True, k_block=128, v_key_perm=True)}  # the Gluon core's Vᵀ order
    rows = [
        ("sdpa_cudnn", lambda: sdpa(SDPBackend.CUDNN_ATTENTION)(q, k, v)),
        ("k6_op (quant_attention: the Gluon core on sm_90)", lambda: qa.quant_attention(q, k, v)),
        (
            "k6_triton_op (the Triton core's sm_90 config)",
            lambda: qa.attention_quantized(
                qa.quantize_qkv(q, k, v, pv_fp8=True, k_block=qc.config_for(q.device, args.head_dim, True).block_n)
            ),
        ),
        ("k6_triton_core_n128", lambda: qa.attention_quantized(qkv[128])),
        ("prologue_n128", lambda: qa.quantize_qkv(q, k, v, pv_fp8=True, k_block=128)),
        ("v_key_permutation (torch copy)", lambda: qa.v_key_order(qkv[128].vt)),
        ("prologue_n128_v_key_perm", lambda: qa.quantize_qkv(q, k, v, pv_fp8=True, k_block=128, v_key_perm=True)),
    ]
    for bn, st, pp in CONFIGS:
        tag = f"n{bn}_s{st}_pp{int(pp)}"
        rows.append((f"gluon_core_{tag}", lambda c=(bn, st, pp): attention_quantized_wgmma(
            keyed[c[0]], stages=c[1], pingpong=c[2])))  # fmt: skip
        if not pp:
            rows.append((f"gluon_op_{tag}", lambda c=(bn, st, pp): attention_quantized_wgmma(
                qa.quantize_qkv(q, k, v, pv_fp8=True, k_block=c[0], v_key_perm=True), stages=c[1],
                pingpong=c[2])))  # fmt: skip
    base = None
    for name, fn in rows:
        out = fn()
        check = not name.startswith(("prologue", "v_key"))
        cos, rel = cosine_and_rel_l2(out, exact) if check else (None, None)
        p50 = do_bench(fn, warmup=200, rep=args.rep_ms, quantiles=[0.5])
        p50 = p50[0] if isinstance(p50, list) else p50
        base = p50 if name == "sdpa_cudnn" else base
        row = {"name": name, "p50_ms": p50, "tflops": flops / p50 / 1e9, "vs_cudnn": base / p50, "cos": cos, "rel": rel}
        record["w1"].append(row)
        acc = "" if cos is None else f" cos {cos:.6f} rel {rel:.2%}"
        print(f"W1 {name[:44]:<44} {p50:8.2f} ms {flops / p50 / 1e9:6.0f} TF/s {base / p50:5.2f}x{acc}", flush=True)
    record["odd_ok"] = ok_all
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
