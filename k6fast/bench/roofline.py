"""A run's steady DiT step against what measured kernel ceilings allow (the acceptance's "DiT step vs ceiling").

The ceiling of a step is the time of its two dominant parts at the rates measured for them on the same GPU, as if
nothing else ran: each fused block's video self-attention (the kernel the arm's attention policy picks for that block
at a steady step: exact, or block-sparse at the arm's density) and its video-token GEMMs (at the arm's GEMM format's
rate, per shape), twice under CFG. The cross-attentions, the audio stream, the modulation and the elementwise passes
are left out, so the share measured/ceiling is an upper bound on what the kernels alone would give. Exact attention is
timed at the fastest exact kernel measured (flash-attn-4) whichever exact kernel the arm runs: a ceiling, not the
arm's kernel. Figures exist only for the GPUs and the attention shape they were measured at (`CEILINGS`); elsewhere
there is no ceiling, not a guess.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from ..dit.config import DiTConfig, video_gemm_shapes

MIN_STEADY_STEPS = 3  # fewer steps than this at the steady policy give no steady figure


@dataclass(frozen=True)
class Ceilings:
    """Kernel times measured on one GPU (medians of the benchmarks the sources name)."""

    gpu: str  # torch.cuda.get_device_name, as the rows record it
    capability: tuple[int, int]
    attention_shape: tuple[int, int, int]  # (heads, video tokens, head dim) the attention times are for
    exact_attention_s: float  # one video self-attention, flash-attn-4 (the fastest exact kernel measured)
    sparse_attention_s: dict[float, float]  # by density: the block-sparse kernel with its mask
    gemm_s: dict[str, dict[tuple[int, int], float]]  # by resolved K6_GEMM, by (K, N), at M = the video tokens
    sources: tuple[str, ...]


_ATTENTION = "measurements/sessions/2026-12-01_attention-benches"
_GEMM = "measurements/sessions/2026-11-29_kernels/gemm.json"
CEILINGS = (
    Ceilings(
        gpu="NVIDIA H200",
        capability=(9, 0),
        attention_shape=(32, 50220, 128),
        exact_attention_s=61.47e-3,  # exact_attention.json: flash_attn_4 at 1x32x50220x128
        # sparse_attention.json, impl fa4: ms + mask_ms
        sparse_attention_s={1.0: 63.690e-3, 0.5: 32.950e-3, 0.25: 17.024e-3, 0.125: 9.207e-3},
        gemm_s={  # gemm.json p50: cublas_bf16, and fp8_gemm (row-wise torch._scaled_mm, its FP8 ceiling)
            "bf16": {(4096, 4096): 2.4024e-3, (4096, 16384): 9.6555e-3, (16384, 4096): 9.7157e-3},
            "fp8": {(4096, 4096): 1.4443e-3, (4096, 16384): 5.7781e-3, (16384, 4096): 5.6111e-3},
        },
        sources=(f"{_ATTENTION}/exact_attention.json", f"{_ATTENTION}/sparse_attention.json", _GEMM),
    ),
)


@dataclass(frozen=True)
class Steps:
    """A run's seconds per denoising step, which steps called the DiT (not a cached prediction), and its DiT forwards
    in all (two a called step under CFG)."""

    seconds: list[float]
    called: list[bool]
    dit_calls: int

    def forwards_per_step(self) -> int | None:
        n = sum(self.called)
        return self.dit_calls // n if n and self.dit_calls % n == 0 else None


def steady_step_s(steps: Steps, exact_steps: int, exact_last_steps: int) -> float | None:
    """The median of the called steps that run the arm's steady policy: past its exact first steps and the process's
    first step (compile, first kernels), before its exact last steps; None with fewer than MIN_STEADY_STEPS."""
    inner = range(max(1, exact_steps), len(steps.seconds) - exact_last_steps)
    values = [steps.seconds[i] for i in inner if steps.called[i]]
    return statistics.median(values) if len(values) >= MIN_STEADY_STEPS else None


def _gemm_s(times: dict[tuple[int, int], float], shape: tuple[int, int]) -> float | None:
    """A GEMM's measured time, or for a shape not measured that of the measured shape with its K and the nearest N,
    at the same rate per FLOP (the audio stream's d x d_audio projections: half of a measured d x d)."""
    if shape in times:
        return times[shape]
    k, n = shape
    same_k = [measured for measured in times if measured[0] == k]
    if not same_k:
        return None
    nearest = min(same_k, key=lambda m: abs(m[1] - n))
    return times[nearest] * n / nearest[1]


def find_ceilings(gpu: str | None) -> Ceilings | None:
    return next((c for c in CEILINGS if c.gpu == gpu), None)


def step_ceiling(cfg: DiTConfig, options, gpu: str | None, video_tokens: int, steps: Steps) -> dict | None:
    """{ceiling_s, steady_s, share} of a run of `options` (its switches) on `gpu`, or None where no ceiling was
    measured for that GPU, attention shape, GEMM format or sparse density, or the steps give no steady figure."""
    from ..dit.arch import Target, resolve_for

    c = find_ceilings(gpu)
    if c is None or (cfg.model_dim // cfg.head_dim, video_tokens, cfg.head_dim) != c.attention_shape:
        return None
    options = resolve_for(options, Target(gpu, c.capability, False))
    times = c.gemm_s.get(options.gemm)
    if times is None:
        return None
    shape_s = {shape: _gemm_s(times, shape) for shape in video_gemm_shapes(cfg)}
    if None in shape_s.values():
        return None
    sparse = c.sparse_attention_s.get(options.sparse_attn) if options.sparse_attn > 0 else None
    if (options.sparse_attn > 0 and sparse is None) or (options.attn != "exact" and options.sparse_attn == 0):
        return None  # a density or a quantized video attention without a measured kernel time
    forwards = steps.forwards_per_step()
    steady = steady_step_s(steps, options.exact_attn_steps, options.exact_attn_last_steps)
    if forwards is None or steady is None:
        return None
    blocks = cfg.num_visual_blocks
    gemm = blocks * sum(count * shape_s[shape] for shape, count in video_gemm_shapes(cfg).items())
    # At a steady step (the first past the exact ones, the schedule's end not reached) the policy's lossy blocks run
    # block-sparse video self-attention.
    lossy = sum(options.lossy_attention_at(options.exact_attn_steps, None, b, blocks) for b in range(blocks))
    sparse_blocks = lossy if sparse is not None else 0
    ceiling = forwards * (gemm + sparse_blocks * (sparse or 0.0) + (blocks - sparse_blocks) * c.exact_attention_s)
    return {"ceiling_s": round(ceiling, 4), "steady_s": round(steady, 4), "share": round(ceiling / steady, 4)}


def row_ceiling(sidecar: dict[str, Any], cfg: DiTConfig) -> dict | None:
    """`step_ceiling` of a `k6fast generate` sidecar (its switches, GPU, request and step times). A request with an
    image (a tail frame) or without audio has other token counts than the ceilings' shapes: none."""
    from ..request import video_tokens
    from ..switches import load_options

    request, telemetry = sidecar.get("request") or {}, sidecar.get("telemetry") or {}
    switches = (sidecar.get("provenance") or {}).get("switches") or {}
    try:
        options = load_options(environ={k: str(v) for k, v in switches.items()})
        w, h, f = request["width"], request["height"], request["frames"]
    except Exception:  # an older or a foreign sidecar: no ceiling rather than a failed record
        return None
    if request.get("image") or not request.get("audio", True):
        return None
    seconds, dit_calls = telemetry.get("step_s") or [], telemetry.get("dit_calls") or 0
    called = telemetry.get("step_called")
    if called is None:  # sidecars before step_called: the PiFlow cache steps, where they account for every call
        called = [i not in options.piflow_cache_steps for i in range(len(seconds))]
        if options.step_cache != "off" or sum(called) != dit_calls:
            return None
    tokens = video_tokens(w, h, f, image=False)
    return step_ceiling(cfg, options, sidecar.get("gpu_name"), tokens, Steps(seconds, called, dit_calls))


def main(argv: list[str] | None = None) -> int:
    """Print the ceiling of each `k6fast generate` sidecar given, for a checkpoint's config or a synthetic preset's."""
    import argparse
    import json
    from pathlib import Path

    p = argparse.ArgumentParser(prog="python -m k6fast.bench.roofline", description=main.__doc__)
    p.add_argument("sidecars", nargs="+", type=Path, help="clip.mp4.json files")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, help="the checkpoint the runs read")
    source.add_argument("--preset", help="a make-synthetic preset (e.g. pro-distill) for the DiT's shapes")
    args = p.parse_args(argv)
    if args.model:
        from ..checkpoint import open_checkpoint

        cfg = open_checkpoint(args.model).dit
    else:
        from ..testing.synthetic import transformer_config

        cfg = DiTConfig.from_dict(transformer_config(args.preset, None))
    for path in args.sidecars:
        print(f"{path}: {json.dumps(row_ceiling(json.loads(path.read_text()), cfg))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
