"""The decode of a batch of latent clips by a plan: the whole-clip ops, then the streamed ones slab by slab over
each spatial tile, blended into the fp32 output; `decode_video_fast` plans and decodes."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

from ..cancel import StopCheck
from .decoder import decoder_geometry, decoder_ops
from .norm_stats import _channel_moments, _fused_channel_moments, _Moments, _Stream
from .plan import VideoDecodePlan, plan_video_decode
from .run_ops import _check_fusions, _Ctx, _run

logger = logging.getLogger(__name__)

LAYOUTS = ("ncdhw", "ndhwc")
_MEMORY_FORMATS = {"ncdhw": torch.contiguous_format, "ndhwc": torch.channels_last_3d}


def _edge_weights(spans: list[tuple[int, int]], halo: int, device: torch.device) -> list[Tensor | None]:
    """Per window along one axis (output pixels): 1 inside, and across each overlap with a neighbour a linear ramp
    over the overlap's middle, leaving out `halo` pixels at each window edge (what replicate padding at that edge
    reached). Normalised so that the windows' weights sum to 1 at every pixel."""
    if len(spans) == 1:
        return [None]
    weights = []
    for i, (s, e) in enumerate(spans):
        wgt = torch.ones(e - s, dtype=torch.float64)
        pos = torch.arange(s, e, dtype=torch.float64) + 0.5
        if i > 0:  # ramp in from the previous window
            wgt = wgt * _ramp(pos, s + halo, spans[i - 1][1] - halo)
        if i + 1 < len(spans):  # ramp out to the next window
            wgt = wgt * (1 - _ramp(pos, spans[i + 1][0] + halo, e - halo))
        weights.append(wgt)
    total = torch.zeros(max(e for _, e in spans), dtype=torch.float64)
    for (s, e), wgt in zip(spans, weights, strict=True):
        total[s:e] += wgt
    return [(wgt / total[s:e]).float().to(device) for (s, e), wgt in zip(spans, weights, strict=True)]


def _ramp(pos: Tensor, lo: float, hi: float) -> Tensor:
    if hi <= lo:  # an overlap narrower than both halos: switch in its middle
        return (pos >= (lo + hi) / 2).to(pos.dtype)
    return ((pos - lo) / (hi - lo)).clamp(0, 1)


