"""The decoders at a request's geometry with cuDNN's convolution algorithm timing off and on
(`torch.backends.cudnn.benchmark`, which `generate` and `serve` set for the whole process:
k6fast.entry.time_convolutions): the audio decode (MMAudio VAE + vocoder, `k6fast.vae.decode_audio`) and the video
decode (`decode_video_fast` as the pipeline runs it: its plan for the budget, channels-last, the Triton GroupNorm).

Each setting runs in a fresh process (cuDNN keeps its timed choices for the process's life): the decoder is loaded,
then the same latents are decoded `--repeats` times, each call timed to the device's end, and the outputs are checked
equal across calls of one setting. The first call is what a `k6fast generate` process pays.

Run:  python measurements/bench_decode_cudnn.py --model CKPT --decoder audio --budget-gb 0 32 --out audio.json
      python measurements/bench_decode_cudnn.py --model CKPT --decoder video --budget-gb 32 --hold-gb 0 --out video.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time
from functools import partial
from pathlib import Path


def child(model: Path, decoder: str, width: int, height: int, frames: int, fps: float, repeats: int,
          benchmark: bool, device: str, budget_gb: float, hold_gb: float) -> dict:  # fmt: skip
    import torch

    from k6fast.allocator import device_budget
    from k6fast.entry import cap_device_memory, expandable_segments_now
    from k6fast.vae import decode_audio, load_audio_decoder, load_video_vae
    from k6fast.vae_geometry import audio_length, audio_rate, latent_frames, latent_size
    from k6fast.video_decode import decode_video_fast, plan_video_decode

    torch.backends.cudnn.benchmark = benchmark
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    held = None
    if budget_gb and device.type == "cuda":  # as a `generate` process has it: expandable segments, capped allocator
        expandable_segments_now()
        cap_device_memory(device, budget_gb)
        held = torch.empty(int(hold_gb * 2**30), dtype=torch.uint8, device=device)  # the DiT's resident blocks
    generator = torch.Generator().manual_seed(0)
    plan = None
    if decoder == "audio":
        audio_vae, vocoder = load_audio_decoder(model, device, torch.bfloat16)
        length = audio_length(latent_frames(frames), fps, audio_rate(model))
        shape = (1, length, audio_vae.config.latent_channels)
        run = partial(decode_audio, audio_vae, vocoder)
    else:
        vae = load_video_vae(model, device, torch.bfloat16)
        shape = (1, latent_frames(frames), *latent_size(height, width), vae.config.latent_channels)
        room = device_budget(device, budget_gb) - torch.cuda.memory_allocated(device) if budget_gb else 40 * 2**30
        plan = plan_video_decode(vae, shape[1:4], budget_bytes=room, dtype=torch.bfloat16)
        cuda = device.type == "cuda"
        run = partial(decode_video_fast, vae, plan=plan, layout="ndhwc" if cuda else "ncdhw", triton_norm=cuda)
    latents = torch.randn(shape, generator=generator).to(device, torch.bfloat16)
    seconds, first = [], None
    with torch.no_grad():
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            out = run(latents)
            sync()
            seconds.append(round(time.perf_counter() - start, 4))
            first = out if first is None else first
            assert torch.equal(out, first), "the decode differs between calls"
    del held
    return {
        "cudnn_benchmark": benchmark,
        "budget_gb": budget_gb,
        "hold_gb": hold_gb,
        "decoder": decoder,
        "latents": list(shape),
        "output": list(first.shape),
        "video_decode": plan.describe() if plan is not None else None,
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--decoder", choices=("audio", "video"), default="audio")
    parser.add_argument("--size", default="864x480x121", help="WxHxF of the request")
    parser.add_argument("--fps", type=float, default=24.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script")
    parser.add_argument(
        "--budget-gb",
        type=float,
        nargs="*",
        default=[0.0],
        help="each: the allocator capped at it (0: uncapped), with --hold-gb held as the DiT would",
    )
    parser.add_argument("--hold-gb", type=float, default=20.0)
    parser.add_argument("--child", choices=("off", "on"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    width, height, frames = (int(v) for v in args.size.split("x"))
    if args.child:
        row = child(args.model, args.decoder, width, height, frames, args.fps, args.repeats, args.child == "on",
                    args.device, args.budget_gb[0], args.hold_gb)  # fmt: skip
        print(json.dumps(row))
        return
    rows = []
    for budget, setting in itertools.product(args.budget_gb, ("off", "on")):
        cmd = [sys.executable, __file__, "--model", str(args.model), "--decoder", args.decoder, "--size", args.size,
               "--fps", str(args.fps), "--repeats", str(args.repeats), "--device", args.device, "--budget-gb",
               str(budget), "--hold-gb", str(args.hold_gb), "--child", setting]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    import torch

    gpu = torch.cuda.get_device_name() if args.device != "cpu" else "cpu"
    record = {"command": sys.argv, "gpu": gpu, "torch": torch.__version__, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
