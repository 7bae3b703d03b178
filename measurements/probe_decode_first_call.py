"""Where a process's first W1 video decode spends the ≈ 4 s its later calls do not (8.3-8.6 s against 4.5 s a
call: measurements/sessions/2026-12-02_acceptance-envelope2, decode_cudnn_video.json).

One process, as `generate` reaches its video decode: expandable segments and the allocator capped at the budget; a
tensor of --hold-gb standing in for the DiT's resident blocks, freed with `empty_cache` as `Pipeline.drop_dit` does;
then the decode (`decode_video_fast` with its plan for the budget, channels-last, the Triton GroupNorm) --repeats
times, each call under torch.profiler (CPU and CUDA). Recorded per call: wall seconds; the profiler's top rows by self
CPU time (aten ops, CUDA runtime and driver calls: cudnn plan building, module loading and the allocator's mappings
each show up there); the summed CUDA kernel time; the allocator's reserved bytes before and after. The outputs are
checked equal across calls. Each call's device seconds by aten op set its kernels against the decode's FLOPs, which
`python -m k6fast.bench.decode_ceiling --geometry ... --budget-gib ...` counts on the CPU for the plan it ran. With
--keep-mapped the stand-in is freed without `empty_cache`: the decode then reuses the allocator's mapped memory
instead of mapping its own (is that the first call's unprofiled remainder?).

Run:  python measurements/probe_decode_first_call.py --model CKPT --budget-gb 32 --hold-gb 19 --out probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

TOP = 25


def device_by_op(prof) -> dict[str, float]:
    """Device seconds of the kernels each aten op launched itself (self device time), the 12 largest."""
    averages = [e for e in prof.key_averages() if e.key.startswith("aten::") and e.self_device_time_total > 0]
    top = sorted(averages, key=lambda e: e.self_device_time_total, reverse=True)[:12]
    return {e.key: round(e.self_device_time_total / 1e6, 4) for e in top}


def rows(prof) -> tuple[list[dict], float]:
    """The top rows by self CPU time, and the summed device time of the call's kernels (seconds): the CUDA events
    only (each kernel's time is also attributed to the CPU op that launched it)."""
    from torch.autograd import DeviceType

    averages = prof.key_averages()
    top = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:TOP]
    kernel_us = sum(e.self_device_time_total for e in averages
                    if e.device_type == DeviceType.CUDA and not e.is_user_annotation)  # fmt: skip
    return [
        {"name": e.key, "count": e.count, "self_cpu_s": round(e.self_cpu_time_total / 1e6, 4),
         "cpu_total_s": round(e.cpu_time_total / 1e6, 4)}
        for e in top
    ], round(kernel_us / 1e6, 4)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--size", default="864x480x121", help="WxHxF of the request")
    parser.add_argument("--budget-gb", type=float, default=32.0)
    parser.add_argument("--hold-gb", type=float, default=19.0, help="allocated, then freed before the first decode")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--keep-mapped", action="store_true", help="free the stand-in without empty_cache")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from k6fast.allocator import device_budget, held_after_release
    from k6fast.entry import cap_device_memory, expandable_segments_now
    from k6fast.vae import load_video_vae
    from k6fast.vae_geometry import latent_frames, latent_size
    from k6fast.video_decode import decode_video_fast, plan_video_decode

    device = torch.device("cuda")
    width, height, frames = (int(v) for v in args.size.split("x"))
    expandable_segments_now()
    cap_device_memory(device, args.budget_gb)
    vae = load_video_vae(args.model, device, torch.bfloat16)
    shape = (1, latent_frames(frames), *latent_size(height, width), vae.config.latent_channels)
    latents = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device, torch.bfloat16)
    stand_in = torch.empty(int(args.hold_gb * 2**30), dtype=torch.uint8, device=device)
    del stand_in
    start = time.perf_counter()
    if not args.keep_mapped:
        torch.cuda.empty_cache()
    empty_cache_s = time.perf_counter() - start
    # What the pipeline plans the decode on (`Pipeline.free_budget`): what empty_cache would leave, or left.
    held = held_after_release(device) if args.keep_mapped else None
    room = device_budget(device, args.budget_gb) - (torch.cuda.memory_reserved(device) if held is None else held)
    plan = plan_video_decode(vae, shape[1:4], budget_bytes=room, dtype=torch.bfloat16)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):  # the profiler's own start, paid here
        torch.ones(1, device=device).add_(1)
        torch.cuda.synchronize()
    calls, first = [], None
    with torch.no_grad():
        for _ in range(args.repeats):
            reserved = torch.cuda.memory_reserved(device)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                start = time.perf_counter()
                out = decode_video_fast(vae, latents, plan=plan, layout="ndhwc", triton_norm=True)
                torch.cuda.synchronize()
                seconds = time.perf_counter() - start
            top, kernel_s = rows(prof)
            first = out if first is None else first
            assert torch.equal(out, first), "the decode differs between calls"
            calls.append({"seconds": round(seconds, 4), "kernel_s": kernel_s, "reserved_before": reserved,
                          "reserved_after": torch.cuda.memory_reserved(device), "top_self_cpu": top,
                          "device_s_by_op": device_by_op(prof)})  # fmt: skip
            print(f"call {len(calls)}: {seconds:.2f} s, kernels {kernel_s:.2f} s", file=sys.stderr)
            for r in top[:12]:
                print(f"  {r['self_cpu_s']:8.3f} s  x{r['count']:<6} {r['name'][:90]}", file=sys.stderr)
    record = {
        "command": sys.argv,
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "latents": list(shape),
        "video_decode": plan.describe(),
        "keep_mapped": args.keep_mapped,
        "empty_cache_s": round(empty_cache_s, 4),
        "calls": calls,
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
