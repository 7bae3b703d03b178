"""The decode plan: where streaming starts (the split), the slab of latent frames, the spatial tiles and the
upsamplers fused in the lean whole-clip decode, chosen from a byte budget by estimating each op's peak memory."""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..memory import GiB, decode_reserve, decode_workspace
from .decoder import _Conv, _first_streamable, _fusable, _Geom, _Op, decoder_geometry, decoder_ops
from .norm_stats import _NORM_BLOCK_BYTES

# The reach of a tile edge's replicate padding counted over every convolution left (114 output pixels from the mid
# block on) is a worst-case bound; its effect fades within a few pixels per level. Past this cap the blend ramp, not
# exclusion, absorbs what remains: tiles stream with their own statistics, already not exact.
_HALO_CAP_PX = 32
_MIN_RAMP_PX = 16
UPSAMPLE_FUSION = ("auto", "off", "stored", "recomputed")


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

    def describe(self, peak: bool = True) -> str:
        """One line for people; `peak=False` leaves out the estimated peak (a GPU figure: on the CPU it means
        nothing)."""
        estimate = f"; estimated peak {self.estimated_peak_bytes / GiB:.2f} GiB" if peak else ""
        if self.split == self.num_ops:
            fused = f": {'; '.join(f.describe() for f in self.fusions)}" if self.fusions else ""
            return f"{self.mode} decode of all {self.num_ops} ops (exact){fused}{estimate}"
        streamed = self.num_ops - self.split
        kind = "exact" if self.exact else "running GroupNorm statistics"
        return (
            f"streamed: {self.split} ops whole-clip, {streamed} streamed in slabs of {self.slab_latent_frames} latent "
            f"frames over {len(self.tiles)} tile(s) ({kind}){estimate}"
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


def whole_clip_peak(
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
        peak, _ = whole_clip_peak(ops, geoms, every, elt, workspace)
        return (every, peak) if peak <= usable else None
    fusions: dict[int, bool] = {}
    while True:
        peak, at = whole_clip_peak(ops, geoms, fusions, elt, workspace)
        if peak <= usable:
            return fusions, peak
        up = at if at in pairs else at - 1  # the peak at a resnet right after an upsampler: fuse that pair
        if policy == "off" or up not in pairs or fusions.get(up, False):
            return None
        fusions[up] = up in fusions  # first with the shortcut stored, then recomputed


# Each live VAE's decoder as ops, for the planner: a fit table asks thousands of plans, and the list depends only on
# the decoder's modules, which diffusers builds from the VAE's config (`.to()`, `.eval()` and loading weights keep
# every module and shape). Weak keys: an entry goes with its VAE, so what is kept is bounded by the VAEs alive, each a
# few dozen small records.
_PLANNED_OPS: weakref.WeakKeyDictionary[nn.Module, list[_Op]] = weakref.WeakKeyDictionary()


def planned_ops(vae: nn.Module) -> list[_Op]:
    """`decoder_ops(vae)`, built once per VAE object; not to be mutated. Rebuilt when `vae.decoder` is no longer the
    decoder the list was built from (the "out" op holds it), and checked again (so refused as `decoder_ops` refuses
    it) while the decoder is in training mode. A module replaced inside the same decoder object is not seen: nothing
    in k6fast does that; whoever does must plan with a new VAE object."""
    ops = _PLANNED_OPS.get(vae)
    decoder = getattr(vae, "decoder", None)
    if ops is None or ops[-1].module is not decoder or decoder.training:
        ops = _PLANNED_OPS[vae] = decoder_ops(vae)
    return ops


@dataclass(frozen=True)
class _Room:
    """One clip's decode within one budget: the ops and their geometry over the clip, the element size, and how the
    budget divides into the reserve, the convolution workspace, the fp32 output and what the activations may use."""

    ops: list[_Op]
    geoms: list[_Geom]
    elt: int
    reserve: int
    workspace: int
    out_bytes: int
    usable: int


def _room(vae: nn.Module, latent_shape: tuple[int, int, int], budget_bytes: int, dtype: torch.dtype | None) -> _Room:
    t, h, w = latent_shape
    if min(t, h, w) < 1:
        raise ValueError(f"expected a latent clip (T, H, W) with positive sizes, found {latent_shape}")
    ops = planned_ops(vae)
    geoms = decoder_geometry(ops, t, h, w)
    elt = (dtype or vae.dtype).itemsize
    reserve, workspace = decode_reserve(budget_bytes), decode_workspace(budget_bytes)
    out_bytes = geoms[-1].t * geoms[-1].h * geoms[-1].w * 3 * 4
    return _Room(ops, geoms, elt, reserve, workspace, out_bytes, budget_bytes - reserve - out_bytes)


def _whole_clip(room: _Room, policy: str) -> tuple[dict[int, bool], int] | None:
    """The whole-clip (exact) decode's fusions and peak within `room`, or None where it does not fit."""
    return _lean_fusions(room.ops, room.geoms, room.usable, room.elt, room.workspace, policy)


def exact_decode_fits(
    vae: nn.Module, latent_shape: tuple[int, int, int], *, budget_bytes: int, dtype: torch.dtype | None = None
) -> bool:
    """`plan_video_decode(vae, latent_shape, budget_bytes=..., dtype=...).exact` (False where that raises for want of
    room) without searching for the streamed decode. Under "auto" fusion that search never finds an exact plan
    where the whole-clip decode does not fit: one slab and one tile run the same ops over the same geometry and
    also store the split's input, so its peak is above the plain whole-clip decode's, which "auto" tries first."""
    return _whole_clip(_room(vae, latent_shape, budget_bytes, dtype), "auto") is not None


def plan_video_decode(
    vae: nn.Module,
    latent_shape: tuple[int, int, int],
    *,
    budget_bytes: int,
    chunk_latent_frames: int | None = None,
    dtype: torch.dtype | None = None,
    upsample_fusion: str = "auto",
    split: int | None = None,
    min_grid: int = 1,
) -> VideoDecodePlan:
    """Plan the decode of one latent clip of shape (T, H, W) within `budget_bytes` (what the decode may allocate:
    activations, temporaries, carried frames and the fp32 output), activations in `dtype` (default the VAE's).

    Without `chunk_latent_frames`: the whole decode at once when it fits (exact): plain, else lean (upsamplers
    fused with the resnet after them, `upsample_fusion` "auto"); else the latest split, then the largest slab, that
    fit without tiles; else the fewest tiles. With it: everything after the mid-block attention streams in slabs of
    that many latent frames (the least memory for that slab). `upsample_fusion` "off" never fuses; "stored" or
    "recomputed" fuse every upsampler that a resnet follows, with that shortcut (to measure or test the lean path).
    To measure or test a streamed decode: `split` fixes where streaming starts (an op index after the mid-block
    attention), `min_grid` forces at least that many tiles per side.
    """
    if upsample_fusion not in UPSAMPLE_FUSION:
        raise ValueError(f"upsample_fusion must be one of {', '.join(UPSAMPLE_FUSION)}, found {upsample_fusion!r}")
    if chunk_latent_frames is not None and chunk_latent_frames < 1:
        raise ValueError(f"chunk_latent_frames must be >= 1 or None, found {chunk_latent_frames}")
    room = _room(vae, latent_shape, budget_bytes, dtype)
    t, h, w = latent_shape
    ops, geoms, elt, workspace, usable = room.ops, room.geoms, room.elt, room.workspace, room.usable
    reserve, out_bytes = room.reserve, room.out_bytes
    first = _first_streamable(ops)
    if split is not None and not first <= split < len(ops):
        raise ValueError(f"split must be in [{first}, {len(ops)}) (after the attention), found {split}")

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
    whole = None if forced else _whole_clip(room, upsample_fusion)
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
        f"video decode of latents {latent_shape} does not fit a budget of {budget_bytes / GiB:.2f} GiB at any "
        f"split, slab or tile count (chunk_latent_frames={chunk_latent_frames}); expected a larger budget"
    )
