"""Streaming runtime benchmark: one DiT forward (= one distilled denoising step) all-resident vs streamed under a
VRAM budget, on the same checkpoint and inputs, in one process, visits mirrored (resident, streamed, streamed,
resident). Checks first that the streamed output is bit-identical to the resident one.

The streamed run keeps resident the same *fraction* of fused blocks that the planner would keep for the full-depth
model under the budget, so a reduced-depth synthetic checkpoint measures the real overlap.

Run (GPU):  python measurements/bench_streaming.py --model /tmp/syn --budget-gb 32 --out result.json
            [--geometry 864x480x121] [--forwards 3] [--text-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import threading
import time

import torch

from k6fast.allocator import device_budget
from k6fast.checkpoint import open_checkpoint
from k6fast.dit.config import DiTConfig, expected_shapes
from k6fast.entry import cap_device_memory
from k6fast.request import FPS
from k6fast.stream.plan import GiB, activation_estimate, plan_residency, weight_footprint
from k6fast.stream.runtime import build_dit
from k6fast.telemetry import anon_rss_bytes
from k6fast.vae_geometry import MMAUDIO, audio_length, latent_frames, latent_size


class AnonSampler:
    """Peak anonymous RSS of this process, sampled every 20 ms in a background thread."""

    def __init__(self):
        self.peak = anon_rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, anon_rss_bytes())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def full_depth_resident_fraction(cfg: DiTConfig, full_blocks: int, budget: int, tokens: tuple[int, int]) -> float:
    """The share of fused blocks the planner keeps resident for the full-depth model under this budget."""
    full = DiTConfig.from_dict({**cfg.__dict__, "num_visual_blocks": full_blocks})
    entries = ((n, math.prod(shape), 2, True) for n, shape in expected_shapes(full).items())  # bf16 stored
    fixed, block = weight_footprint(entries, full_blocks, 2)
    act = activation_estimate(*tokens, cfg.model_dim, cfg.model_dim_a)
    plan = plan_residency(budget_bytes=budget, fixed_bytes=fixed, block_bytes=block, num_blocks=full_blocks,
                          activation_bytes=act)  # fmt: skip
    return plan.resident_blocks / full_blocks


def inputs(cfg: DiTConfig, width: int, height: int, frames: int, text_tokens: int, device) -> dict:
    g = torch.Generator(device).manual_seed(0)
    t = latent_frames(frames)
    dt = torch.bfloat16
    return dict(
        hidden_states=torch.randn(1, t, *latent_size(height, width), cfg.visual_in_channels, generator=g, device=device,
                                  dtype=dt),
        encoder_hidden_states=torch.randn(1, text_tokens, cfg.in_text_dim, generator=g, device=device, dtype=dt),
        pooled_projections=torch.randn(1, cfg.in_text_dim2, generator=g, device=device, dtype=dt),
        timestep=torch.tensor([900.0], device=device),
        audio_hidden_states=torch.randn(1, audio_length(t, FPS, MMAUDIO), cfg.in_audio_dim, generator=g,
                                        device=device, dtype=dt),
    )  # fmt: skip


def time_forwards(runtime, kwargs: dict, n: int) -> tuple[list[float], list[dict], tuple]:
    times, stream = [], []
    for _ in range(n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = runtime.dit(**kwargs)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if runtime.streamer is not None:
            timings = runtime.streamer.collect_timings()
            copy = sum(t.copy_s for t in timings)
            exposed = sum(t.exposed_s for t in timings)
            stream.append({"copy_s": copy, "exposed_s": exposed, "compute_s": sum(t.compute_s for t in timings),
                           "blocks": len(timings)})  # fmt: skip
    return times, stream, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--budget-gb", type=float, default=32.0)
    ap.add_argument("--geometry", default="864x480x121")
    ap.add_argument("--forwards", type=int, default=3)
    ap.add_argument("--text-tokens", type=int, default=64)
    ap.add_argument("--full-blocks", type=int, default=60)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    width, height, frames = (int(v) for v in args.geometry.split("x"))
    device = torch.device("cuda", torch.cuda.current_device())
    ckpt = open_checkpoint(args.model)
    cfg = ckpt.dit
    t = latent_frames(frames)
    tokens = (t * (height // 16) * (width // 16), audio_length(t, FPS, MMAUDIO))
    budget = int(args.budget_gb * GiB)
    fraction = full_depth_resident_fraction(cfg, args.full_blocks, budget, tokens)
    max_resident = round(fraction * cfg.num_visual_blocks)
    kwargs = inputs(cfg, width, height, frames, args.text_tokens, device)

    results: dict = {"visits": []}
    outputs = {}
    sampler = AnonSampler()
    for visit, mode in enumerate(["resident", "streamed", "streamed", "resident"]):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        resident = mode == "resident"
        if resident:  # lift the previous visit's cap before asking what the card has free
            torch.cuda.set_per_process_memory_fraction(1.0, device)
        budget_gb = 0 if resident else args.budget_gb
        cap_device_memory(device, budget_gb)  # what `k6fast generate` caps its allocator at
        budget_bytes = device_budget(device, budget_gb)
        runtime = build_dit(ckpt.transformer_files, ckpt.dit, device, torch.bfloat16, budget_bytes=budget_bytes,
                            tokens=tokens, max_resident=None if resident else max_resident)  # fmt: skip
        time_forwards(runtime, kwargs, 1)  # warm-up, discarded
        times, stream, out = time_forwards(runtime, kwargs, args.forwards)
        outputs.setdefault(mode, out)
        results["visits"].append({
            "visit": visit, "mode": mode, "forward_s": times, "stream": stream,
            "peak_vram_bytes": torch.cuda.max_memory_allocated(), "plan": runtime.plan.describe(),
            "resident_blocks": runtime.plan.resident_blocks, "streamed_blocks": runtime.plan.streamed_blocks,
        })  # fmt: skip
        runtime.close()
        del runtime
    results["peak_anon_rss_bytes"] = sampler.stop()
    identical = all(torch.equal(a, b) for a, b in zip(outputs["resident"], outputs["streamed"], strict=True))
    med = {m: statistics.median([s for v in results["visits"] if v["mode"] == m for s in v["forward_s"]])
           for m in ("resident", "streamed")}  # fmt: skip
    copies = [s for v in results["visits"] for s in v["stream"]]
    copy_s = sum(s["copy_s"] for s in copies)
    exposed = sum(s["exposed_s"] for s in copies)
    results.update({
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
        "model": args.model, "blocks": cfg.num_visual_blocks, "geometry": args.geometry, "tokens": tokens,
        "budget_gb": args.budget_gb, "full_depth_resident_fraction": fraction, "max_resident": max_resident,
        "bit_identical": identical, "median_forward_s": med, "ratio_streamed_over_resident":
        med["streamed"] / med["resident"], "copy_s_total": copy_s, "exposed_s_total": exposed,
        "hidden_share": 1 - exposed / copy_s if copy_s else None,
    })  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"{'mode':<10}{'median s':>10}{'peak GiB':>10}")
    for v in results["visits"]:
        print(f"{v['mode']:<10}{statistics.median(v['forward_s']):>10.3f}{v['peak_vram_bytes'] / GiB:>10.2f}")
    print(f"streamed/resident {results['ratio_streamed_over_resident']:.4f}, hidden {results['hidden_share']}, "
          f"identical {identical}, resident blocks {max_resident}/{cfg.num_visual_blocks}, "
          f"anon RSS peak {results['peak_anon_rss_bytes'] / GiB:.2f} GiB")  # fmt: skip


if __name__ == "__main__":
    main()
