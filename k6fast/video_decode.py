"""Video VAE decode (diffusers' HunyuanVideo VAE) without the redundant work of diffusers' tiled decode.

What in the decoder is local in time, and what is not (diffusers 0.42.1, `autoencoder_kl_hunyuan_video.py`):
- Every convolution is causal: replicate-padded by kt-1 frames in front, so output frame t reads input frames
  t-2..t. Carrying the last kt-1 input frames of each convolution from one chunk of frames to the next reproduces
  the whole-clip convolution exactly.
- The upsamplers repeat frames (nearest); the clip's first frame is upsampled in space only. Exact per chunk once a
  chunk knows whether it holds the clip's first frame.
- The mid-block attention is causal by frame (a token attends to its own frame and earlier frames) but global in
  space; it runs at latent resolution, so it is computed over the whole clip, query frame by query frame.
- Every GroupNorm (30 in the default decoder, the attention's included) normalises over the WHOLE clip: all frames,
  all positions. So no chunked or tiled decode equals the untiled one unless every GroupNorm sees whole-clip
  statistics; decoding the first 3 latent frames alone gives other pixels than the first 9 frames of the whole
  decode. diffusers' tiled decode gives each tile its own statistics (17 frames x 256x256 px), and so does its
  framewise decode, which is on even with tiling off (`use_framewise_decoding`): `vae.disable_tiling()` alone is
  not an untiled decode.

The decode here runs the decoder's modules (diffusers' weights, no copies) as a list of ops in two segments:
- ops[:split] over the whole clip at once, layer by layer: exact (whole-clip statistics). Each GroupNorm's
  statistics are reduced first (fp32 per channel over blocks of frames or rows, merged in fp64), then the
  normalisation + SiLU is applied chunk of frames by chunk straight into the next convolution's padded input; a
  resnet writes conv2 + shortcut over conv1's output as conv2 consumes it. So an op holds its input and its output
  (a resnet: its input and conv1's output) plus chunk temporaries. The mid-block attention (and all before it) is
  always in this segment.
- ops[split:] streamed: in slabs of `slab_latent_frames` latent frames that carry each convolution's last input
  frames, layer by layer within a slab over the full frame, or over budget-sized spatial tiles (each an independent
  stream; blended across the middle of their overlap, outside the convolutions' reach of the tile edge).
  Within a stream a GroupNorm uses running statistics: those of all frames decoded so far, this slab's included.
When the streamed segment is a single slab and a single tile (the budget holds the whole decode), the result equals
diffusers' untiled decode up to float rounding; otherwise only the GroupNorm statistics differ from it.

The lean whole-clip decode (`UpsampleFusion`): the largest tensor of a whole-clip decode is an upsampler's output U
at full resolution (256 channels x 121 x 480 x 864 at W1, 25.7 GB in bf16), which only the next resnet reads (its
norm1 + conv1 and its 256 → 128 shortcut). Fused, that pair never stores U: pass 1 computes U chunk by chunk for
norm1's whole-clip statistics and drops it; pass 2 computes it again and feeds silu(norm1(U)) to conv1 and U to the
shortcut, chunk by chunk (the upsampler's causal conv re-upsamples its kt-1 frames of history from its input
instead of carrying them). The shortcut's output is stored ("stored"), or recomputed from U a third time next to
conv2 ("recomputed": one more upsampler conv, one fewer full-size tensor). Same arithmetic, so still exact.
`plan_video_decode` picks the plain whole-clip decode if it fits the budget, else fuses the pair at the peak
(stored, then recomputed) until it fits; else the latest split, then the largest slab, then the fewest tiles.
At W1 in bf16 the plain whole-clip decode is planned at 41.3 GiB (36.9 GiB of activations); the lean one fits a
32 GiB budget with the shortcut stored (31.4 GiB planned, 28.3 GiB of activations) and a 28 GiB one with it
recomputed (27.7 GiB planned). Planned peaks include the fp32 output and 8% of the budget for cuDNN and rounding.

Check: `pytest tests/test_video_decode.py`. Benchmark: `python measurements/bench_vae_decode.py --out vae.json`.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

logger = logging.getLogger(__name__)

LAYOUTS = ("ncdhw", "ndhwc")
_MEMORY_FORMATS = {"ncdhw": torch.contiguous_format, "ndhwc": torch.channels_last_3d}
# Room left in the budget for cuDNN's workspace and the caching allocator's rounding.
_RESERVE_FRACTION = 0.08
_RESERVE_MIN_BYTES = 256 << 20
# The reach of a tile edge's replicate padding counted over every convolution left (114 output pixels from the mid
# block on) is a worst-case bound; its effect fades within a few pixels per level. Past this cap the blend ramp, not
# exclusion, absorbs what remains: tiles stream with their own statistics, already not exact.
_HALO_CAP_PX = 32
_MIN_RAMP_PX = 16
# Bound on the fp32 copies taken for a GroupNorm's statistics (blocks of frames, or of rows of one frame), and on
# the reference norm's fp32 temporary (kernels.groupnorm_silu): small next to a full-resolution frame (425 MB at
# 256 channels), still large enough to keep the GPU busy.
_NORM_BLOCK_BYTES = 64 << 20
UPSAMPLE_FUSION = ("auto", "off", "stored", "recomputed")


# ---------------------------------------------------------------------------------------------------------------
# The decoder as a list of ops
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Conv:
    """One causal convolution of an op: what its carried frames and its reach across a tile edge cost."""

    c_in: int
    kt: int
    kh: int
    scale: int  # spatial size of the conv's input relative to the op's input (2 after an upsample)


@dataclass(frozen=True)
class _Op:
    kind: str  # "conv_in" | "resnet" | "attention" | "upsample" | "out"
    name: str
    module: nn.Module
    c_in: int
    c_out: int
    t_up: int = 1
    s_up: int = 1
    convs: tuple[_Conv, ...] = ()


def _check_causal_conv(conv: nn.Module, where: str) -> tuple[int, int, int]:
    """A HunyuanVideoCausalConv3d as diffusers builds it → its kernel (kt, kh, kw); anything else raises."""
    inner = getattr(conv, "conv", None)
    if not isinstance(inner, nn.Conv3d):
        raise ValueError(f"{where}: expected a HunyuanVideoCausalConv3d wrapping nn.Conv3d, found {type(conv)}")
    kt, kh, kw = inner.kernel_size
    expected = (kw // 2, kw // 2, kh // 2, kh // 2, kt - 1, 0)
    found = (
        tuple(inner.stride),
        tuple(inner.padding),
        tuple(inner.dilation),
        inner.groups,
        conv.pad_mode,
        tuple(conv.time_causal_padding),
    )
    if found != ((1, 1, 1), (0, 0, 0), (1, 1, 1), 1, "replicate", expected) or kh % 2 == 0 or kw % 2 == 0:
        raise ValueError(
            f"{where}: expected stride 1, no padding, dilation 1, groups 1, replicate causal padding {expected} and "
            f"odd spatial kernels; found stride/padding/dilation/groups/pad_mode/padding {found}, kernel {(kt, kh, kw)}"
        )
    return kt, kh, kw


def _conv_meta(conv: nn.Module, where: str, scale: int = 1) -> _Conv:
    kt, kh, _ = _check_causal_conv(conv, where)
    return _Conv(c_in=conv.conv.in_channels, kt=kt, kh=kh, scale=scale)


def _check_silu(module: nn.Module, where: str) -> None:
    if not isinstance(module, nn.SiLU):
        raise ValueError(f"{where}: expected SiLU (act_fn 'silu'/'swish'), found {type(module).__name__}")


def _resnet_op(resnet: nn.Module, name: str) -> _Op:
    _check_silu(resnet.nonlinearity, name)
    convs = [_conv_meta(resnet.conv1, f"{name}.conv1"), _conv_meta(resnet.conv2, f"{name}.conv2")]
    if resnet.conv_shortcut is not None:
        kt, kh, kw = _check_causal_conv(resnet.conv_shortcut, f"{name}.conv_shortcut")
        if (kt, kh, kw) != (1, 1, 1):
            raise ValueError(f"{name}.conv_shortcut: expected a 1x1x1 convolution, found {(kt, kh, kw)}")
    return _Op(
        "resnet",
        name,
        resnet,
        resnet.conv1.conv.in_channels,
        resnet.conv2.conv.out_channels,
        convs=tuple(convs),
    )


def _attention_op(attn: nn.Module, name: str) -> _Op:
    problems = []
    if attn.group_norm is None:
        problems.append("a group_norm")
    if attn.spatial_norm is not None or attn.norm_q is not None or attn.norm_k is not None:
        problems.append("no spatial_norm / norm_q / norm_k")
    if not attn.residual_connection:
        problems.append("a residual connection")
    if attn.is_cross_attention:
        problems.append("self-attention")
    if problems:
        raise ValueError(f"{name}: expected the VAE mid-block attention with {', '.join(problems)}")
    c = attn.group_norm.num_channels
    return _Op("attention", name, attn, c, c)


def _upsample_op(up: nn.Module, name: str) -> _Op:
    factors = tuple(float(f) for f in up.upsample_factor)
    if len(factors) != 3 or any(f not in (1.0, 2.0) for f in factors) or factors[1] != factors[2]:
        raise ValueError(f"{name}: expected upsample factors (1|2, s, s) with s in (1, 2), found {up.upsample_factor}")
    s_up = int(factors[1])
    conv = _conv_meta(up.conv, f"{name}.conv", scale=s_up)
    return _Op("upsample", name, up, conv.c_in, up.conv.conv.out_channels, int(factors[0]), s_up, (conv,))


def decoder_ops(vae: nn.Module) -> list[_Op]:
    """diffusers' `AutoencoderKLHunyuanVideo.decoder` as ops: conv_in, mid block, up blocks, out (norm+SiLU+conv)."""
    dec = getattr(vae, "decoder", None)
    if dec is None or type(dec).__name__ != "HunyuanVideoDecoder3D":
        raise ValueError(f"expected an AutoencoderKLHunyuanVideo, found decoder {type(dec).__name__}")
    if dec.training:
        raise ValueError("expected the VAE in eval mode (dropout off), found training mode")
    conv_in = _conv_meta(dec.conv_in, "decoder.conv_in")
    ops = [_Op("conv_in", "conv_in", dec.conv_in, conv_in.c_in, dec.conv_in.conv.out_channels, convs=(conv_in,))]
    mid = dec.mid_block
    ops.append(_resnet_op(mid.resnets[0], "mid.resnets.0"))
    for i, (attn, resnet) in enumerate(zip(mid.attentions, mid.resnets[1:], strict=True)):
        if attn is not None:
            ops.append(_attention_op(attn, f"mid.attentions.{i}"))
        ops.append(_resnet_op(resnet, f"mid.resnets.{i + 1}"))
    for b, block in enumerate(dec.up_blocks):
        for r, resnet in enumerate(block.resnets):
            ops.append(_resnet_op(resnet, f"up.{b}.resnets.{r}"))
        for u, up in enumerate(block.upsamplers or ()):
            ops.append(_upsample_op(up, f"up.{b}.upsamplers.{u}"))
    _check_silu(dec.conv_act, "decoder.conv_act")
    conv_out = _conv_meta(dec.conv_out, "decoder.conv_out")
    ops.append(
        _Op("out", "out", dec, dec.conv_norm_out.num_channels, dec.conv_out.conv.out_channels, convs=(conv_out,))
    )
    return ops


