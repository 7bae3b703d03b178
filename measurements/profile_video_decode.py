"""Where the W1 video decode's seconds go (issue #35: 5.6 s warm against a 1.27 s FLOP ceiling on an H200,
measurements/sessions/2026-12-03_acceptance-every-second).

The decode a `k6fast generate` request runs at 32 GiB (`Pipeline.decode_video_latents`: the plan for the budget,
channels-last activations, the Triton GroupNorm kernels, cuDNN's heuristics), on a random VAE of the real config
and random W1 latents (the decode's work does not depend on the values). A first decode (the process's first call:
cuDNN and Triton set-up), two timed ones (CUDA events), then one more with (a) the GPU synchronised at each of the
decode's stop checks, which come before every op, so each op's seconds, and (b) PyTorch's profiler, its kernels
summed by kind. The FLOPs are PyTorch's count of the same decode on the meta device (`k6fast.bench.decode_ceiling`),
so the convolutions' achieved rate sits beside their kernel time.

Run:  python measurements/profile_video_decode.py --out decode_profile.json     (CUDA)
      python measurements/profile_video_decode.py --smoke                         (CPU, a narrow VAE: the script only)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_vae_decode import GEOMETRIES, SMOKE_GEOMETRIES, load_vae

from k6fast.bench.decode_ceiling import decode_flops
from k6fast.memory import GiB
from k6fast.vae_geometry import SPATIAL_STRIDE, pixel_frames
from k6fast.video_decode import decode_video_fast, plan_video_decode

# Kernel name fragments → kind, first match wins (cuDNN's and cuBLAS's kernels, the Triton GroupNorm+SiLU kernel,
# PyTorch's own). What matches none is "other".
KINDS = (
    ("groupnorm statistics (Triton)", ("channel_moments",)),
    ("groupnorm+silu (Triton)", ("groupnorm_silu",)),
    ("convolution (cuDNN)", ("conv", "fprop", "xmma", "implicit", "cudnn", "dgrad", "winograd")),
    ("attention / GEMM", ("flash", "fmha", "attention", "gemm", "cutlass", "sm90_", "nvjet")),
    ("reductions (norm statistics)", ("reduce", "welford", "norm")),
    ("copies and layout", ("memcpy", "copy", "cat", "transpose", "permute", "contiguous")),
    ("upsample", ("upsample", "nearest", "interpolate")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "silu", "add", "mul")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, parts in KINDS if any(p in low for p in parts)), "other")


class OpClock:
    """A stop check that never stops: it synchronises the device and keeps the time of every call (one before each
    op), so consecutive calls bound one op."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.times = device, []

    def __call__(self) -> bool:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--budget-gb",
        type=float,
        default=30.0,
        help="what the decode may allocate (30: the plan of the "
        "W1 requests' decode at K6_VRAM_BUDGET_GB=32, the lean whole-clip decode, estimated peak 27.88 GiB)",
    )
    p.add_argument("--out", type=Path, help="the JSON written")
    p.add_argument("--smoke", action="store_true", help="CPU, narrow VAE, tiny latents: checks the script only")
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    cuda = device.type == "cuda"
    vae = load_vae(None, device, args.smoke)  # random weights of the real config (a narrow one with --smoke)
    shape = (SMOKE_GEOMETRIES if args.smoke else GEOMETRIES)["W1"]  # latent frames, height, width
    channels = vae.config.latent_channels
    latents = torch.randn(1, *shape, channels, device=device, dtype=torch.bfloat16)
    plan = plan_video_decode(vae, shape, budget_bytes=int(args.budget_gb * GiB))
    print("plan:", plan.describe(peak=cuda), file=sys.stderr)

    def decode(should_stop=None):
        out = decode_video_fast(vae, latents, plan=plan, layout="ndhwc" if cuda else "ncdhw", triton_norm=cuda,
                                should_stop=should_stop)  # fmt: skip
        if cuda:
            torch.cuda.synchronize()
        return out

    started = time.perf_counter()
    decode()
    first_s = time.perf_counter() - started
    timed = []
    for _ in range(2):
        started = time.perf_counter()
        decode()
        timed.append(time.perf_counter() - started)
    clock = OpClock(device)
    started = time.perf_counter()
    decode(clock)
    ended = time.perf_counter()
    marks = [*clock.times, ended]
    op_s = [round(b - a, 4) for a, b in zip(marks, marks[1:], strict=False)]

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        decode()
    kinds: dict[str, float] = {}
    kernels = []
    for event in prof.key_averages():
        seconds = (event.device_time_total if cuda else event.self_cpu_time_total) / 1e6
        if seconds <= 0:
            continue
        kind = kind_of(event.key)
        kinds[kind] = kinds.get(kind, 0.0) + seconds
        kernels.append((seconds, event.count, event.key[:120]))
    kernels.sort(reverse=True)
    with tempfile.TemporaryDirectory() as config_dir:
        vae.save_config(config_dir)
        height, width, frames = shape[1] * SPATIAL_STRIDE, shape[2] * SPATIAL_STRIDE, pixel_frames(shape[0])
        flops = decode_flops(config_dir, width, height, frames)
    conv_flops = sum(f for op, f in flops.items() if "conv" in op)
    conv_s = kinds.get("convolution (cuDNN)", 0.0)
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu (smoke)",
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "plan": plan.describe(peak=cuda),
        "first_decode_s": round(first_s, 3),
        "decode_s": [round(t, 3) for t in timed],
        "synchronised_decode_s": round(ended - marks[0], 3),
        "op_s": op_s,
        "kernel_s_by_kind": {k: round(v, 4) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"s": round(s, 4), "calls": n, "name": name} for s, n, name in kernels[:20]],
        "tflop_by_op": {op: round(f / 1e12, 2) for op, f in sorted(flops.items(), key=lambda kv: -kv[1])},
        "convolution_tflop_per_s": round(conv_flops / conv_s / 1e12, 1) if conv_s else None,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
