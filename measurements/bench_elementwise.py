"""Elementwise micro-benchmark at the K6 W1 shape (M = 50220 video tokens, D = 4096): the fused AdaLN kernels vs the
PyTorch sequences they replace, and vs a memory-bandwidth bound (minimal bytes moved / measured copy GB/s).

Ops and variants, each checked for correctness before it is timed:
  layernorm_modulate      torch: diffusers' apply_scale_shift(F.layer_norm(x.float()), ...) = layernorm_modulate_ref
                          compile: torch.compile of that sequence (every op; --no-compile skips them)
                          triton: layernorm_modulate
  layernorm_modulate_fp8  torch: the same, then row-wise e4m3 quantization (layernorm_modulate_ref(out_fp8=True))
                          triton_unfused: layernorm_modulate, then quantize_rows_fp8
                          triton: layernorm_modulate(out_fp8=True), quantization fused into the norm
  gated_residual          torch: diffusers' apply_gate_sum = gated_residual_ref; compile; triton: gated_residual;
                          triton_inplace: gated_residual_ (writes into x)
Minimal bytes per element: 2 + 2 (norm), 2 + 1 (norm → e4m3, plus 4 per row), 2 + 2 + 2 (gated residual).
Target: triton ≥ 2× the torch sequence.

Run:  python measurements/bench_elementwise.py --out measurements/results/elementwise_h200.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_common import environment, quantiles_ms, rel_l2

from k6fast.kernels.adaln import (
    gated_residual,
    gated_residual_,
    gated_residual_ref,
    layernorm_modulate,
    layernorm_modulate_ref,
)
from k6fast.kernels.fp8_linear import quantize_rows_fp8


def copy_bandwidth(numel: int, rep_ms: int) -> float:
    """GB/s of a device-to-device copy of `numel` bf16 elements (bytes read + bytes written)."""
    src = torch.empty(numel, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    _, p50, _ = quantiles_ms(lambda: dst.copy_(src), rep_ms)
    return 2 * numel * 2 / (p50 * 1e-3) / 1e9


def max_err(a: torch.Tensor, exact: torch.Tensor) -> float:
    return (a.float() - exact).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", type=int, default=50220, help="rows (tokens); default the W1 50220")
    parser.add_argument("--d", type=int, default=4096, help="model dim; default the Pro 4096")
    parser.add_argument("--rep-ms", type=int, default=300, help="do_bench measuring time per variant")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines")
    parser.add_argument("--out", type=Path, help="write results as JSON here (parent folders are created)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_elementwise.py needs a CUDA GPU")
    m, d = args.m, args.d
    env = environment()

    # x: [1, M, D] bf16 residual stream (non-zero mean, a few outlier channels); modulation: one fp32 [1, 9·D] output
    # chunked into strided [1, D] views, as K6's visual_modulation layer produces them.
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, m, d, device="cuda", generator=g) * 2.0 + 0.5
    x[..., : d // 64] *= 20.0
    x = x.bfloat16()
    out = torch.randn(1, m, d, device="cuda", generator=g).bfloat16()
    modulation = torch.randn(1, 9 * d, device="cuda", generator=g) * 0.5
    shift, scale, gate = modulation.chunk(9, dim=-1)[:3]
    x_inplace = x.clone()

    copy_gbps = copy_bandwidth(m * d, args.rep_ms)
    elems = m * d
    min_bytes = {
        "layernorm_modulate": elems * 4,
        "layernorm_modulate_fp8": elems * 3 + m * 4,
        "gated_residual": elems * 6,
    }

    # fp32 results before the final rounding, for the flash-attention rule: err(kernel) ≤ 2·err(torch) + atol.
    exact_norm = F.layer_norm(x.float(), (d,), eps=1e-5) * (scale.float() + 1.0) + shift.float()
    exact_gate = x.float() + gate.float() * out.float()
    ref_norm = layernorm_modulate_ref(x, scale, shift)
    ref_gate = gated_residual_ref(x, out, gate)
    q_ref, s_ref = layernorm_modulate_ref(x, scale, shift, out_fp8=True)
    deq_ref = q_ref.float() * s_ref

    def norm_check(y):
        err = max_err(y, exact_norm)
        return err, 2 * max_err(ref_norm, exact_norm) + 1e-5

    def gate_check(y):
        err = max_err(y, exact_gate)
        return err, 2 * max_err(ref_gate, exact_gate) + 1e-5

    def fp8_check(result, limit=1e-2):
        q, s = result
        scale_ok = torch.allclose(s, s_ref, rtol=2.0**-7, atol=0)
        return (rel_l2(q.float() * s, deq_ref) if scale_ok else float("inf")), limit

    def fp8_check_compiled(result):
        # Inductor skips the bf16 round trip before quantizing (emulate_precision_casts is off by default), which
        # moves more elements across an e4m3 rounding boundary than the kernel's fp32 LayerNorm differences do.
        return fp8_check(result, limit=3e-2)

    # torch.compile baselines: lazily compiled on their first (correctness) call; dynamic=False like a fixed geometry.
    norm_compiled = torch.compile(layernorm_modulate_ref, dynamic=False)
    norm_fp8_compiled = torch.compile(lambda x, s, h: layernorm_modulate_ref(x, s, h, out_fp8=True), dynamic=False)
    gate_compiled = torch.compile(gated_residual_ref, dynamic=False)

    ops = {
        "layernorm_modulate": {
            "torch": (lambda: layernorm_modulate_ref(x, scale, shift), norm_check),
            "compile": (lambda: norm_compiled(x, scale, shift), norm_check),
            "triton": (lambda: layernorm_modulate(x, scale, shift), norm_check),
        },
        "layernorm_modulate_fp8": {
            "torch": (lambda: layernorm_modulate_ref(x, scale, shift, out_fp8=True), fp8_check),
            "compile": (lambda: norm_fp8_compiled(x, scale, shift), fp8_check_compiled),
            "triton_unfused": (lambda: quantize_rows_fp8(layernorm_modulate(x, scale, shift)), fp8_check),
            "triton": (lambda: layernorm_modulate(x, scale, shift, out_fp8=True), fp8_check),
        },
        "gated_residual": {
            "torch": (lambda: gated_residual_ref(x, out, gate), gate_check),
            "compile": (lambda: gate_compiled(x, out, gate), gate_check),
            "triton": (lambda: gated_residual(x, out, gate), gate_check),
            "triton_inplace": (lambda: gated_residual_(x_inplace, out, gate), None),
        },
    }

    results = []
    for op, variants in ops.items():
        for name, (fn, check) in variants.items():
            if name == "compile" and args.no_compile:
                continue
            row = {"op": op, "variant": name}
            if check is not None:
                err, limit = check(fn())
                row |= {"error": err, "limit": limit, "ok": err <= limit}
            else:
                # In place: one call on a fresh copy must equal the out-of-place kernel's result.
                x_inplace.copy_(x)
                fn()
                row |= {"ok": torch.equal(x_inplace, gated_residual(x, out, gate))}
            if not row["ok"]:
                results.append(row)
                print(f"FAILED correctness: {row}")
                continue
            p20, p50, p80 = quantiles_ms(fn, args.rep_ms)
            bound_ms = min_bytes[op] / (copy_gbps * 1e9) * 1e3
            row |= {
                "p20_ms": p20,
                "p50_ms": p50,
                "p80_ms": p80,
                "effective_GBps": min_bytes[op] / (p50 * 1e-3) / 1e9,
                "bound_ms": bound_ms,
                "fraction_of_bound": bound_ms / p50,
            }
            results.append(row)
            print(f"  {op:<24} {name:<16} p50 {p50:8.3f} ms", flush=True)
    for r in results:
        base = next(b for b in results if b["op"] == r["op"] and b["variant"] == "torch")
        if "p50_ms" in r and "p50_ms" in base:
            r["speedup_vs_torch"] = base["p50_ms"] / r["p50_ms"]

    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            payload = {"bench": "elementwise", "env": env, "m": m, "d": d, "copy_GBps": copy_gbps, "results": results}
            json.dump(payload, f, indent=1)

    print(f"\n{env['gpu']} ({env['capability']}), torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}")
    print(f"M={m} D={d}; device copy {copy_gbps:.0f} GB/s (read + write) sets the bandwidth bound")
    header = f"{'op':<24} {'variant':<16} {'p20 ms':>8} {'p50 ms':>8} {'p80 ms':>8} {'GB/s':>6} {'bound':>6}"
    print(header + f" {'vs torch':>8}  check")
    for r in results:
        if "p50_ms" not in r:
            print(f"{r['op']:<24} {r['variant']:<16} FAILED correctness {r}")
            continue
        check = f"err {r['error']:.1e} ≤ {r['limit']:.1e}" if "error" in r else "equals out-of-place"
        print(
            f"{r['op']:<24} {r['variant']:<16} {r['p20_ms']:8.3f} {r['p50_ms']:8.3f} {r['p80_ms']:8.3f} "
            f"{r['effective_GBps']:6.0f} {r['fraction_of_bound']:5.0%} {r['speedup_vs_torch']:7.2f}x  {check}"
        )
    print("target: triton ≥ 2.00x torch; 'bound' = bandwidth-bound time / measured time")
    if not all(r["ok"] for r in results):
        raise SystemExit("some variants failed their correctness check and were not timed")


if __name__ == "__main__":
    main()
