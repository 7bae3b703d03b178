"""One Pro fused block at W1 under each speed arm, beside diffusers' block with the same weights, in one process.

Weights are random with the real Pro block's names and shapes (no checkpoint needed: one block is 0.9 GiB), the
inputs are W1's (50,220 video + 218 audio tokens, 64 text tokens). Correctness first: every variant's output is
compared with the exact reference (relative L2 and cosine for video and audio); then each is timed, median of
`--repeats` after a warm-up (compiled variants: the warm-up compiles).

Run (GPU):  python measurements/bench_block_arms.py --out block_arms.json [--variants reference,fused,...]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
from bench_common import rel_l2, wall_seconds

from k6fast.dit.backend import SwitchedBackend
from k6fast.dit.blocks import FusedBlockInputs, fused_block
from k6fast.dit.config import DiTConfig, fused_block_shapes
from k6fast.dit.model import flops_per_block
from k6fast.dit.rope import rope_1d, rope_3d
from k6fast.switches import Options
from k6fast.synthetic import transformer_config

VARIANTS = {
    "reference": {},
    "fused": {"fused_elementwise": True},
    "fused+compile": {"fused_elementwise": True, "compile": True},
    "k6attn+fused": {"attn": "k6", "fused_elementwise": True},
    "fp8+fused": {"gemm": "fp8", "fused_elementwise": True},
    "fp8+k6attn+fused": {"gemm": "fp8", "attn": "k6", "fused_elementwise": True},
    "fp8+k6attn+fused+compile": {"gemm": "fp8", "attn": "k6", "fused_elementwise": True, "compile": True},
}


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--no-diffusers", action="store_true")
    args = ap.parse_args()
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

        out = run_diffusers()
        times = wall_seconds(run_diffusers, args.repeats)
        med = statistics.median(times)
        results["diffusers_block"] = {"times_s": times, "median_s": med, "output": out}
        print(f"{'diffusers block':<28}{med * 1e3:>9.1f} ms", flush=True)
        del block
        torch.cuda.empty_cache()
    reference = None
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
        out = run()
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        if reference is None:
            reference = out
        times = wall_seconds(run, args.repeats)
        med = statistics.median(times)
        results["variants"][name] = {
            "switches": changes, "times_s": times, "median_s": med, "first_call_s": first,
            "tflops": flops / med / 1e12, "rel_l2_video": rel_l2(out[0], reference[0]),
            "rel_l2_audio": rel_l2(out[1], reference[1]), "cos_video": cosine(out[0], reference[0]),
            "attn_counts": {f"{k}:{s}": c for (k, s), c in backend.attn.counts.items()},
            "gemm_counts": dict(backend.gemm.counts),
        }  # fmt: skip
        row = results["variants"][name]
        print(f"{name:<28}{med * 1e3:>9.1f} ms {flops / med / 1e12:>7.1f} TFLOP/s  "
              f"relL2 v {row['rel_l2_video']:.2e} a {row['rel_l2_audio']:.2e}", flush=True)  # fmt: skip

    if "diffusers_block" in results:
        d = results["diffusers_block"]
        d["rel_l2_video_vs_k6_reference"] = rel_l2(d.pop("output")[0], reference[0])
        for name, v in results["variants"].items():
            v["speedup_vs_diffusers"] = d["median_s"] / v["median_s"]
            print(f"  {name:<26} {v['speedup_vs_diffusers']:.3f}x vs diffusers")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
