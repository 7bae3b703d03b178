"""A run's video decode against its compute ceiling (the acceptance's "video decode vs ceiling").

The ceiling is the decode's least work at the fastest dense BF16 rate measured on the same GPU (cuBLAS, the best of
the GEMM shapes `roofline.CEILINGS` holds; a measured rate, not the datasheet's). The work is counted by PyTorch's FLOP
counter over k6fast's own exact decode (`decode_video_fast`, the whole clip, nothing recomputed) run on the meta
device: the VAE built from its config, no weights read, no memory, no GPU. Its convolutions are implicit GEMMs on the
same tensor cores. A plan that fuses ops and recomputes to fit a tighter budget does more work than this, and a
process's first decode pays set-up: both show as a lower share, which is the point. Only where the GPU's rates were
measured.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from .roofline import Ceilings, find_ceilings

UNBOUNDED = 1 << 50  # the plan's budget: the whole clip at once, nothing recomputed


def dense_bf16_rate(c: Ceilings) -> float:
    """FLOP/s: the fastest BF16 GEMM measured on `c`'s GPU (timed at M = the video tokens of its attention shape)."""
    m = c.attention_shape[1]
    return max(2 * m * k * n / seconds for (k, n), seconds in c.gemm_s["bf16"].items())


def decode_flops(vae_dir: str, width: int, height: int, frames: int, budget_bytes: int = UNBOUNDED) -> dict[str, float]:
    """The FLOPs by aten op of the exact video decode of a width x height x frames clip by the VAE whose config is in
    `vae_dir`, under the decode's plan for `budget_bytes` (a tighter budget fuses ops and recomputes what it cannot
    keep: more FLOPs; the default, none of that)."""
    return dict(_decode_flops(vae_dir, width, height, frames, budget_bytes))


@functools.cache
def _decode_flops(vae_dir: str, width: int, height: int, frames: int, budget: int) -> tuple[tuple[str, float], ...]:
    import torch
    from diffusers import AutoencoderKLHunyuanVideo
    from torch.utils.flop_counter import FlopCounterMode

    from ..vae_geometry import latent_frames, latent_size
    from ..video_decode import decode_video_fast, plan_video_decode

    with torch.device("meta"):
        vae = AutoencoderKLHunyuanVideo.from_config(AutoencoderKLHunyuanVideo.load_config(vae_dir))
    vae = vae.to(torch.bfloat16).eval()
    shape = (1, latent_frames(frames), *latent_size(height, width), vae.config.latent_channels)
    latents = torch.empty(shape, device="meta", dtype=torch.bfloat16)
    plan = plan_video_decode(vae, shape[1:4], budget_bytes=budget, dtype=torch.bfloat16)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        decode_video_fast(vae, latents, plan=plan, layout="ncdhw", triton_norm=False)
    return tuple((str(op).split(".")[1], float(n)) for op, n in counter.get_flop_counts()["Global"].items())


def row_decode_ceiling(sidecar: dict[str, Any], root: Path) -> dict | None:
    """{tflop, ceiling_s, decode_s, share} of a `k6fast generate` sidecar's video decode (its GPU, geometry and
    video decode seconds) for the checkpoint in `root`, or None where the GPU has no measured rate or the sidecar no
    video decode."""
    c = find_ceilings(sidecar.get("gpu_name"))
    request, telemetry = sidecar.get("request"), sidecar.get("telemetry")
    if c is None or not isinstance(request, dict) or not isinstance(telemetry, dict):
        return None
    seconds = (telemetry.get("phases_s") or {}).get("video_decode")
    geometry = [request.get(k) for k in ("width", "height", "frames")]
    if not isinstance(seconds, (int, float)) or seconds <= 0 or not all(isinstance(v, int) for v in geometry):
        return None
    flops = sum(decode_flops(str(root / "vae"), *geometry).values())
    ceiling = flops / dense_bf16_rate(c)
    return {"tflop": round(flops / 1e12, 1), "ceiling_s": round(ceiling, 3), "decode_s": round(seconds, 3),
            "share": round(ceiling / seconds, 4)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Print the video decode's ceiling of each `k6fast generate` sidecar given, for a checkpoint's VAE; with
    --geometry, the decode's FLOPs by op at that geometry under each --budget-gib's plan (0: unbounded, the
    ceiling's)."""
    import argparse
    import json

    from ..checkpoint import open_checkpoint
    from .workload import parse_geometry

    p = argparse.ArgumentParser(prog="python -m k6fast.bench.decode_ceiling", description=main.__doc__)
    p.add_argument("sidecars", nargs="*", type=Path, help="clip.mp4.json files")
    p.add_argument("--model", required=True, help="the checkpoint the runs read (its vae/config.json)")
    p.add_argument("--geometry", type=parse_geometry, help="w1 or WxHxF: print the decode's FLOPs at this geometry")
    p.add_argument("--budget-gib", type=float, nargs="+", default=[0.0], help="the plans' budgets, with --geometry")
    args = p.parse_args(argv)
    root = open_checkpoint(args.model).root
    for path in args.sidecars:
        print(f"{path}: {json.dumps(row_decode_ceiling(json.loads(path.read_text()), root))}")
    if args.geometry:
        g = args.geometry
        for gib in args.budget_gib:
            budget = int(gib * 2**30) if gib > 0 else UNBOUNDED
            flops = decode_flops(str(root / "vae"), g.width, g.height, g.frames, budget)
            print(f"{g.label()} plan for {gib or 'unbounded'} GiB: {sum(flops.values()) / 1e12:.1f} TFLOP "
                  f"({', '.join(f'{op} {n / 1e12:.1f}' for op, n in flops.items())})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