def _first_streamable(ops: list[_Op]) -> int:
    """Ops before this index must see the whole clip: the attention is global in space, so it never streams."""
    last_attn = max((i for i, op in enumerate(ops) if op.kind == "attention"), default=-1)
    return last_attn + 1


@dataclass(frozen=True)
class _Geom:
    """An op's input over the whole clip: channels, frames, height, width; and frame/space ratio to the latent."""

    c: int
    t: int
    h: int
    w: int
    t_ratio: int
    s_ratio: int


def _geometry(ops: list[_Op], t: int, h: int, w: int) -> list[_Geom]:
    """Input geometry of every op, plus the decoder's output as the last entry."""
    out, t_ratio, s_ratio = [], 1, 1
    for op in ops:
        out.append(_Geom(op.c_in, t, h, w, t_ratio, s_ratio))
        if op.kind == "upsample":
            t, h, w = 1 + op.t_up * (t - 1), h * op.s_up, w * op.s_up
            t_ratio, s_ratio = t_ratio * op.t_up, s_ratio * op.s_up
    out.append(_Geom(ops[-1].c_out, t, h, w, t_ratio, s_ratio))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Plan: split, slab and tiles from the byte budget
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UpsampleFusion:
    """An upsampler run together with the resnet after it, in the whole-clip segment: the upsampler's output is
    computed chunk by chunk twice (norm1's statistics, then conv1 and the shortcut) and never stored whole. The
    shortcut's output is stored until conv2 is added to it, or (`recompute_shortcut`) computed a third time."""

    upsampler: str
    resnet: str
    recompute_shortcut: bool

    def describe(self) -> str:
        shortcut = "recomputed" if self.recompute_shortcut else "stored"
        return f"{self.upsampler} + {self.resnet} fused (shortcut {shortcut})"


