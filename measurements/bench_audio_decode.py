"""The audio decode (MMAudio VAE + vocoder, `k6fast.vae.decode_audio`) at a request's audio length, with cuDNN's
convolution algorithm timing off and on (`torch.backends.cudnn.benchmark`, which `generate` and `serve` set for the
whole process: k6fast.entry.time_convolutions).

Each setting runs in a fresh process (cuDNN keeps its timed choices for the process's life): the decoders are loaded,
then the same latents are decoded `--repeats` times, each call timed to the device's end, and the waveforms are
checked equal across calls of one setting.

Run:  python measurements/bench_audio_decode.py --model CKPT --frames 121 --out audio_decode.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path


def child(model: Path, frames: int, fps: float, repeats: int, benchmark: bool, device: str, budget_gb: float,
          hold_gb: float) -> dict:  # fmt: skip
    import torch

    from k6fast.entry import cap_device_memory, expandable_segments_now
    from k6fast.vae import decode_audio, load_audio_decoder
    from k6fast.vae_geometry import audio_length, audio_rate, latent_frames

    torch.backends.cudnn.benchmark = benchmark
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    held = None
    if budget_gb and device.type == "cuda":  # as a `generate` process has it: expandable segments, capped allocator
        expandable_segments_now()
        cap_device_memory(device, budget_gb)
        held = torch.empty(int(hold_gb * 2**30), dtype=torch.uint8, device=device)  # the DiT's resident blocks
    audio_vae, vocoder = load_audio_decoder(model, device, torch.bfloat16)
    length = audio_length(latent_frames(frames), fps, audio_rate(model))
    latents = torch.randn(1, length, audio_vae.config.latent_channels, generator=torch.Generator().manual_seed(0))
    latents = latents.to(device, torch.bfloat16)
    seconds, first = [], None
    with torch.no_grad():
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            wave = decode_audio(audio_vae, vocoder, latents)
            sync()
            seconds.append(round(time.perf_counter() - start, 4))
            first = wave if first is None else first
            assert torch.equal(wave, first), "the decode differs between calls"
    del held
    return {
        "cudnn_benchmark": benchmark,
        "budget_gb": budget_gb,
        "hold_gb": hold_gb,
        "latent_length": length,
        "samples": first.shape[-1],
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--frames", type=int, default=121)
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
    if args.child:
        budget = args.budget_gb[0]
        on = args.child == "on"
        print(json.dumps(child(args.model, args.frames, args.fps, args.repeats, on, args.device, budget, args.hold_gb)))
        return
    rows = []
    for budget, setting in itertools.product(args.budget_gb, ("off", "on")):
        cmd = [sys.executable, __file__, "--model", str(args.model), "--frames", str(args.frames), "--fps",
               str(args.fps), "--repeats", str(args.repeats), "--device", args.device, "--budget-gb", str(budget),
               "--hold-gb", str(args.hold_gb), "--child", setting]  # fmt: skip
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
