"""Video VAE decode: diffusers' AutoencoderKLHunyuanVideo tiled decode (`enable_tiling()`, what k6fast.vae used)
vs k6fast.video_decode, at W1 (latents 31 x 60 x 108 → 121 frames of 864x480) and at 512x320x25 (7 x 40 x 64).

Correctness first, at 512x320x25 where diffusers' untiled decode fits (tiling and framewise decoding off, in fp32 as
the reference): each bf16 decode's max error against it in pixel units (0-255); k6fast's exact decodes (plain, and
lean: upsamplers fused with the next resnet, shortcut stored or recomputed) pass when err <= 2 * err(diffusers
untiled bf16) + 0.5 px. At W1 (no untiled diffusers decode: its attention mask alone is 80 GB) each decode is
compared with diffusers' tiled one and with k6fast's first exact decode.
Then timing: one warm-up, median of --repeats, CUDA events; peak VRAM above what was allocated before the decode.
The exact W1 runs (last variant) are planned at each --exact-budget-gb: at 32 GiB the plan is the lean whole-clip
decode (the plain one needs 41 GiB), at 48 GiB the plain one; the plan's mode is in each row. On a large GPU,
cudnn_benchmark may pick algorithms with workspaces a 32 GiB card would not offer: --cap-gb 32 emulates that card.
Random weights unless --vae names a checkpoint (a VAE folder, or a model folder holding vae/).

Run:  python measurements/bench_vae_decode.py --out vae_decode_h200.json [--budget-gb 8] [--vae DIR]
      [--exact-budget-gb 32,48] [--upsample-fusion auto,recomputed] [--cap-gb 32]
      (--smoke: a narrow VAE at tiny sizes on the CPU, to check this script end to end; its numbers mean nothing)
Targets: k6fast at --budget-gb >= 2x diffusers' tiled decode at W1, its peak within the budget; the exact decode at
32 GiB within 32 GiB (peak VRAM <= ~30 GiB).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from k6fast.memory import GiB
from k6fast.vae import decode_video
from k6fast.video_decode import decode_video_fast, plan_video_decode

GEOMETRIES = {"small": (7, 40, 64), "W1": (31, 60, 108)}
SMOKE_GEOMETRIES = {"small": (3, 6, 8), "W1": (5, 12, 16)}
FUSIONS = ("auto", "off", "stored", "recomputed")  # decode_video_fast's upsample_fusion
# name → decode() options: activation layout, cuDNN algorithm timing, the Triton GroupNorm+SiLU kernel.
VARIANTS = {
    "ncdhw": {"layout": "ncdhw", "cudnn_benchmark": False, "triton_norm": False},
    "ncdhw+bench": {"layout": "ncdhw", "cudnn_benchmark": True, "triton_norm": False},
    "ndhwc+bench": {"layout": "ndhwc", "cudnn_benchmark": True, "triton_norm": False},
    "ncdhw+bench+triton": {"layout": "ncdhw", "cudnn_benchmark": True, "triton_norm": True},
    "ndhwc+bench+triton": {"layout": "ndhwc", "cudnn_benchmark": True, "triton_norm": True},
}


def decode(vae, latents: torch.Tensor, *, cudnn_benchmark: bool = False, **options) -> torch.Tensor:
    """decode_video_fast with cuDNN's algorithm timing on or off for this decode: the library decodes under what the
    process has set (k6fast's entry points turn timing on), and this script, its own single-threaded process, sets it
    per variant and restores it, so diffusers' decodes always run under PyTorch's default."""
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = cudnn_benchmark
    try:
        return decode_video_fast(vae, latents, **options)
    finally:
        torch.backends.cudnn.benchmark = before


def environment(device: torch.device) -> dict:
    import diffusers
    import triton

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = {"gpu": props.name, "capability": f"sm_{props.major}{props.minor}"}
        gpu["memory_gib"] = round(props.total_memory / GiB, 1)
    else:
        gpu = {"gpu": "cpu (smoke run)"}
    return gpu | {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "diffusers": diffusers.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def load_vae(path: str | None, device: torch.device, smoke: bool):
    from diffusers import AutoencoderKLHunyuanVideo

    if path is None:
        torch.manual_seed(0)
        config = {"block_out_channels": (32, 64, 64, 64), "norm_num_groups": 8} if smoke else {}
        with torch.device(device):
            vae = AutoencoderKLHunyuanVideo(**config)
        return vae.to(torch.bfloat16).eval()
    root = Path(path)
    sub = "vae" if (root / "vae").is_dir() else None
    return AutoencoderKLHunyuanVideo.from_pretrained(root, subfolder=sub, torch_dtype=torch.bfloat16).to(device).eval()


@contextlib.contextmanager
def diffusers_mode(vae, *, tiling: bool, framewise: bool):
    saved = (vae.use_tiling, vae.use_framewise_decoding)
    vae.use_tiling, vae.use_framewise_decoding = tiling, framewise
    try:
        yield
    finally:
        vae.use_tiling, vae.use_framewise_decoding = saved


def diffusers_tiled(vae, latents: torch.Tensor) -> torch.Tensor:
    vae.enable_tiling()  # diffusers' defaults: 256 px tiles at 192 px stride, 16-frame tiles at 12-frame stride
    with diffusers_mode(vae, tiling=True, framewise=True):
        return decode_video(vae, latents)


def diffusers_untiled(vae, latents: torch.Tensor) -> torch.Tensor:
    with diffusers_mode(vae, tiling=False, framewise=False):
        return decode_video(vae, latents)


def px(a: torch.Tensor, b: torch.Tensor) -> dict:
    d = (a.float() - b.float()).abs() * 255
    return {"max_px": round(d.max().item(), 3), "mean_px": round(d.mean().item(), 4)}


def measure(fn: Callable[[], torch.Tensor], repeats: int, device: torch.device) -> tuple[dict, torch.Tensor]:
    """One warm-up, then `repeats` timed runs (CUDA events); peak bytes allocated above what was allocated before
    each run (the decode's activations, temporaries and output)."""
    out = fn()
    del out
    times, peaks, base = [], [], 0
    for i in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
            peaks.append(torch.cuda.max_memory_allocated() - base)
        else:
            begin = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - begin)
            peaks.append(0)
        if i + 1 < repeats:
            del out
    stats = {
        "median_s": round(statistics.median(times), 3),
        "times_s": [round(t, 3) for t in times],
        "peak_gib": round(max(peaks) / GiB, 2),
        "resident_gib": round(base / GiB, 2),
    }
    return stats, out


def profile(fn: Callable[[], torch.Tensor], rows: int = 15) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vae", help="a saved AutoencoderKLHunyuanVideo (or a model folder with vae/); default random")
    parser.add_argument("--budget-gb", type=float, default=8.0, help="GiB the decode may allocate (W1 target run)")
    parser.add_argument(
        "--exact-budget-gb",
        default="32,48",
        help="comma-separated GiB budgets for exact W1 decodes of the last variant (32: lean, 48: plain); 0 skips",
    )
    parser.add_argument(
        "--upsample-fusion",
        help=f"comma-separated of {', '.join(FUSIONS)} for the exact W1 decodes (default auto; --smoke: auto, "
        "stored, recomputed so that every path runs)",
    )
    parser.add_argument(
        "--variants", default="ncdhw,ndhwc+bench,ndhwc+bench+triton", help=f"comma-separated of {', '.join(VARIANTS)}"
    )
    parser.add_argument(
        "--cap-gb",
        type=float,
        default=0.0,
        help="cap this process's CUDA allocations at this many GiB, as on a card that size (cuDNN then only picks "
        "algorithms whose workspace fits); 0: no cap",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-w1", action="store_true", help="stop after the 512x320x25 correctness and timing")
    parser.add_argument("--no-profile", action="store_true", help="skip the kernel profile of one k6fast decode")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--smoke", action="store_true", help="CPU, narrow random VAE, tiny sizes: checks the script")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: expected names from {', '.join(VARIANTS)}, found {', '.join(unknown)}")
    exact_budgets = [float(gb) for gb in args.exact_budget_gb.split(",") if gb and float(gb) > 0]
    fusions = (args.upsample_fusion or ("auto,stored,recomputed" if args.smoke else "auto")).split(",")
    if any(f not in FUSIONS for f in fusions):
        parser.error(f"--upsample-fusion: expected names from {', '.join(FUSIONS)}, found {args.upsample_fusion}")
    if not args.smoke and not torch.cuda.is_available():
        parser.error("needs a CUDA device (or --smoke)")
    device = torch.device("cpu") if args.smoke else torch.device("cuda", torch.cuda.current_device())
    geometries = SMOKE_GEOMETRIES if args.smoke else GEOMETRIES

    env = environment(device)
    if args.cap_gb > 0 and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gb * GiB / total), device)
        env["allocation_cap_gib"] = args.cap_gb
    vae = load_vae(args.vae, device, args.smoke)
    budget = int(args.budget_gb * GiB)
    result: dict = {"env": env, "vae": args.vae or "random default config", "budget_gb": args.budget_gb, "small": {}}
    print(f"{env['gpu']}  torch {env['torch']}  diffusers {env['diffusers']}  cudnn {env['cudnn']}")
    ok = True
    g = torch.Generator(device=device).manual_seed(0)

    # --- correctness at 512x320x25 -------------------------------------------------------------------------------
    t, h, w = geometries["small"]
    latents = torch.randn(1, t, h, w, 16, generator=g, device=device)
    vae.float()
    reference = diffusers_untiled(vae, latents)  # fp32 untiled: the decode every other is judged against
    vae.to(torch.bfloat16)
    small = result["small"]
    small["diffusers_untiled_bf16"] = px(diffusers_untiled(vae, latents), reference)
    small["diffusers_tiled_bf16"] = px(diffusers_tiled(vae, latents), reference)
    plan = plan_video_decode(vae, (t, h, w), budget_bytes=budget)
    bar = 2 * small["diffusers_untiled_bf16"]["max_px"] + 0.5
    failed: set[str] = set()
    for name in variants:
        try:
            frames = decode(vae, latents, budget_bytes=budget, **VARIANTS[name])
        except Exception as exc:  # a variant that cannot run (a kernel that fails to build) is reported, not fatal
            small[f"k6fast[{name}]"] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            failed.add(name)
            continue
        passed = plan.exact and px(frames, reference)["max_px"] <= bar
        small[f"k6fast[{name}]"] = px(frames, reference) | {"exact": plan.exact, "pass": passed}
        ok &= passed
    last = variants[-1]
    for fusion in ("stored", "recomputed") if last not in failed else ():
        lean = plan_video_decode(vae, (t, h, w), budget_bytes=budget, upsample_fusion=fusion)
        frames = decode(vae, latents, budget_bytes=budget, upsample_fusion=fusion, **VARIANTS[last])
        passed = lean.mode == "whole-clip lean" and px(frames, reference)["max_px"] <= bar
        small[f"k6fast[{last} lean {fusion}]"] = px(frames, reference) | {"exact": lean.exact, "pass": passed}
        ok &= passed
    streamed = decode(vae, latents, budget_bytes=budget, chunk_latent_frames=1)
    small["k6fast slabs of 1 (running statistics)"] = px(streamed, reference)
    del reference, streamed
    print("\n512x320x25, max | mean error vs diffusers' untiled fp32 decode (px):")
    for name, row in small.items():
        if "error" in row:
            print(f"  {name:44s} {row['error']}")
            continue
        print(f"  {name:44s} {row['max_px']:9.3f} | {row['mean_px']:8.4f}  {row.get('pass', '')}")
    if not ok:
        print("FAIL: k6fast's exact decode is not within 2x diffusers' bf16 error + 0.5 px; timings follow anyway")

    # --- timing at 512x320x25: diffusers' tiled decode vs the exact decode `generate` runs by default -------------
    timing: dict[str, dict] = {}
    timing["diffusers tiled"], _ = measure(lambda: diffusers_tiled(vae, latents), args.repeats, device)
    if last not in failed:
        exact_budget = int(max(exact_budgets, default=32.0) * GiB)

        def exact_small() -> torch.Tensor:
            return decode(vae, latents, budget_bytes=exact_budget, **VARIANTS[last])

        stats, _ = measure(exact_small, args.repeats, device)
        stats["speedup"] = round(timing["diffusers tiled"]["median_s"] / stats["median_s"], 2)
        timing[f"k6fast[{last} exact]"] = stats
    result["small_timing"] = timing
    print(f"\n512x320x25, median of {args.repeats}:")
    for name, row in timing.items():
        print(f"  {name:48s} {row['median_s']:8.3f} s  x{row.get('speedup', 1.0):.2f}  peak {row['peak_gib']:.2f} GiB")
    if args.no_w1:
        write_result(args.out, result)
        return 0 if ok else 1

    # --- W1 ------------------------------------------------------------------------------------------------------
    t, h, w = geometries["W1"]
    latents = torch.randn(1, t, h, w, 16, generator=g, device=device)
    rows: dict[str, dict] = {}
    rows["diffusers tiled"], tiled = measure(lambda: diffusers_tiled(vae, latents), args.repeats, device)
    # (label, budget GiB, decode() options)
    runs = [(name, args.budget_gb, VARIANTS[name]) for name in variants if name not in failed]
    for gb in exact_budgets if last not in failed else ():
        for fusion in fusions:
            label = f"{last} exact@{gb:g}" + ("" if fusion == "auto" else f" {fusion}")
            runs.append((label, gb, VARIANTS[last] | {"upsample_fusion": fusion}))
    outputs: dict[str, torch.Tensor] = {}
    for label, run_gb, options in runs:
        run_budget = int(run_gb * GiB)
        fusion = options.get("upsample_fusion", "auto")
        plan = plan_video_decode(vae, (t, h, w), budget_bytes=run_budget, upsample_fusion=fusion)

        def run(run_budget=run_budget, options=options) -> torch.Tensor:
            return decode(vae, latents, budget_bytes=run_budget, **options)

        if device.type == "cuda":
            # As the pipeline before its decode (Pipeline.free_budget): segments the previous variant reserved are
            # released, so under --cap-gb each variant starts from what it would find in a request.
            torch.cuda.empty_cache()

        try:
            stats, frames = measure(run, args.repeats, device)
        except Exception as exc:  # out of memory, or a kernel that fails: reported in the table
            rows[f"k6fast[{label}]"] = {"error": f"{type(exc).__name__}: {exc}"[:400], "plan": plan.describe()}
            continue  # the next variant empties the cache before it starts
        stats |= {"budget_gib": run_gb, "within_budget": stats["peak_gib"] <= run_gb, "plan": plan.describe()}
        stats |= {"mode": plan.mode, "exact": plan.exact, "planned_peak_gib": round(plan.estimated_peak_bytes / GiB, 2)}
        stats["speedup"] = round(rows["diffusers tiled"]["median_s"] / stats["median_s"], 2)
        stats["vs_diffusers_tiled"] = px(frames, tiled)
        outputs[label] = frames
        rows[f"k6fast[{label}]"] = stats
    exact_key = next((k for k in outputs if " exact@" in k), None)
    for label, frames in outputs.items():
        if exact_key is not None and label != exact_key:
            rows[f"k6fast[{label}]"]["vs_k6fast_exact"] = px(frames, outputs[exact_key])
    result["W1"] = rows
    print(f"\nW1 (121 x 864x480), median of {args.repeats}; peak above the resident weights and latents:")
    head = f"{'decode':48s} {'time s':>8s} {'speedup':>8s} {'peak GiB':>9s} {'budget':>7s}  vs tiled max|mean px"
    print(f"  {head}  vs k6fast[{exact_key}]")
    for name, row in rows.items():
        if "error" in row:
            print(f"  {name:48s} {row['error']}")
            continue
        vs = row.get("vs_diffusers_tiled", {"max_px": 0.0, "mean_px": 0.0})
        vs_exact = row.get("vs_k6fast_exact")
        print(
            f"  {name:48s} {row['median_s']:8.3f} {row.get('speedup', 1.0):8.2f} {row['peak_gib']:9.2f} "
            f"{row.get('budget_gib', float('nan')):7.1f}  {vs['max_px']:.1f} | {vs['mean_px']:.2f}"
            + (f"  {vs_exact['max_px']:.2f} | {vs_exact['mean_px']:.3f}" if vs_exact else "")
        )
        if "plan" in row:
            print(f"  {'':48s} {row['plan']}")
    target = rows.get(f"k6fast[{last}]", {"error": "not run"})
    best = max((r.get("speedup", 0.0) for k, r in rows.items() if "exact" not in k and "error" not in r), default=0.0)
    result["target_met"] = best >= 2.0 and all(r.get("within_budget", True) for r in rows.values())
    print(f"\ntarget (>= 2x at {args.budget_gb} GiB, within budget): {'met' if result['target_met'] else 'NOT met'}")
    for name, row in rows.items():
        if " exact@" in name and "error" not in row:
            verdict = "within" if row["within_budget"] else "OVER"
            print(f"{name}: {row['mode']}, peak {row['peak_gib']:.2f} GiB, {verdict} its {row['budget_gib']:g} GiB")

    if not args.no_profile and device.type == "cuda" and "error" not in target:
        table = profile(lambda: decode(vae, latents, budget_bytes=budget, **VARIANTS[last]))
        result["profile"] = {"variant": last, "table": table}
        print(f"\nCUDA kernels of one k6fast[{last}] decode at W1:\n{table}")
    write_result(args.out, result)
    return 0 if ok else 1


def write_result(out: Path | None, result: dict) -> None:
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
