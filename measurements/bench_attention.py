"""Attention micro-benchmark: cuDNN and flash SDPA, k6fast's quant_attention, sageattention (when installed).

What it holds: one table (and one JSON record) per run of every attention variant on the same DiT-like inputs
(q ~ N(0, 1); k ~ N(0, 1) + per-channel offsets ~ N(0, 3); v ~ N(0, 1) [+ offsets with --v-offset]), at the W1 video
self-attention shape by default (1×32×50220×128, bf16):
- correctness first: every variant against exact FP32 attention (``attention_fp32``): cosine and relative L2, with
  a pass/fail against the bounds below; a failing variant is still timed but marked;
- then time: p20/p50/p80 in ms from ``triton.testing.do_bench`` (CUDA events, L2 flushed between runs) and TFLOP/s at
  the median, 4·B·H·M·N·D / t, and the speed-up over cuDNN SDPA.
k6fast rows: the whole op (quantization prologue + attention kernel), the kernel alone on pre-quantized inputs, and
the prologue alone; with ``--sweep`` also the kernel alone for each ``CANDIDATE_CONFIGS`` entry (to fill
``_CONFIGS`` in k6fast/kernels/quant_attention_core.py).

Run on the GPU machine from the repository root:
    python measurements/bench_attention.py --out measurements/results/attention_h200.json
    python measurements/bench_attention.py --sweep --out measurements/results/attention_sweep_h200.json
    python measurements/bench_attention.py --q-len 50220 --kv-len 218 --out ...   # video queries over audio keys
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import math
import os
import platform
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from k6fast.kernels import quant_attention as qa
from k6fast.kernels import quant_attention_core as qc
from k6fast.kernels import quant_attention_prologue as qp

# Bounds on relative L2 vs exact FP32 (see tests/test_quant_attention.py for the error budget behind them).
EXACT_BOUND = 0.01  # bf16 SDPA: about 0.25%
FP16_PV_BOUND = 0.02  # INT8 Q·Kᵀ: about 1.3%
FP8_PV_BOUND = 0.045  # plus FP8 P and V: about 3.6% on zero-mean V
MIN_COSINE = 0.999
QUANTILES = [0.2, 0.5, 0.8]


@dataclass
class Row:
    name: str
    p20_ms: float | None = None
    p50_ms: float | None = None
    p80_ms: float | None = None
    tflops: float | None = None
    speedup_vs_cudnn: float | None = None
    cosine: float | None = None
    rel_l2: float | None = None
    bound: float | None = None
    ok: bool | None = None
    note: str = ""


def dit_like_inputs(args: argparse.Namespace, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q: [B, H, M, D], k, v: [B, H, N, D] in args.dtype on CUDA."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    b, h, m, n, d = args.batch, args.heads, args.q_len, args.kv_len, args.head_dim
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    q = torch.randn(b, h, m, d, generator=g, device="cuda")
    k = torch.randn(b, h, n, d, generator=g, device="cuda") + 3.0 * torch.randn(d, generator=g, device="cuda")
    v = torch.randn(b, h, n, d, generator=g, device="cuda") + args.v_offset * torch.randn(d, generator=g, device="cuda")
    return q.to(dtype), k.to(dtype), v.to(dtype)


def cosine_and_rel_l2(out: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    o, e = out.float().flatten(), exact.flatten()
    return F.cosine_similarity(o, e, dim=0).item(), ((o - e).norm() / e.norm()).item()


def check(row: Row, out: torch.Tensor, exact: torch.Tensor, bound: float | None) -> None:
    row.cosine, row.rel_l2 = cosine_and_rel_l2(out, exact)
    row.bound = bound
    if bound is not None:
        row.ok = row.cosine >= MIN_COSINE and row.rel_l2 <= bound
    print(
        f"  check {row.name:<34} cosine {row.cosine:.6f}  rel L2 {row.rel_l2:.4%}  {'' if row.ok is None else row.ok}"
    )


def time_it(row: Row, fn: Callable[[], object], flops: float, args: argparse.Namespace) -> None:
    p20, p50, p80 = do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, quantiles=QUANTILES)
    row.p20_ms, row.p50_ms, row.p80_ms = p20, p50, p80
    row.tflops = flops / (p50 * 1e-3) / 1e12
    print(f"  time  {row.name:<34} p50 {p50:8.2f} ms  {row.tflops:7.1f} TFLOP/s")


def sdpa(backend: SDPBackend) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v)

    return run


def sweep(args, variant, q, k, v, pv_fp8: bool, tag: str, bound: float) -> None:
    """The kernel alone under every CANDIDATE_CONFIGS entry, for each key-tile size (= K scale block, so the inputs
    are quantized again for each)."""
    rep_ms = args.rep_ms
    args.rep_ms = args.sweep_rep_ms or rep_ms
    try:
        for k_block in (int(x) for x in args.sweep_k_blocks.split(",")):
            qkv = qa.quantize_qkv(q, k, v, pv_fp8=pv_fp8, k_block=k_block)
            for cfg in (dataclasses.replace(c, block_n=k_block) for c in qa.CANDIDATE_CONFIGS):
                extra = (" poly" if cfg.exp2_poly else "") + (f" r{cfg.maxnreg}" if cfg.maxnreg else "")
                extra += " pipe" if cfg.pipeline else ""
                name = f"  {tag} kb{k_block} m{cfg.block_m} w{cfg.num_warps} s{cfg.num_stages} u{cfg.unroll}{extra}"
                if args.sweep_match and not re.search(args.sweep_match, name):
                    continue
                variant(name, lambda cfg=cfg, qkv=qkv: qa.attention_quantized(qkv, config=cfg), bound)
            del qkv
    finally:
        args.rep_ms = rep_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--q-len", type=int, default=50220)
    parser.add_argument("--kv-len", type=int, default=None, help="default: --q-len")
    parser.add_argument("--head-dim", type=int, default=128, choices=qa.SUPPORTED_HEAD_DIMS)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--v-offset", type=float, default=0.0, help="std of per-channel offsets added to V")
    parser.add_argument("--seed", type=int, default=None, help="default: fresh")
    parser.add_argument("--sweep", action="store_true", help="also time the kernel for every CANDIDATE_CONFIGS entry")
    parser.add_argument(
        "--sweep-match", default=None, help="regex: sweep only entries whose name matches (e.g. 'pipe|m64 w4 s3 u1$')"
    )
    parser.add_argument(
        "--sweep-k-blocks",
        default="64,128",
        help="key-tile sizes (= K scale blocks) the sweep tries",
    )
    parser.add_argument("--sweep-pv", default=None, help="P·V paths the sweep runs: fp8pv,fp16pv (default: the GPU's)")
    parser.add_argument("--sweep-rep-ms", type=int, default=None, help="ms timed per sweep entry (default --rep-ms)")
    parser.add_argument("--warmup-ms", type=int, default=200)
    parser.add_argument("--rep-ms", type=int, default=1500)
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args()
    args.kv_len = args.kv_len or args.q_len
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention.py: needs a CUDA GPU")
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    dev = torch.device("cuda")
    b, h, m, n, d = args.batch, args.heads, args.q_len, args.kv_len, args.head_dim
    flops = 4.0 * b * h * m * n * d
    pv_fp8_default = qp.resolve_pv_fp8(None, dev)
    print(f"{torch.cuda.get_device_name(dev)}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"shape B={b} H={h} M={m} N={n} D={d} {args.dtype}, v_offset {args.v_offset}, seed {seed}")

    q, k, v = dit_like_inputs(args, seed)
    exact = qa.attention_fp32(q, k, v)
    rows: list[Row] = []

    def variant(name: str, fn: Callable[[], torch.Tensor], bound: float | None) -> None:
        row = Row(name)
        rows.append(row)
        try:
            check(row, fn(), exact, bound)
        except RuntimeError as err:  # e.g. a backend that does not support this GPU or shape
            row.note = f"failed: {str(err).splitlines()[0][:200]}"
            print(f"  {name}: {row.note}")
            return
        time_it(row, fn, flops, args)

    variant("sdpa_cudnn", lambda: sdpa(SDPBackend.CUDNN_ATTENTION)(q, k, v), EXACT_BOUND)
    variant("sdpa_flash", lambda: sdpa(SDPBackend.FLASH_ATTENTION)(q, k, v), EXACT_BOUND)
    for pv_fp8 in sorted({pv_fp8_default, False}, reverse=True):
        tag = "fp8pv" if pv_fp8 else "fp16pv"
        bound = FP8_PV_BOUND if pv_fp8 else FP16_PV_BOUND
        variant(f"k6_quant_{tag}", lambda pv_fp8=pv_fp8: qa.quant_attention(q, k, v, pv_fp8=pv_fp8), bound)
        qkv_block = qc.config_for(dev, d, pv_fp8).block_n
        qkv = qa.quantize_qkv(q, k, v, pv_fp8=pv_fp8, k_block=qkv_block)
        variant(f"k6_quant_{tag}_kernel_only", lambda qkv=qkv: qa.attention_quantized(qkv), bound)
        row = Row(f"k6_quant_{tag}_prologue_only", note="quantize_qkv alone; TFLOP/s not meaningful")
        rows.append(row)
        prologue = lambda pv_fp8=pv_fp8, kb=qkv_block: qa.quantize_qkv(q, k, v, pv_fp8=pv_fp8, k_block=kb)
        time_it(row, prologue, flops, args)
        row.tflops = None
        del qkv
        if args.sweep and tag in (args.sweep_pv or ("fp8pv" if pv_fp8_default else "fp16pv")).split(","):
            sweep(args, variant, q, k, v, pv_fp8, tag, bound)
    if importlib.util.find_spec("sageattention") is None:
        print("  sageattention not installed: skipped")
    else:
        from sageattention import sageattn

        variant("sageattention", lambda: sageattn(q, k, v, tensor_layout="HND", is_causal=False), None)

    cudnn = next((r for r in rows if r.name == "sdpa_cudnn" and r.p50_ms), None)
    for r in rows:
        if cudnn and r.p50_ms and r.tflops is not None:
            r.speedup_vs_cudnn = cudnn.p50_ms / r.p50_ms

    record = {
        "benchmark": "attention",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(dev),
        "capability": list(torch.cuda.get_device_capability(dev)),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "shape": {"batch": b, "heads": h, "q_len": m, "kv_len": n, "head_dim": d, "layout": "BHND"},
        "dtype": args.dtype,
        "inputs": {"k_offset_std": 3.0, "v_offset_std": args.v_offset, "seed": seed},
        "flops_per_call": flops,
        "quant_attention_default_config": {
            tag: asdict(qc.config_for(dev, d, fp8)) for tag, fp8 in (("fp8pv", True), ("fp16pv", False))
        },
        "results": [asdict(r) for r in rows],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")

    print(
        f"\n{record['gpu']}  B={b} H={h} M={m} N={n} D={d} {args.dtype}  (ok: rel L2 vs FP32 within bound, "
        f"cosine >= {MIN_COSINE})"
    )
    print(f"{'variant':<36}{'p20':>9}{'p50':>9}{'p80':>9}{'TFLOP/s':>9}{'vs cuDNN':>9}{'cosine':>10}{'rel L2':>8}  ok")

    def cell(x: float | None, width: int, spec: str) -> str:
        return f"{'-' if x is None or math.isnan(x) else format(x, spec):>{width}}"

    for r in rows:
        ok = "-" if r.ok is None else ("yes" if r.ok else "NO")
        rel = "-" if r.rel_l2 is None else f"{r.rel_l2:.2%}"
        print(
            f"{r.name:<36}{cell(r.p20_ms, 9, '.2f')}{cell(r.p50_ms, 9, '.2f')}{cell(r.p80_ms, 9, '.2f')}"
            f"{cell(r.tflops, 9, '.1f')}{cell(r.speedup_vs_cudnn, 9, '.2f')}{cell(r.cosine, 10, '.6f')}{rel:>8}"
            f"  {ok} {r.note}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
