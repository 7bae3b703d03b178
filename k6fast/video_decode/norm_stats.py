"""GroupNorm statistics over the whole clip or running over a stream's slabs: per-channel moments reduced in fp32
over blocks (PyTorch's, or kernels.groupnorm_stats's on a GPU), merged per group in fp64, turned into a per-channel
scale and shift; and `_Stream`, what one stream carries from one slab to the next."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..kernels.fallback import cuda_at_least, device_label, log_reference_once

logger = logging.getLogger(__name__)

# A block's per-channel moments: (positions per channel, mean [..., B, C], variance [..., B, C]); the leading dim,
# where there is one, stacks blocks of that count.
_Part = tuple[float, Tensor, Tensor]

# Bound on the fp32 copies taken for a GroupNorm's statistics (blocks of frames, or of rows of one frame), and on
# the reference norm's fp32 temporary (kernels.groupnorm_silu): small next to a full-resolution frame (425 MB at
# 256 channels), still large enough to keep the GPU busy.
_NORM_BLOCK_BYTES = 64 << 20


@dataclass
class _Moments:
    """Per (sample, group) count, mean and sum of squared deviations, float64 (Chan et al. merge)."""

    n: float
    mean: Tensor  # [B, G] float64
    m2: Tensor  # [B, G] float64

    def merged(self, other: _Moments) -> _Moments:
        n = self.n + other.n
        delta = other.mean - self.mean
        mean = self.mean + delta * (other.n / n)
        m2 = self.m2 + other.m2 + delta.square() * (self.n * other.n / n)
        return _Moments(n, mean, m2)


def _channel_moments(x: Tensor, block_bytes: int) -> Iterator[_Part]:
    """x [B, C, T, H, W] → per block of frames (or of rows of one frame) whose fp32 copy fits `block_bytes`: (count
    per channel, mean [B, C], variance [B, C]), reduced in fp32 over positions only (a reduction that runs well in
    either layout)."""
    b, c, t, h, w = x.shape
    row_bytes = b * c * w * 4
    rows = max(1, min(h, block_bytes // row_bytes))
    frames = max(1, block_bytes // (row_bytes * h)) if rows == h else 1
    for t0 in range(0, t, frames):
        for h0 in range(0, h, rows):
            block = x[:, :, t0 : t0 + frames, h0 : h0 + rows].float()
            var, mean = torch.var_mean(block, dim=(2, 3, 4), correction=0)
            yield float(block[0, 0].numel()), mean, var


def _fused_channel_moments(x: Tensor, block_bytes: int) -> Iterator[_Part]:
    """`_channel_moments` by kernels.groupnorm_stats where it runs (a CUDA tensor, sm_80+, whose T, H, W flatten):
    x read once in its own dtype instead of through fp32 copies; the same moments summed in another order. Elsewhere
    `_channel_moments` itself, logged once."""
    from ..kernels.groupnorm_stats import channel_moments_triton, positions_stride

    if not cuda_at_least(x.device, (8, 0)) or positions_stride(x) is None:
        why = "positions that do not flatten" if cuda_at_least(x.device, (8, 0)) else "needs CUDA sm_80 or newer"
        log_reference_once(logger, "groupnorm statistics", device_label(x.device), why, level=logging.INFO)
        yield from _channel_moments(x, block_bytes)
        return
    span, mean, m2 = channel_moments_triton(x)
    full = mean.shape[0] - 1  # tiles of `span` positions; the last one holds the rest
    if full:
        yield float(span), mean[:full], m2[:full].double() / span
    last = x.shape[2] * x.shape[3] * x.shape[4] - full * span
    yield float(last), mean[full:], m2[full:].double() / last


def _group_moments(parts: Iterable[_Part], groups: int) -> _Moments:
    """Per-channel moments of blocks → moments per (sample, group), merged in fp64: the group mean first, then the
    squared deviations about it. Blocks of one count are stacked together, so the merge costs a few kernels, not a
    few per block, and no host-device copy."""
    by_count: dict[float, tuple[list[Tensor], list[Tensor]]] = {}
    for n, mean, var in parts:
        means, variances = by_count.setdefault(n, ([], []))
        means.append(mean.double().reshape(-1, *mean.shape[-2:]))
        variances.append(var.double().reshape(-1, *var.shape[-2:]))
    stacks = []
    for n, (means, variances) in by_count.items():
        b, c = means[0].shape[-2:]
        shape = (-1, b, groups, c // groups)
        stacks.append((n, torch.cat(means).view(shape), torch.cat(variances).view(shape)))
    total = sum(n * m.shape[0] * m.shape[3] for n, m, _ in stacks)
    mean = sum(m.sum(dim=(0, 3)) * (n / total) for n, m, _ in stacks)  # [B, G]
    m2 = sum((v + (m - mean[None, :, :, None]).square()).sum(dim=(0, 3)) * n for n, m, v in stacks)
    return _Moments(total, mean, m2)


def _moments(
    x: Tensor, groups: int, channel_moments: Callable[[Tensor, int], Iterable[_Part]] = _channel_moments
) -> _Moments:
    """x [B, C, T, H, W] → moments per (sample, group), its blocks' moments by `channel_moments`."""
    return _group_moments(channel_moments(x, _NORM_BLOCK_BYTES), groups)


@dataclass
class _Stream:
    """What one stream (the whole clip, or one spatial tile) carries from one slab to the next."""

    frozen: Mapping[str, _Moments] | None = None
    whole_clip: bool = False  # one slab holds the whole clip: no frames to carry to a next slab
    first: bool = True  # the next slab starts at the clip's first frame
    frames_out: int = 0
    carry: dict[str, Tensor] = field(default_factory=dict)
    moments: dict[str, _Moments] = field(default_factory=dict)


def _norm_coeffs(
    stream: _Stream, key: str, norm: nn.GroupNorm, moments: Callable[[int], _Moments]
) -> tuple[Tensor, Tensor]:
    """→ (scale, shift) contiguous fp32 [B, C] with GroupNorm(x) = x * scale + shift, from the stream's running
    statistics (x's, `moments(groups)`, merged into them) or its frozen ones (then `moments` is not called)."""
    if not isinstance(norm, nn.GroupNorm) or not norm.affine:
        raise ValueError(f"{key}: expected an affine nn.GroupNorm, found {norm!r}")
    if stream.frozen is not None:
        m = stream.frozen[key]
    else:
        m = moments(norm.num_groups)
        if key in stream.moments:
            m = stream.moments[key].merged(m)
        stream.moments[key] = m
    rstd = (m.m2 / m.n + norm.eps).rsqrt()  # [B, G]
    per_group = norm.num_channels // norm.num_groups
    rstd_c = rstd.repeat_interleave(per_group, dim=1)
    mean_c = m.mean.repeat_interleave(per_group, dim=1)
    scale = norm.weight.double() * rstd_c
    shift = norm.bias.double() - mean_c * scale
    return scale.float().contiguous(), shift.float().contiguous()