def _decode_sample(
    vae: nn.Module,
    z: Tensor,
    plan: VideoDecodePlan,
    ctx: _Ctx,
    out: Tensor,
    frozen: Mapping[str, _Moments] | None,
    finished: Callable[[int, int], None],
) -> dict[str, _Moments]:
    """z [1, C, T, H, W] (unscaled, post_quant_conv applied) → the decoder output accumulated into out [F, H, W, 3].
    finished(f0, f1) is called, in order and once per frame, as soon as frames [f0, f1) of `out` hold their final
    value: chunk by chunk of the last op's convolution, over the last spatial tile (the earlier tiles have been
    blended in by then). Returns the GroupNorm statistics the decode used (whole-clip ones when the plan is exact)."""
    ops = decoder_ops(vae)
    fusions = _check_fusions(ops, plan)
    scale = decoder_geometry(ops, *z.shape[2:])[-1].s_ratio
    prefix = _Stream(frozen, whole_clip=True)

    def emit_whole(stream: _Stream, t0: int, t1: int, y: Tensor) -> None:
        f0 = stream.frames_out
        out[f0 + t0 : f0 + t1].copy_(y[0].permute(1, 2, 3, 0))
        finished(f0 + t0, f0 + t1)

    ctx.emit = emit_whole
    x = _run(ops[: plan.split], z, prefix, ctx, fusions)
    if x is None:
        return prefix.moments
    seg_ops = ops[plan.split :]
    ratio = scale // plan.segment_scale
    t_ratio = decoder_geometry(ops, *z.shape[2:])[plan.split].t_ratio
    latent_frames = plan.latent_shape[0]
    bounds = list(range(0, latent_frames, plan.slab_latent_frames)) + [latent_frames]
    slabs = [
        (0 if a == 0 else 1 + t_ratio * (a - 1), 1 + t_ratio * (e - 1))
        for a, e in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    rows = sorted({(r0 * ratio, r1 * ratio) for r0, r1, _, _ in plan.tiles})
    cols = sorted({(c0 * ratio, c1 * ratio) for _, _, c0, c1 in plan.tiles})
    row_w = dict(zip(rows, _edge_weights(rows, plan.halo, out.device), strict=True))
    col_w = dict(zip(cols, _edge_weights(cols, plan.halo, out.device), strict=True))
    moments: dict[str, _Moments] = dict(prefix.moments)
    for n, (r0, r1, c0, c1) in enumerate(plan.tiles):
        rs, cs = (r0 * ratio, r1 * ratio), (c0 * ratio, c1 * ratio)
        wr, wc = row_w[rs], col_w[cs]
        weight = None if wr is None and wc is None else _outer(wr, wc, rs, cs, out.device)
        last = n + 1 == len(plan.tiles)

        def emit_tile(stream: _Stream, t0: int, t1: int, y: Tensor, rs=rs, cs=cs, weight=weight, last=last) -> None:
            f0 = stream.frames_out
            region = out[f0 + t0 : f0 + t1, rs[0] : rs[1], cs[0] : cs[1]]
            frames = y[0].permute(1, 2, 3, 0)
            if weight is None:
                region.copy_(frames)
            else:
                region.addcmul_(frames, weight)
            if last:
                finished(f0 + t0, f0 + t1)

        ctx.emit = emit_tile
        stream = _Stream(frozen)
        for s0, s1 in slabs:
            _run(seg_ops, x[:, :, s0:s1, r0:r1, c0:c1], stream, ctx)
        moments.update(stream.moments)
    return moments


def _outer(wr: Tensor | None, wc: Tensor | None, rs, cs, device: torch.device) -> Tensor:
    """Blend weight [h, w, 1] of one tile from its row and column weights (None = all ones)."""
    if wr is None:
        wr = torch.ones(rs[1] - rs[0], device=device)
    if wc is None:
        wc = torch.ones(cs[1] - cs[0], device=device)
    return (wr[:, None] * wc[None, :])[..., None]


@torch.no_grad()
def decode_with_plan(
    vae: nn.Module,
    latents: Tensor,
    plan: VideoDecodePlan,
    *,
    layout: str = "ncdhw",
    triton_norm: bool = False,
    frozen: Mapping[str, _Moments] | None = None,
    max_chunk_frames: int | None = None,
    raw: bool = False,
    should_stop: StopCheck | None = None,
    on_frames: Callable[[int, int, Tensor], None] | None = None,
) -> tuple[Tensor, dict[str, _Moments]]:
    """`decode_video_fast` with an explicit plan; also returns the GroupNorm statistics of the last sample.
    For checks and measurements of the decode itself: `frozen` replaces running statistics with given ones (the
    whole-clip ones make any plan exact); `max_chunk_frames` caps the frames of every chunk; `raw` returns the
    decoder's output as is (in [-1, 1] but neither shifted nor clamped). `should_stop`, `on_frames`: see
    `decode_video_fast`."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, found {layout!r}")
    if latents.ndim != 5 or latents.shape[-1] != vae.config.latent_channels:
        raise ValueError(f"expected latents [B, T, H, W, {vae.config.latent_channels}], found {tuple(latents.shape)}")
    b, t, h, w, _ = latents.shape
    if (t, h, w) != plan.latent_shape:
        raise ValueError(f"expected latents of (T, H, W) {plan.latent_shape} as planned, found {(t, h, w)}")
    if on_frames is not None and b != 1:
        raise ValueError(f"on_frames hands over the frames of one clip: expected a batch of 1, found {b}")
    device, dtype = vae.device, vae.dtype
    z = latents.to(device).permute(0, 4, 1, 2, 3).to(dtype) / vae.config.scaling_factor  # [B, C, T, H, W]
    from ..kernels.groupnorm_silu import groupnorm_silu, groupnorm_silu_ref

    norm_act = groupnorm_silu if triton_norm else groupnorm_silu_ref
    channel_moments = _fused_channel_moments if triton_norm else _channel_moments
    fmt = _MEMORY_FORMATS[layout]
    ctx = _Ctx(
        dtype, device, fmt, plan.workspace_bytes, norm_act, channel_moments,
        max_chunk_frames=max_chunk_frames, should_stop=should_stop,
    )  # fmt: skip
    frames = 1 + vae.config.temporal_compression_ratio * (t - 1)
    s = vae.config.spatial_compression_ratio
    out = torch.zeros((b, frames, h * s, w * s, 3), dtype=torch.float32, device=device)
    moments: dict[str, _Moments] = {}
    for i in range(b):
        zi = vae.post_quant_conv(z[i : i + 1]).contiguous(memory_format=ctx.memory_format)
        finished = _Finisher(out[i], frames, raw, on_frames)
        moments = _decode_sample(vae, zi, plan, ctx, out[i], frozen, finished)
        finished.check_done()
    return out, moments


class _Finisher:
    """Takes frames of one sample's output out[F, H, W, 3] as the decode finishes them: maps the decoder's [-1, 1]
    to [0, 1] (unless raw) on those frames only, elementwise and so exactly as over the whole clip at once, and hands
    them to on_frames(f0, f1, frames)."""

    def __init__(self, out: Tensor, frames: int, raw: bool, on_frames: Callable[[int, int, Tensor], None] | None):
        self.out, self.frames, self.raw, self.on_frames = out, frames, raw, on_frames
        self.done = 0

    def __call__(self, f0: int, f1: int) -> None:
        if f0 != self.done or not f0 < f1 <= self.frames:
            raise RuntimeError(f"video decode: frames finished out of order: [{f0}, {f1}) after {self.done}")
        self.done = f1
        region = self.out[f0:f1]
        if not self.raw:
            region.mul_(0.5).add_(0.5).clamp_(0, 1)
        if self.on_frames is not None:
            self.on_frames(f0, f1, region)

    def check_done(self) -> None:
        if self.done != self.frames:
            raise RuntimeError(f"video decode: expected {self.frames} frames finished, found {self.done}")


def decode_video_fast(
    vae: nn.Module,
    latents: Tensor,
    *,
    budget_bytes: int | None = None,
    chunk_latent_frames: int | None = None,
    layout: str = "ncdhw",
    triton_norm: bool = False,
    upsample_fusion: str = "auto",
    plan: VideoDecodePlan | None = None,
    should_stop: StopCheck | None = None,
    on_frames: Callable[[int, int, Tensor], None] | None = None,
) -> Tensor:
    """latents [B, T, H, W, C] (scaled) → frames fp32 [B, F, 8H, 8W, 3] in [0, 1], F = 4(T-1)+1: the output of
    `k6fast.vae.decode_video`, without diffusers' overlapping tiles.

    `budget_bytes`: what the decode may allocate on the VAE's device beyond what is allocated when it starts
    (activations, temporaries, carried frames, the fp32 output). When the whole decode fits, the result is diffusers'
    untiled decode up to float rounding (`plan_video_decode(...).exact`), plain or lean (`upsample_fusion`, see
    `plan_video_decode`); otherwise the up blocks stream and their GroupNorms use running statistics.
    `chunk_latent_frames` forces streaming in slabs of that many latent frames. `plan`: a plan made beforehand
    (instead of `budget_bytes`), so that the caller decodes with the plan it decided on.
    `layout` "ndhwc" keeps activations channels-last (cuDNN's native 3D layout); `triton_norm` runs GroupNorm+SiLU
    as one Triton kernel (k6fast/kernels/groupnorm_silu.py) instead of PyTorch's three passes through fp32, and the
    GroupNorms' statistics as another (k6fast/kernels/groupnorm_stats.py) instead of fp32 copies and Welford reductions.
    cuDNN picks its convolution algorithms as the process has it set (`torch.backends.cudnn.benchmark`, which the
    decode never changes; k6fast leaves it off, see `k6fast.entry.prepare_pipeline_process`). Samples of a batch are
    decoded one after another. `should_stop` (k6fast.cancel) is checked before every op of every slab and tile: when
    it says stop, `Cancelled` is raised and the decode's buffers are dropped with it.
    `on_frames(f0, f1, frames)` (a batch of 1 only) is handed frames [f0, f1) of the output as soon as they are final
    (frames: fp32 [f1 - f0, 8H, 8W, 3] in [0, 1], a view of the returned tensor on the VAE's device): in order, each
    frame once, chunk by chunk of the last op. So a whole-clip decode hands them over during its last op only (every
    GroupNorm before it needs the whole clip's statistics), a streamed one slab by slab of its last tile.
    """
    if latents.ndim != 5:
        raise ValueError(f"expected latents [B, T, H, W, C], found {tuple(latents.shape)}")
    if (plan is None) == (budget_bytes is None):
        raise ValueError("expected either budget_bytes (to plan the decode) or a plan from plan_video_decode")
    if plan is None:
        plan = plan_video_decode(
            vae,
            tuple(latents.shape[1:4]),
            budget_bytes=budget_bytes,
            chunk_latent_frames=chunk_latent_frames,
            upsample_fusion=upsample_fusion,
        )
    elif plan.latent_shape != tuple(latents.shape[1:4]):
        raise ValueError(f"the plan is for latents {plan.latent_shape}, found {tuple(latents.shape[1:4])}")
    logger.info("video decode: %s", plan.describe())
    frames, _ = decode_with_plan(
        vae,
        latents,
        plan,
        layout=layout,
        triton_norm=triton_norm,
        should_stop=should_stop,
        on_frames=on_frames,
    )
    return frames