@dataclass(frozen=True)
class VideoDecodePlan:
    """How one latent clip [T, H, W] is decoded. `tiles` are (row0, row1, col0, col1) at the streamed segment's
    input resolution (`segment_scale` x the latent's); `halo` is how far, in output pixels, a tile edge reaches in.
    `fusions`: upsamplers fused with the resnet after them in the whole-clip segment (the lean whole-clip decode)."""

    latent_shape: tuple[int, int, int]
    split: int
    num_ops: int
    slab_latent_frames: int
    tiles: tuple[tuple[int, int, int, int], ...]
    segment_scale: int
    halo: int
    workspace_bytes: int
    estimated_peak_bytes: int
    fusions: tuple[UpsampleFusion, ...] = ()

    @property
    def exact(self) -> bool:
        """True when every GroupNorm sees whole-clip statistics: the untiled decode up to float rounding."""
        whole_slab = self.slab_latent_frames >= self.latent_shape[0]
        return self.split == self.num_ops or (whole_slab and len(self.tiles) == 1)

    @property
    def mode(self) -> str:
        """How the clip is decoded: "whole-clip" (every op over the whole clip), "whole-clip lean" (the same with
        fused upsamplers) or "streamed"."""
        if self.split < self.num_ops:
            return "streamed"
        return "whole-clip lean" if self.fusions else "whole-clip"

    def describe(self) -> str:
        peak = f"estimated peak {self.estimated_peak_bytes / 2**30:.2f} GiB"
        if self.split == self.num_ops:
            fused = f": {'; '.join(f.describe() for f in self.fusions)}" if self.fusions else ""
            return f"{self.mode} decode of all {self.num_ops} ops (exact){fused}; {peak}"
        streamed = self.num_ops - self.split
        kind = "exact" if self.exact else "running GroupNorm statistics"
        return (
            f"streamed: {self.split} ops whole-clip, {streamed} streamed in slabs of {self.slab_latent_frames} latent "
            f"frames over {len(self.tiles)} tile(s) ({kind}); {peak}"
        )


def _slab_frames(g: _Geom, latent_frames: int, slab: int) -> int:
    """Most frames a slab of `slab` latent frames spans at an op with geometry g."""
    return g.t if slab >= latent_frames else g.t_ratio * slab


def _conv_chunk_bytes(c_in: int, c_out: int, h: int, w: int, kh: int, elt: int, frames: int) -> int:
    """Temporaries of one conv chunk: the padded input, the output and the residual, and the reference norm's fp32
    frame."""
    hw, padded = h * w, (h + kh - 1) * (w + kh - 1)
    return frames * (c_in * padded * elt + 2 * c_out * hw * elt) + c_in * hw * 4


def _op_bytes(op: _Op, frames: int, h: int, w: int, elt: int, workspace: int) -> int:
    """Peak bytes while `op` runs over `frames` frames of an h x w window: its input, its output, temporaries."""
    x = op.c_in * frames * h * w * elt
    if op.kind == "attention":
        # Normalised tokens, q, k, v, the attention output and the projected output, next to the input.
        return 7 * x + workspace
    if op.kind == "upsample":
        frames_out, h, w = op.t_up * frames, h * op.s_up, w * op.s_up
    else:
        frames_out = frames
    y = op.c_out * frames_out * h * w * elt if op.kind != "out" else 0
    one_frame = max(_conv_chunk_bytes(c.c_in, op.c_out, h, w, c.kh, elt, 1) for c in op.convs)
    return x + y + max(workspace, one_frame)


def _carry_bytes(ops: list[_Op], geoms: list[_Geom], h: int, w: int, elt: int) -> int:
    """Frames carried by every causal conv of a stream over an h x w window of the first op's input."""
    total = 0
    base = geoms[0].s_ratio
    for op, g in zip(ops, geoms, strict=False):
        f = g.s_ratio // base
        for conv in op.convs:
            hh, ww = h * f * conv.scale + conv.kh - 1, w * f * conv.scale + conv.kh - 1
            total += (conv.kt - 1) * conv.c_in * hh * ww * elt
    return total


