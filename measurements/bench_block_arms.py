"""One Pro fused block at W1 under each speed arm, beside diffusers' block with the same weights, in one process.

Weights are random with the real Pro block's names and shapes (no checkpoint needed: one block is 0.9 GiB), the
inputs are W1's (50,220 video + 218 audio tokens, 64 text tokens). Correctness first: every variant's output is
compared with the exact reference (relative L2 and cosine for video and audio); then all are timed in `--repeats`
mirrored rounds (A B C, C B A, ...: clock drift over the run falls on every variant alike), median per variant, after
a warm-up (compiled variants: the first call compiles).

Run (GPU):  python measurements/bench_block_arms.py --out block_arms.json [--variants reference,fused,...] [--profile]

`--chain N` also times N calls issued back to back (synchronised only around them), the cost of a block inside a
forward, where the host runs ahead and the per-call launch latency of a synchronised single call is hidden.
`--profile` also runs one call of each variant (and of diffusers' block) under torch.profiler and records its device
time per kernel category and its top kernels (grouped as `profile_step.py` groups a DiT step's).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_common import rel_l2
from profile_step import breakdown, device_activities, trace_events

from k6fast.dit.backend import SwitchedBackend
from k6fast.dit.blocks import FusedBlockInputs, fused_block
from k6fast.dit.config import DiTConfig, fused_block_shapes
from k6fast.dit.model import flops_per_block
from k6fast.dit.rope import rope_1d, rope_3d
from k6fast.switches import Options
from k6fast.testing.synthetic import transformer_config

VARIANTS = {
    "reference": {},
    "fused": {"fused_elementwise": True},
    "fused+compile": {"fused_elementwise": True, "compile": True},
    "fused+compile+fa4exact": {"fused_elementwise": True, "compile": True, "exact_attn_kernel": "fa4"},
    "k6attn+fused": {"attn": "k6", "fused_elementwise": True},
    "k6attn+fused+compile": {"attn": "k6", "fused_elementwise": True, "compile": True},
    "fp8+fused": {"gemm": "fp8", "fused_elementwise": True},
    "fp8+k6attn+fused": {"gemm": "fp8", "attn": "k6", "fused_elementwise": True},
    "fp8+k6attn+fused+compile": {"gemm": "fp8", "attn": "k6", "fused_elementwise": True, "compile": True},
}


DIFFUSERS = "diffusers block"


def call_seconds(fn, calls: int) -> float:
    """Seconds per call of `calls` calls issued back to back, synchronised only around them (1: one call)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


def kernel_profile(fn, wall_s: float) -> dict:
    """One call of fn under torch.profiler: device time per category, busy vs wall, the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = trace_events(json.loads(path.read_text()))
        kernels = device_activities(events)
    span_s = (max(a.end_us for a in kernels) - min(a.start_us for a in kernels)) / 1e6 if kernels else 0.0
    record = breakdown(kernels, span_s)
    record.pop("kernels")
    ordered = sorted(kernels, key=lambda a: a.start_us)
    gaps = [(b.start_us - a.end_us, a.name, b.name) for a, b in zip(ordered, ordered[1:], strict=False)]
    # Host-side CUDA API time by call (cudaMalloc/cudaFree/synchronisations show up here), and where the first
    # kernel starts relative to the first host event: what the device waits on between calls.
    api: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            entry = api.setdefault(e["name"], [0.0, 0])
            entry[0] += float(e["dur"]) / 1e3
            entry[1] += 1
    record["cuda_api_ms"] = {
        k: {"ms": v[0], "count": v[1]} for k, v in sorted(api.items(), key=lambda kv: -kv[1][0])[:8]
    }
    host = [float(e["ts"]) for e in events if e.get("cat") in ("cpu_op", "python_function", "user_annotation")]
    if host and kernels:
        record["first_kernel_after_first_host_op_ms"] = (min(a.start_us for a in kernels) - min(host)) / 1e3
        record["host_span_ms"] = (max(float(e["ts"]) + float(e["dur"]) for e in events if e.get("cat") == "cpu_op")
                                  - min(host)) / 1e3  # fmt: skip
    record["largest_gaps"] = [{"ms": g / 1e3, "after": a[:80], "before": b[:80]} for g, a, b in sorted(gaps)[-5:][::-1]]
    record["unprofiled_wall_s"] = wall_s
    cats = {c: round(v["s"] * 1e3, 2) for c, v in record["categories"].items() if v["s"]}
    print(f"    busy {record['busy_s'] * 1e3:.1f} ms of {span_s * 1e3:.1f} ms kernel span; by category (ms): {cats}")
    for k in record["top_kernels"][:10]:
        print(f"      {k['s'] * 1e3:8.2f} ms x{k['count']:<3} {k['category']:<18} {k['name'][:90]}")
    print(f"    first kernel {record.get('first_kernel_after_first_host_op_ms', float('nan')):.2f} ms after the first "
          f"host op; host ops span {record.get('host_span_ms', float('nan')):.1f} ms; CUDA API (ms): "
          + ", ".join(f"{k} {v['ms']:.2f} x{v['count']}" for k, v in record["cuda_api_ms"].items()))  # fmt: skip
    for g in record["largest_gaps"]:
        print(f"      gap {g['ms']:6.2f} ms after {g['after'][:50]} before {g['before'][:50]}")
    return record


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=6, help="mirrored rounds (even: each order runs equally often)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--no-diffusers", action="store_true")
    ap.add_argument("--chain", type=int, default=0, help="also time this many back-to-back calls per repeat")
    ap.add_argument("--profile", action="store_true", help="one profiled call per variant: kernels by category")
    args = ap.parse_args()
    if args.repeats < 2 or args.repeats % 2:
        ap.error(f"--repeats: expected an even number >= 2 (forward and reverse rounds alike), found {args.repeats}")
    device = torch.device("cuda", torch.cuda.current_device())
    cfg = DiTConfig.from_dict(transformer_config("pro-distill", 1))
    g = torch.Generator(device).manual_seed(0)
    weights = {}
    for name, shape in fused_block_shapes(cfg).items():
        if name.endswith(".bias"):
            t = torch.zeros(shape, device=device)
        elif "norm" in name:
            t = torch.ones(shape, device=device)
        else:
            t = torch.randn(shape, generator=g, device=device) / math.sqrt(3 * shape[-1])
        weights[name] = t.float() if "modulation" in name else t.to(torch.bfloat16)
    t_lat, hh, ww, n_aud, n_txt = 31, 30, 54, 218, 64
    n_vid = t_lat * hh * ww
    bf = torch.bfloat16
    vis = torch.randn(1, n_vid, cfg.model_dim, generator=g, device=device).to(bf)
    aud = torch.randn(1, n_aud, cfg.model_dim_a, generator=g, device=device).to(bf)
    text_v = torch.randn(1, n_txt, cfg.model_dim, generator=g, device=device).to(bf)
    text_a = torch.randn(1, n_txt, cfg.model_dim_a, generator=g, device=device).to(bf)
    temb_v = torch.randn(1, cfg.time_dim, generator=g, device=device)
    temb_a = torch.randn(1, cfg.time_dim_a, generator=g, device=device)
    pos = (torch.arange(t_lat, device=device), torch.arange(hh, device=device), torch.arange(ww, device=device))
    rope_v = rope_3d(pos, cfg.axes_dims, cfg.scale_factor)
    rope_a = rope_1d(torch.arange(n_aud, device=device), cfg.head_dim_a, cfg.audio_freqs_scaling)
    inp = FusedBlockInputs(text_v, text_a, temb_v, temb_a, rope_v, rope_a, None)
    flops = flops_per_block(cfg, n_vid, n_aud, n_txt)
    results: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "flops_per_block": flops,
                     "tokens": [n_vid, n_aud, n_txt], "variants": {}}  # fmt: skip
    try:
        import triton

        results["triton"] = triton.__version__
    except ImportError:
        results["triton"] = None

    runners: dict = {}  # name -> the zero-argument call timed
    outputs: dict = {}
    if not args.no_diffusers:
        from diffusers.models.transformers.transformer_kandinsky6 import Kandinsky6FusedTransformerDecoderBlock

        block = Kandinsky6FusedTransformerDecoderBlock(
            cfg.model_dim, cfg.time_dim, cfg.ff_dim, cfg.head_dim, cfg.model_dim_a, cfg.time_dim_a, cfg.ff_dim_a,
            cfg.head_dim_a, cfg.ca_rope, cfg.cross_gates, cfg.fix_modulation,
        ).to(device=device, dtype=bf)  # fmt: skip
        block.load_state_dict({k: v.to(bf) for k, v in weights.items()})
        pos_rope = torch.stack([rope_v[0], -rope_v[1], rope_v[1], rope_v[0]], -1).view(n_vid, 1, -1, 2, 2)
        aud_rope = torch.stack([rope_a[0], -rope_a[1], rope_a[1], rope_a[0]], -1).view(n_aud, 1, -1, 2, 2)

        def run_diffusers():
            with torch.no_grad():
                return block(vis, aud, text_v, text_a, (temb_v.to(bf), temb_a.to(bf)), pos_rope, aud_rope, None)

        runners[DIFFUSERS] = run_diffusers
        outputs[DIFFUSERS] = run_diffusers()
        results["diffusers_block"] = {}
    backends = {}
    for name in args.variants.split(","):
        changes = VARIANTS[name]
        options = Options().replace(**changes)
        backend = SwitchedBackend(options, device)
        backend.begin_block(1, 3)  # a middle block: quantized attention applies
        fn = torch.compile(fused_block, dynamic=False) if options.compile else fused_block

        def run(fn=fn, backend=backend):
            with torch.no_grad():
                return fn(backend, cfg, weights, vis, aud, inp)

        start = time.perf_counter()
        outputs[name] = run()
        torch.cuda.synchronize()
        runners[name], backends[name] = run, backend
        results["variants"][name] = {"switches": changes, "first_call_s": time.perf_counter() - start}
    reference = outputs[args.variants.split(",")[0]]
    for name, row in results["variants"].items():
        out, backend = outputs.pop(name), backends[name]
        row |= {
            "rel_l2_video": rel_l2(out[0], reference[0]), "rel_l2_audio": rel_l2(out[1], reference[1]),
            "cos_video": cosine(out[0], reference[0]),
            "attn_counts": {f"{k}:{s}": c for (k, s), c in backend.attn.counts.items()},
            "gemm_counts": dict(backend.gemm.counts),
        }  # fmt: skip
    if DIFFUSERS in outputs:
        results["diffusers_block"]["rel_l2_video_vs_k6_reference"] = rel_l2(outputs.pop(DIFFUSERS)[0], reference[0])
    del outputs

    # Timing: mirrored rounds (A B C, then C B A, ...) so that a drift of the GPU's clocks over the run (long
    # attention kernels heat it) falls on every variant alike instead of on whichever runs last.
    names = list(runners)
    for fn in runners.values():  # warm-up after every compile, so each first timed call is a steady one
        fn()
    times: dict = {name: [] for name in names}
    chained: dict = {name: [] for name in names}
    for r in range(args.repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(call_seconds(runners[name], 1))
            if args.chain:
                chained[name].append(call_seconds(runners[name], args.chain))
    for name in names:
        row = results["diffusers_block"] if name == DIFFUSERS else results["variants"][name]
        med = statistics.median(times[name])
        row |= {"times_s": times[name], "median_s": med}
        line = f"{name:<28}{med * 1e3:>9.1f} ms"
        if name != DIFFUSERS:
            row["tflops"] = flops / med / 1e12
            line += f" {row['tflops']:>7.1f} TFLOP/s  relL2 v {row['rel_l2_video']:.2e} a {row['rel_l2_audio']:.2e}"
        if args.chain:
            row |= {"chained_s": chained[name], "chained_median_s": statistics.median(chained[name])}
            line += f"; {row['chained_median_s'] * 1e3:.1f} ms per call back to back"
        print(line, flush=True)
        if args.profile:
            row["profile"] = kernel_profile(runners[name], med)

    if DIFFUSERS in runners:
        d = results["diffusers_block"]
        for name, v in results["variants"].items():
            v["speedup_vs_diffusers"] = d["median_s"] / v["median_s"]
            line = f"  {name:<26} {v['speedup_vs_diffusers']:.3f}x vs diffusers (one synchronised call)"
            if args.chain:
                v["chained_speedup_vs_diffusers"] = d["chained_median_s"] / v["chained_median_s"]
                line += f", {v['chained_speedup_vs_diffusers']:.3f}x back to back"
            print(line)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