def _halo(ops: list[_Op], geoms: list[_Geom]) -> int:
    """How far, in output pixels, replicate padding at a tile's edge reaches into the tile."""
    final = geoms[-1].s_ratio
    reach = 0.0
    for op, g in zip(ops, geoms, strict=False):
        for conv in op.convs:
            reach += (conv.kh // 2) * final / (g.s_ratio * conv.scale)
    return math.ceil(reach)


def _tiles(size: int, count: int, overlap: int) -> list[tuple[int, int]]:
    """`count` windows of equal length covering [0, size) with at least `overlap` shared between neighbours."""
    if count == 1:
        return [(0, size)]
    length = min(size, math.ceil((size + (count - 1) * overlap) / count))
    starts = [round(i * (size - length) / (count - 1)) for i in range(count)]
    return [(s, s + length) for s in starts]


def _segment_peak(
    ops: list[_Op], geoms: list[_Geom], latent_frames: int, slab: int, th: int, tw: int, elt: int, workspace: int
) -> int:
    """Peak bytes of streaming ops over th x tw tiles (at geoms[0]'s resolution) in slabs of `slab` latent frames."""
    base = geoms[0].s_ratio
    peak = 0
    for op, g in zip(ops, geoms, strict=False):
        f = g.s_ratio // base
        peak = max(peak, _op_bytes(op, _slab_frames(g, latent_frames, slab), th * f, tw * f, elt, workspace))
    if slab < latent_frames:
        peak += _carry_bytes(ops, geoms, th, tw, elt)
    return peak


def _fusable(ops: list[_Op], i: int) -> bool:
    """An upsampler with a resnet right after it: a pair the lean whole-clip decode may fuse."""
    return ops[i].kind == "upsample" and i + 1 < len(ops) and ops[i + 1].kind == "resnet"


def _fusion_bytes(
    up: _Op, res: _Op, t: int, h: int, w: int, elt: int, workspace: int, recompute_shortcut: bool
) -> tuple[int, int]:
    """(peak bytes, chunk bytes per frame) of `up` fused with `res` (`_upsample_resnet`) over an input of t frames
    of h x w. A chunk of frames flows through two convolutions at once (the upsampler's, then conv1 or conv2), so
    the workspace bounds both together: frames per chunk = workspace // chunk bytes per frame, at least one."""
    (up_conv,) = up.convs
    conv1, conv2 = res.convs
    t_out, hh, ww = 1 + up.t_up * (t - 1), h * up.s_up, w * up.s_up
    c_x, c_u, c_r = up.c_in, up.c_out, res.c_out

    def padded(conv: _Conv, c: int) -> int:
        return c * (hh + conv.kh - 1) * (ww + conv.kh - 1) * elt

    def frame(c: int) -> int:
        return c * hh * ww * elt

    history = (up_conv.kt - 1) * padded(up_conv, c_x)  # the upsampler conv's history frames, upsampled again
    carry1, carry2 = (conv1.kt - 1) * padded(conv1, c_u), (conv2.kt - 1) * padded(conv2, c_r)
    residual = frame(c_r) if res.module.conv_shortcut is not None else 0  # the shortcut's output (identity: U)
    # Each phase of a chunk's work: (bytes whatever the chunk's length, bytes per frame of the chunk). A conv step
    # holds its padded input (carried frames included) and the carry cloned for the next chunk (the old one is
    # dropped first), its output, and the reference norm's fp32 block.
    upsample = (history, padded(up_conv, c_x) + c_x * h * w * elt + frame(c_u))  # padded input, source frames, U
    step1 = (2 * carry1 + _NORM_BLOCK_BYTES, frame(c_u) + padded(conv1, c_u) + frame(c_r))
    step2 = (2 * carry2 + _NORM_BLOCK_BYTES, padded(conv2, c_r) + frame(c_r))
    pass1 = [upsample, (_NORM_BLOCK_BYTES, frame(c_u))]  # U, then its statistics through an fp32 block
    pass2 = [(carry1 + upsample[0], upsample[1]), step1, (carry1, frame(c_u) + residual)]
    if recompute_shortcut:  # U a third time, its shortcut next to conv2's output
        rest = [(carry2 + upsample[0], upsample[1]), (carry2, frame(c_u) + residual)]
        rest.append((step2[0], step2[1] + (residual or frame(c_u))))
    else:  # the stored shortcut is read in place
        rest = [step2]
    rest.append((_NORM_BLOCK_BYTES, 0))  # norm2's statistics
    chunk_frame_bytes = upsample[1] + max(step1[1], step2[1])
    frames = max(1, workspace // chunk_frame_bytes)

    def phase_peak(phases: list[tuple[int, int]]) -> int:
        return max(fixed + frames * per_frame for fixed, per_frame in phases)

    x = c_x * t * h * w * elt
    stored = (1 if recompute_shortcut else 2) * c_r * t_out * hh * ww * elt  # conv1's output (+ the shortcut's)
    peak = x + max(phase_peak(pass1), stored + phase_peak(pass2 + rest))
    return peak, chunk_frame_bytes


def _whole_clip_peak(
    ops: list[_Op], geoms: list[_Geom], fusions: Mapping[int, bool], elt: int, workspace: int
) -> tuple[int, int]:
    """(peak bytes, index of the op at the peak) of decoding all ops over the whole clip, with the upsamplers at the
    keys of `fusions` fused with the resnet after them (value: recompute the shortcut)."""
    peak, at, i = -1, 0, 0
    while i < len(ops):
        g = geoms[i]
        if i in fusions:
            size, _ = _fusion_bytes(ops[i], ops[i + 1], g.t, g.h, g.w, elt, workspace, fusions[i])
            span = 2
        else:
            size, span = _op_bytes(ops[i], g.t, g.h, g.w, elt, workspace), 1
        if size > peak:
            peak, at = size, i
        i += span
    return peak, at


def _lean_fusions(
    ops: list[_Op], geoms: list[_Geom], usable: int, elt: int, workspace: int, policy: str
) -> tuple[dict[int, bool], int] | None:
    """The fusions (upsampler index → recompute the shortcut) under which the whole-clip decode fits `usable`
    bytes, and its peak; None if none does. "auto": the plain decode if it fits, else fuse the pair at the peak
    with its shortcut stored, then recomputed, until it fits. "off": never fuse. "stored" / "recomputed": every
    upsampler followed by a resnet, with that shortcut."""
    pairs = [i for i in range(len(ops)) if _fusable(ops, i)]
    if policy in ("stored", "recomputed"):
        every = {i: policy == "recomputed" for i in pairs}
        peak, _ = _whole_clip_peak(ops, geoms, every, elt, workspace)
        return (every, peak) if peak <= usable else None
    fusions: dict[int, bool] = {}
    while True:
        peak, at = _whole_clip_peak(ops, geoms, fusions, elt, workspace)
        if peak <= usable:
            return fusions, peak
        up = at if at in pairs else at - 1  # the peak at a resnet right after an upsampler: fuse that pair
        if policy == "off" or up not in pairs or fusions.get(up, False):
            return None
        fusions[up] = up in fusions  # first with the shortcut stored, then recomputed


def plan_video_decode(
    vae: nn.Module,
    latent_shape: tuple[int, int, int],
    *,
    budget_bytes: int,
    chunk_latent_frames: int | None = None,
    dtype: torch.dtype | None = None,
    upsample_fusion: str = "auto",
) -> VideoDecodePlan:
    """Plan the decode of one latent clip of shape (T, H, W) within `budget_bytes` (what the decode may allocate:
    activations, temporaries, carried frames and the fp32 output), activations in `dtype` (default the VAE's).

    Without `chunk_latent_frames`: the whole decode at once when it fits (exact): plain, else lean (upsamplers
    fused with the resnet after them, `upsample_fusion` "auto"); else the latest split, then the largest slab, that
    fit without tiles; else the fewest tiles. With it: everything after the mid-block attention streams in slabs of
    that many latent frames (the least memory for that slab). `upsample_fusion` "off" never fuses; "stored" or
    "recomputed" fuse every upsampler that a resnet follows, with that shortcut (to measure or test the lean path).
    """
    return _plan(
        vae,
        latent_shape,
        budget_bytes,
        chunk_latent_frames=chunk_latent_frames,
        dtype=dtype,
        upsample_fusion=upsample_fusion,
    )


def _plan(
    vae: nn.Module,
    latent_shape: tuple[int, int, int],
    budget_bytes: int,
    *,
    chunk_latent_frames: int | None = None,
    dtype: torch.dtype | None = None,
    split: int | None = None,
    min_grid: int = 1,
    upsample_fusion: str = "auto",
) -> VideoDecodePlan:
    """`plan_video_decode`, and for tests: `split` fixes where streaming starts, `min_grid` forces at least that
    many tiles per side."""
    t, h, w = latent_shape
    if min(t, h, w) < 1:
        raise ValueError(f"expected a latent clip (T, H, W) with positive sizes, found {latent_shape}")
    if upsample_fusion not in UPSAMPLE_FUSION:
        raise ValueError(f"upsample_fusion must be one of {', '.join(UPSAMPLE_FUSION)}, found {upsample_fusion!r}")
    if chunk_latent_frames is not None and chunk_latent_frames < 1:
        raise ValueError(f"chunk_latent_frames must be >= 1 or None, found {chunk_latent_frames}")
    ops = decoder_ops(vae)
    first = _first_streamable(ops)
    if split is not None and not first <= split < len(ops):
        raise ValueError(f"split must be in [{first}, {len(ops)}) (after the attention), found {split}")
    geoms = _geometry(ops, t, h, w)
    elt = torch.empty((), dtype=dtype or vae.dtype).element_size()
    reserve = max(_RESERVE_MIN_BYTES, int(budget_bytes * _RESERVE_FRACTION))
    workspace = max(64 << 20, min(1 << 30, budget_bytes // 16))
    out_bytes = geoms[-1].t * geoms[-1].h * geoms[-1].w * 3 * 4
    usable = budget_bytes - reserve - out_bytes

    def prefix_peak(stop: int) -> int:
        pairs = zip(ops[:stop], geoms, strict=False)
        return max((_op_bytes(op, g.t, g.h, g.w, elt, workspace) for op, g in pairs), default=0)

    def make(stop: int, slab: int, rows: list, cols: list, halo: int, peak: int, fusions=()) -> VideoDecodePlan:
        tiles = tuple((r0, r1, c0, c1) for r0, r1 in rows for c0, c1 in cols)
        scale = geoms[stop].s_ratio
        total = peak + out_bytes + reserve
        shape = (t, h, w)
        return VideoDecodePlan(shape, stop, len(ops), min(slab, t), tiles, scale, halo, workspace, total, fusions)

    def streamed(stop: int, slab: int, grid: int) -> VideoDecodePlan | None:
        g, seg_ops, seg_geoms = geoms[stop], ops[stop:], geoms[stop:]
        halo = min(_halo(seg_ops, seg_geoms), _HALO_CAP_PX)
        # Each overlap holds the halo of both tiles plus a blend ramp at least as wide as both halos.
        overlap = math.ceil((2 * halo + max(2 * halo, _MIN_RAMP_PX)) * g.s_ratio / geoms[-1].s_ratio)
        n_rows, n_cols = min(grid, g.h), min(grid, g.w)
        # Tiles at least twice the overlap long, so that only neighbours overlap.
        if (n_rows > 1 and g.h < (n_rows + 1) * overlap) or (n_cols > 1 and g.w < (n_cols + 1) * overlap):
            return None
        rows, cols = _tiles(g.h, n_rows, overlap), _tiles(g.w, n_cols, overlap)
        th, tw = rows[0][1] - rows[0][0], cols[0][1] - cols[0][0]
        stored = g.c * g.t * g.h * g.w * elt
        peak = max(prefix_peak(stop), stored + _segment_peak(seg_ops, seg_geoms, t, slab, th, tw, elt, workspace))
        return make(stop, slab, rows, cols, halo, peak) if peak <= usable else None

    forced = split is not None or chunk_latent_frames is not None or min_grid > 1
    whole = None if forced else _lean_fusions(ops, geoms, usable, elt, workspace, upsample_fusion)
    if whole is not None:
        fusions, peak = whole
        fused = tuple(UpsampleFusion(ops[i].name, ops[i + 1].name, r) for i, r in sorted(fusions.items()))
        g = geoms[-1]
        return make(len(ops), t, [(0, g.h)], [(0, g.w)], 0, peak, fused)
    if split is not None:
        splits = [split]
    elif chunk_latent_frames is not None:
        splits = [first]
    else:
        # The latest split first: more GroupNorms see the whole clip. A split right after an upsampler (no
        # GroupNorm) adds none over the split before it and stores a bigger tensor: skipped.
        splits = [s for s in range(len(ops) - 1, first - 1, -1) if s == first or ops[s - 1].kind != "upsample"]
    slabs = [chunk_latent_frames] if chunk_latent_frames is not None else range(t, 0, -1)
    for grid in range(min_grid, 65):
        for stop in splits:
            if streamed(stop, slabs[-1], grid) is None:
                continue  # the smallest slab does not fit: no slab will
            for slab in slabs:
                found = streamed(stop, slab, grid)
                if found is not None:
                    return found
    raise ValueError(
        f"video decode of latents {latent_shape} does not fit a budget of {budget_bytes / 2**30:.2f} GiB at any "
        f"split, slab or tile count (chunk_latent_frames={chunk_latent_frames}); expected a larger budget"
    )


# ---------------------------------------------------------------------------------------------------------------
# GroupNorm statistics
# ---------------------------------------------------------------------------------------------------------------


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


def _channel_moments(x: Tensor, block_bytes: int) -> Iterator[tuple[float, Tensor, Tensor]]:
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


def _group_moments(parts: Iterable[tuple[float, Tensor, Tensor]], groups: int) -> _Moments:
    """Per-channel moments of blocks → moments per (sample, group), merged in fp64: the group mean first, then the
    squared deviations about it. Blocks of one count are stacked together, so the merge costs a few kernels, not a
    few per block, and no host-device copy."""
    by_count: dict[float, tuple[list[Tensor], list[Tensor]]] = {}
    for n, mean, var in parts:
        means, variances = by_count.setdefault(n, ([], []))
        means.append(mean)
        variances.append(var)
    stacks = []
    for n, (means, variances) in by_count.items():
        b, c = means[0].shape
        shape = (len(means), b, groups, c // groups)
        stacks.append((n, torch.stack(means).double().view(shape), torch.stack(variances).double().view(shape)))
    total = sum(n * m.shape[0] * m.shape[3] for n, m, _ in stacks)
    mean = sum(m.sum(dim=(0, 3)) * (n / total) for n, m, _ in stacks)  # [B, G]
    m2 = sum((v + (m - mean[None, :, :, None]).square()).sum(dim=(0, 3)) * n for n, m, v in stacks)
    return _Moments(total, mean, m2)


def _moments(x: Tensor, groups: int) -> _Moments:
    """x [B, C, T, H, W] → moments per (sample, group)."""
    return _group_moments(_channel_moments(x, _NORM_BLOCK_BYTES), groups)


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


# ---------------------------------------------------------------------------------------------------------------
# Ops over a slab of frames: causal convolutions in chunks, carrying frames in the stream
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class _Ctx:
    dtype: torch.dtype
    device: torch.device
    memory_format: torch.memory_format
    workspace: int
    # (x, scale, shift, out, act) → out = silu(x * scale + shift): kernels.groupnorm_silu's op or its reference.
    norm_act: Callable[..., Tensor]
    emit: Callable[[_Stream, int, int, Tensor], None] | None = None
    max_chunk_frames: int | None = None  # tests: at most this many frames per chunk, to cross chunk boundaries

    def empty(self, *shape: int) -> Tensor:
        return torch.empty(shape, dtype=self.dtype, device=self.device, memory_format=self.memory_format)

    def frames_per_chunk(self, bytes_per_frame: int) -> int:
        frames = max(1, self.workspace // max(1, bytes_per_frame))
        return frames if self.max_chunk_frames is None else min(frames, self.max_chunk_frames)


def _replicate_edges(p: Tensor, ph: int, pw: int) -> None:
    """p [B, C, n, h+2ph, w+2pw] with its interior filled: replicate the interior's edge rows, then columns
    (F.pad's replicate mode, corners included)."""
    h, w = p.shape[3] - 2 * ph, p.shape[4] - 2 * pw
    cols = slice(pw, pw + w)
    if ph:
        p[:, :, :, :ph, cols] = p[:, :, :, ph : ph + 1, cols]
        p[:, :, :, ph + h :, cols] = p[:, :, :, ph + h - 1 : ph + h, cols]
    if pw:
        p[:, :, :, :, :pw] = p[:, :, :, :, pw : pw + 1]
        p[:, :, :, :, pw + w :] = p[:, :, :, :, pw + w - 1 : pw + w]


class _CausalConv:
    """A HunyuanVideoCausalConv3d fed consecutive chunks of frames. It carries its last kt-1 padded input frames
    from one chunk to the next; none carried means the clip starts here, where diffusers replicates the first
    frame."""

    def __init__(self, conv: nn.Module, b: int, h: int, w: int, ctx: _Ctx, carried: Tensor | None = None):
        self.inner: nn.Conv3d = conv.conv
        kt, kh, kw = self.inner.kernel_size
        self.pt, self.ph, self.pw = kt - 1, kh // 2, kw // 2
        self.b, self.h, self.w, self.ctx = b, h, w, ctx
        self.carried = carried

    def __call__(self, frames: int, fill: Callable[[Tensor], None]) -> Tensor:
        """fill(dst) writes the chunk's `frames` input frames into dst [B, C_in, frames, h, w] (a view of the padded
        buffer, so normalising or upsampling lands where the convolution reads it) → its output frames."""
        pt, ph, pw, h, w = self.pt, self.ph, self.pw, self.h, self.w
        p = self.ctx.empty(self.b, self.inner.in_channels, pt + frames, h + 2 * ph, w + 2 * pw)
        fill(p[:, :, pt:, ph : ph + h, pw : pw + w])
        _replicate_edges(p[:, :, pt:], ph, pw)
        if pt:
            p[:, :, :pt] = p[:, :, pt : pt + 1] if self.carried is None else self.carried
            self.carried = None  # freed before the next carry is taken
            self.carried = p[:, :, -pt:].clone()
        return self.inner(p)


def _causal_conv(
    conv: nn.Module,
    shape: tuple[int, int, int, int],
    fill: Callable[[int, int, Tensor], None],
    sink: Callable[[int, int, Tensor], None],
    stream: _Stream,
    key: str,
    ctx: _Ctx,
) -> None:
    """Run a HunyuanVideoCausalConv3d over input frames of `shape` (B, n, h, w) in chunks of frames.

    fill(t0, t1, dst) writes input frames [t0, t1) into dst [B, C_in, t1-t0, h, w] (see `_CausalConv`); sink(t0,
    t1, y) takes output frames [t0, t1). The last kt-1 padded input frames are carried in the stream under `key`
    for its next slab (not kept when the slab is the whole clip).
    """
    inner: nn.Conv3d = conv.conv
    kh = inner.kernel_size[1]
    b, n, h, w = shape
    elt = torch.empty((), dtype=ctx.dtype).element_size()
    step = min(n, ctx.frames_per_chunk(_conv_chunk_bytes(inner.in_channels, inner.out_channels, h, w, kh, elt, 1)))
    stepper = _CausalConv(conv, b, h, w, ctx, stream.carry.pop(key, None))
    for t0 in range(0, n, step):
        t1 = min(n, t0 + step)
        sink(t0, t1, stepper(t1 - t0, lambda dst, t0=t0, t1=t1: fill(t0, t1, dst)))
    if not stream.whole_clip:
        stream.carry[key] = stepper.carried


def _conv_in(op: _Op, x: Tensor, stream: _Stream, ctx: _Ctx) -> Tensor:
    b, _, n, h, w = x.shape
    y = ctx.empty(b, op.c_out, n, h, w)

    def fill(t0: int, t1: int, dst: Tensor) -> None:
        dst.copy_(x[:, :, t0:t1])

    def sink(t0: int, t1: int, out: Tensor) -> None:
        y[:, :, t0:t1].copy_(out)

    _causal_conv(op.module, (b, n, h, w), fill, sink, stream, f"{op.name}.conv", ctx)
    return y


def _resnet(op: _Op, x: Tensor, stream: _Stream, ctx: _Ctx) -> Tensor:
    """HunyuanVideoResnetBlockCausal3D: conv2(silu(norm2(conv1(silu(norm1(x)))))) + shortcut(x). The block's output
    overwrites conv1's output frame by frame: once a chunk is normalised into the padded buffer it is not read
    again."""
    r = op.module
    b, _, n, h, w = x.shape
    hbuf = ctx.empty(b, op.c_out, n, h, w)
    coeffs1 = _norm_coeffs(stream, f"{op.name}.norm1", r.norm1, partial(_moments, x))

    def fill1(t0: int, t1: int, dst: Tensor) -> None:
        ctx.norm_act(x[:, :, t0:t1], *coeffs1, dst, act=True)

    def sink1(t0: int, t1: int, out: Tensor) -> None:
        hbuf[:, :, t0:t1].copy_(out)

    _causal_conv(r.conv1, (b, n, h, w), fill1, sink1, stream, f"{op.name}.conv1", ctx)
    coeffs2 = _norm_coeffs(stream, f"{op.name}.norm2", r.norm2, partial(_moments, hbuf))

    def fill2(t0: int, t1: int, dst: Tensor) -> None:
        ctx.norm_act(hbuf[:, :, t0:t1], *coeffs2, dst, act=True)

    def sink2(t0: int, t1: int, out: Tensor) -> None:
        residual = x[:, :, t0:t1]
        if r.conv_shortcut is not None:
            residual = r.conv_shortcut.conv(residual)
        torch.add(out, residual, out=hbuf[:, :, t0:t1])

    _causal_conv(r.conv2, (b, n, h, w), fill2, sink2, stream, f"{op.name}.conv2", ctx)
    return hbuf


def _upsample_index(n: int, tf: int, first: bool, device: torch.device) -> tuple[Tensor, int]:
    """(source frame of each upsampled frame, their count) for n input frames; the clip's first frame is upsampled
    in space only. On the device: a host list would cost a synchronising copy."""
    if first:
        n_out = 1 + tf * (n - 1)
        u = torch.arange(n_out, device=device)
        return (u - 1).clamp_min(0) // tf + (u > 0).long(), n_out
    n_out = tf * n
    return torch.arange(n_out, device=device) // tf, n_out


def _upsample_into(x: Tensor, index: Tensor, sf: int, dst: Tensor) -> None:
    """dst [B, C, len(index), h*sf, w*sf] = x's frames at `index`, each pixel repeated sf x sf (nearest)."""
    h, w = x.shape[3:]
    frames = x.index_select(2, index)
    if sf == 1:
        dst.copy_(frames)
        return
    blocks = dst.unflatten(3, (h, sf)).unflatten(5, (w, sf))  # [B, C, t, h, sf, w, sf]
    blocks.copy_(frames[:, :, :, :, None, :, None].expand(-1, -1, -1, -1, sf, -1, sf))


def _upsample(op: _Op, x: Tensor, stream: _Stream, ctx: _Ctx) -> Tensor:
    """HunyuanVideoUpsampleCausal3D: nearest upsampling (the clip's first frame in space only), then a causal conv.
    The upsampled frames are written straight into the convolution's padded buffer."""
    b, _, n, h, w = x.shape
    sf = op.s_up
    index, n_out = _upsample_index(n, op.t_up, stream.first, x.device)
    y = ctx.empty(b, op.c_out, n_out, h * sf, w * sf)

    def fill(t0: int, t1: int, dst: Tensor) -> None:
        _upsample_into(x, index[t0:t1], sf, dst)

    def sink(t0: int, t1: int, out: Tensor) -> None:
        y[:, :, t0:t1].copy_(out)

    _causal_conv(op.module.conv, (b, n_out, h * sf, w * sf), fill, sink, stream, f"{op.name}.conv", ctx)
    return y


def _attention(op: _Op, x: Tensor, stream: _Stream, ctx: _Ctx) -> Tensor:
    """The mid-block attention over the whole clip: a token attends to its own and earlier frames, one query frame
    at a time with only its visible keys (diffusers builds a dense [N, N] mask instead: 80 GB at W1 in bf16)."""
    attn = op.module
    b, c, t, h, w = x.shape
    frame = h * w
    coeffs = _norm_coeffs(stream, f"{op.name}.group_norm", attn.group_norm, partial(_moments, x))
    tokens = torch.empty((b, t, h, w, c), dtype=x.dtype, device=x.device)  # [B, T, h, w, C]
    ctx.norm_act(x, *coeffs, tokens.permute(0, 4, 1, 2, 3), act=False)
    tokens = tokens.view(b, t * frame, c)
    heads = attn.heads
    q, k, v = (proj(tokens).view(b, t * frame, heads, -1).transpose(1, 2) for proj in (attn.to_q, attn.to_k, attn.to_v))
    del tokens
    o = torch.empty_like(q)
    for i in range(t):
        rows, seen = slice(i * frame, (i + 1) * frame), slice(0, (i + 1) * frame)
        o[:, :, rows] = F.scaled_dot_product_attention(q[:, :, rows], k[:, :, seen], v[:, :, seen])
    del q, k, v
    o = attn.to_out[1](attn.to_out[0](o.transpose(1, 2).reshape(b, t * frame, -1)))
    o = o.view(b, t, h, w, c) + x.permute(0, 2, 3, 4, 1)
    if attn.rescale_output_factor != 1.0:
        o = o / attn.rescale_output_factor
    return o.permute(0, 4, 1, 2, 3).contiguous(memory_format=ctx.memory_format)


def _out(op: _Op, x: Tensor, stream: _Stream, ctx: _Ctx) -> None:
    """conv_out(silu(conv_norm_out(x))), handed to ctx.emit chunk by chunk."""
    dec = op.module
    b, _, n, h, w = x.shape
    coeffs = _norm_coeffs(stream, "out.norm", dec.conv_norm_out, partial(_moments, x))

    def fill(t0: int, t1: int, dst: Tensor) -> None:
        ctx.norm_act(x[:, :, t0:t1], *coeffs, dst, act=True)

    def sink(t0: int, t1: int, out: Tensor) -> None:
        assert ctx.emit is not None
        ctx.emit(stream, t0, t1, out)

    _causal_conv(dec.conv_out, (b, n, h, w), fill, sink, stream, "out.conv", ctx)
    stream.frames_out += n


_APPLY = {"conv_in": _conv_in, "resnet": _resnet, "upsample": _upsample, "attention": _attention, "out": _out}


# ---------------------------------------------------------------------------------------------------------------
# The lean whole-clip decode: an upsampler fused with the resnet after it (UpsampleFusion)
# ---------------------------------------------------------------------------------------------------------------


def _upsampled(up: _Op, x: Tensor, index: Tensor, t0: int, t1: int, ctx: _Ctx) -> Tensor:
    """Output frames [t0, t1) of the upsampler `up` over the whole clip, from its input x alone: the conv's kt-1
    frames of history are upsampled again instead of carried (before the clip's first frame they are the first
    frame, as diffusers' replicate padding makes them)."""
    inner: nn.Conv3d = up.module.conv.conv
    kt, kh, kw = inner.kernel_size
    ph, pw = kh // 2, kw // 2
    b, c, _, h, w = x.shape
    sf, start = up.s_up, t0 - (kt - 1)
    source = index[max(start, 0) : t1]
    if start < 0:
        source = torch.cat([index[:1].expand(-start), source])
    p = ctx.empty(b, c, t1 - start, h * sf + 2 * ph, w * sf + 2 * pw)
    _upsample_into(x, source, sf, p[:, :, :, ph : ph + h * sf, pw : pw + w * sf])
    _replicate_edges(p, ph, pw)
    return inner(p)


def _upsample_resnet(up: _Op, res: _Op, x: Tensor, stream: _Stream, ctx: _Ctx, recompute_shortcut: bool) -> Tensor:
    """`res(up(x))` over the whole clip without storing U = up(x) (see `UpsampleFusion`); the same arithmetic as the
    two ops, so the same result. Holds x, conv1's output (which becomes the block's output) and, unless
    `recompute_shortcut`, the shortcut's output; plus one chunk of frames in flight through two convolutions."""
    if not (stream.whole_clip and stream.first):
        raise ValueError(f"{up.name} + {res.name}: a fused upsampler runs over the whole clip at once only")
    r = res.module
    b, _, n, h, w = x.shape
    hh, ww = h * up.s_up, w * up.s_up
    index, n_out = _upsample_index(n, up.t_up, True, x.device)
    _, frame_bytes = _fusion_bytes(up, res, n, h, w, x.element_size(), ctx.workspace, recompute_shortcut)
    step = ctx.frames_per_chunk(frame_bytes)
    chunks = [(t0, min(n_out, t0 + step)) for t0 in range(0, n_out, step)]

    def upsampled(t0: int, t1: int) -> Tensor:
        return _upsampled(up, x, index, t0, t1, ctx)

    def shortcut(u: Tensor) -> Tensor:
        return u if r.conv_shortcut is None else r.conv_shortcut.conv(u)

    def u_moments(groups: int) -> _Moments:  # pass 1: U chunk by chunk, only for norm1's statistics
        parts = (part for t0, t1 in chunks for part in _channel_moments(upsampled(t0, t1), _NORM_BLOCK_BYTES))
        return _group_moments(parts, groups)

    coeffs1 = _norm_coeffs(stream, f"{res.name}.norm1", r.norm1, u_moments)
    # Pass 2: U again, into conv1 (normalised) and the shortcut.
    hbuf = ctx.empty(b, res.c_out, n_out, hh, ww)
    stored = None if recompute_shortcut else ctx.empty(b, res.c_out, n_out, hh, ww)
    conv1 = _CausalConv(r.conv1, b, hh, ww, ctx)
    for t0, t1 in chunks:
        u = upsampled(t0, t1)
        hbuf[:, :, t0:t1] = conv1(t1 - t0, lambda dst, u=u: ctx.norm_act(u, *coeffs1, dst, act=True))
        if stored is not None:
            stored[:, :, t0:t1] = shortcut(u)
        del u
    coeffs2 = _norm_coeffs(stream, f"{res.name}.norm2", r.norm2, partial(_moments, hbuf))
    # conv2 + shortcut over conv1's output: a chunk of it is not read again once normalised into conv2's input.
    conv2 = _CausalConv(r.conv2, b, hh, ww, ctx)
    for t0, t1 in chunks:
        residual = shortcut(upsampled(t0, t1)) if stored is None else stored[:, :, t0:t1]
        out = conv2(t1 - t0, lambda dst, t0=t0, t1=t1: ctx.norm_act(hbuf[:, :, t0:t1], *coeffs2, dst, act=True))
        torch.add(out, residual, out=hbuf[:, :, t0:t1])
        del out, residual
    return hbuf


def _run(
    ops: list[_Op], x: Tensor, stream: _Stream, ctx: _Ctx, fusions: Mapping[str, UpsampleFusion] | None = None
) -> Tensor | None:
    """Run ops over one slab; returns the last op's output (None after "out", which emits instead). An upsampler
    named in `fusions` runs together with the resnet after it."""
    i = 0
    while i < len(ops):
        fusion = (fusions or {}).get(ops[i].name)
        if fusion is None:
            x = _APPLY[ops[i].kind](ops[i], x, stream, ctx)
            i += 1
        else:
            x = _upsample_resnet(ops[i], ops[i + 1], x, stream, ctx, fusion.recompute_shortcut)
            i += 2
    stream.first = False
    return x


def _check_fusions(ops: list[_Op], plan: VideoDecodePlan) -> dict[str, UpsampleFusion]:
    """The plan's fusions by upsampler name, each an upsampler and the resnet after it in the whole-clip segment."""
    names = [op.name for op in ops[: plan.split]]
    for f in plan.fusions:
        i = names.index(f.upsampler) if f.upsampler in names else -1
        if i < 0 or i + 1 >= len(names) or not _fusable(ops, i) or names[i + 1] != f.resnet:
            raise ValueError(
                f"expected fusions of an upsampler and the resnet after it among the whole-clip ops {names}, "
                f"found {f.describe()}"
            )
    return {f.upsampler: f for f in plan.fusions}


# ---------------------------------------------------------------------------------------------------------------
# Tiles and the output
# ---------------------------------------------------------------------------------------------------------------


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


@contextlib.contextmanager
def _cudnn_benchmark(on: bool):
    """cudnn.benchmark for this decode only: the process-wide flag is restored on exit."""
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = on
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = before


def _decode_sample(
    vae: nn.Module,
    z: Tensor,
    plan: VideoDecodePlan,
    ctx: _Ctx,
    out: Tensor,
    frozen: Mapping[str, _Moments] | None,
) -> dict[str, _Moments]:
    """z [1, C, T, H, W] (unscaled, post_quant_conv applied) → raw decoder output accumulated into out [F, H, W, 3].
    Returns the GroupNorm statistics the decode used (whole-clip ones when the plan is exact)."""
    ops = decoder_ops(vae)
    fusions = _check_fusions(ops, plan)
    scale = _geometry(ops, *z.shape[2:])[-1].s_ratio
    prefix = _Stream(frozen, whole_clip=True)

    def emit_whole(stream: _Stream, t0: int, t1: int, y: Tensor) -> None:
        f0 = stream.frames_out
        out[f0 + t0 : f0 + t1].copy_(y[0].permute(1, 2, 3, 0))

    ctx.emit = emit_whole
    x = _run(ops[: plan.split], z, prefix, ctx, fusions)
    if x is None:
        return prefix.moments
    seg_ops = ops[plan.split :]
    ratio = scale // plan.segment_scale
    t_ratio = _geometry(ops, *z.shape[2:])[plan.split].t_ratio
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
    for r0, r1, c0, c1 in plan.tiles:
        rs, cs = (r0 * ratio, r1 * ratio), (c0 * ratio, c1 * ratio)
        wr, wc = row_w[rs], col_w[cs]
        weight = None if wr is None and wc is None else _outer(wr, wc, rs, cs, out.device)

        def emit_tile(stream: _Stream, t0: int, t1: int, y: Tensor, rs=rs, cs=cs, weight=weight) -> None:
            f0 = stream.frames_out
            region = out[f0 + t0 : f0 + t1, rs[0] : rs[1], cs[0] : cs[1]]
            frames = y[0].permute(1, 2, 3, 0)
            if weight is None:
                region.copy_(frames)
            else:
                region.addcmul_(frames, weight)

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
def _decode(
    vae: nn.Module,
    latents: Tensor,
    plan: VideoDecodePlan,
    *,
    layout: str = "ncdhw",
    cudnn_benchmark: bool = False,
    triton_norm: bool = False,
    frozen: Mapping[str, _Moments] | None = None,
    max_chunk_frames: int | None = None,
    raw: bool = False,
) -> tuple[Tensor, dict[str, _Moments]]:
    """`decode_video_fast` with an explicit plan; also returns the GroupNorm statistics of the last sample.
    For tests: `frozen` replaces running statistics with given ones (the whole-clip ones make any plan exact);
    `max_chunk_frames` caps the frames of every chunk; `raw` returns the decoder's output as is (in [-1, 1] but
    neither shifted nor clamped)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, found {layout!r}")
    if latents.ndim != 5 or latents.shape[-1] != vae.config.latent_channels:
        raise ValueError(f"expected latents [B, T, H, W, {vae.config.latent_channels}], found {tuple(latents.shape)}")
    b, t, h, w, _ = latents.shape
    if (t, h, w) != plan.latent_shape:
        raise ValueError(f"expected latents of (T, H, W) {plan.latent_shape} as planned, found {(t, h, w)}")
    device, dtype = vae.device, vae.dtype
    z = latents.to(device).permute(0, 4, 1, 2, 3).to(dtype) / vae.config.scaling_factor  # [B, C, T, H, W]
    from .kernels.groupnorm_silu import groupnorm_silu, groupnorm_silu_ref

    norm_act = groupnorm_silu if triton_norm else groupnorm_silu_ref
    fmt = _MEMORY_FORMATS[layout]
    ctx = _Ctx(dtype, device, fmt, plan.workspace_bytes, norm_act, max_chunk_frames=max_chunk_frames)
    frames = 1 + vae.config.temporal_compression_ratio * (t - 1)
    s = vae.config.spatial_compression_ratio
    out = torch.zeros((b, frames, h * s, w * s, 3), dtype=torch.float32, device=device)
    moments: dict[str, _Moments] = {}
    with _cudnn_benchmark(cudnn_benchmark) if device.type == "cuda" else contextlib.nullcontext():
        for i in range(b):
            zi = vae.post_quant_conv(z[i : i + 1]).contiguous(memory_format=ctx.memory_format)
            moments = _decode_sample(vae, zi, plan, ctx, out[i], frozen)
    return (out if raw else out.mul_(0.5).add_(0.5).clamp_(0, 1)), moments


def decode_video_fast(
    vae: nn.Module,
    latents: Tensor,
    *,
    budget_bytes: int,
    chunk_latent_frames: int | None = None,
    layout: str = "ncdhw",
    cudnn_benchmark: bool = False,
    triton_norm: bool = False,
    upsample_fusion: str = "auto",
) -> Tensor:
    """latents [B, T, H, W, C] (scaled) → frames fp32 [B, F, 8H, 8W, 3] in [0, 1], F = 4(T-1)+1: the output of
    `k6fast.vae.decode_video`, without diffusers' overlapping tiles.

    `budget_bytes`: what the decode may allocate on the VAE's device beyond what is allocated when it starts
    (activations, temporaries, carried frames, the fp32 output). When the whole decode fits, the result is diffusers'
    untiled decode up to float rounding (`plan_video_decode(...).exact`), plain or lean (`upsample_fusion`, see
    `plan_video_decode`); otherwise the up blocks stream and their GroupNorms use running statistics.
    `chunk_latent_frames` forces streaming in slabs of that many latent frames.
    `layout` "ndhwc" keeps activations channels-last (cuDNN's native 3D layout); `cudnn_benchmark` lets cuDNN time
    its convolution algorithms during this decode only; `triton_norm` runs GroupNorm+SiLU as one Triton kernel
    (kernels/groupnorm_silu.py) instead of PyTorch's three passes through fp32. Samples of a batch are decoded one
    after another.
    """
    if latents.ndim != 5:
        raise ValueError(f"expected latents [B, T, H, W, C], found {tuple(latents.shape)}")
    plan = plan_video_decode(
        vae,
        tuple(latents.shape[1:4]),
        budget_bytes=budget_bytes,
        chunk_latent_frames=chunk_latent_frames,
        upsample_fusion=upsample_fusion,
    )
    logger.info("video decode: %s", plan.describe())
    frames, _ = _decode(vae, latents, plan, layout=layout, cudnn_benchmark=cudnn_benchmark, triton_norm=triton_norm)
    return frames
