"""The decoder's ops run over a slab of frames: causal convolutions in chunks of frames that carry their last input
frames in the stream, GroupNorm + SiLU written straight into the next convolution's padded input; and the lean
whole-clip decode's upsampler fused with the resnet after it (`UpsampleFusion`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..cancel import StopCheck, check_stop
from .decoder import _fusable, _Op
from .norm_stats import (
    _NORM_BLOCK_BYTES,
    _channel_moments,
    _group_moments,
    _Moments,
    _moments,
    _norm_coeffs,
    _Part,
    _Stream,
)
from .plan import UpsampleFusion, VideoDecodePlan, _conv_chunk_bytes, _fusion_bytes


@dataclass
class _Ctx:
    dtype: torch.dtype
    device: torch.device
    memory_format: torch.memory_format
    workspace: int
    # (x, scale, shift, out, act) → out = silu(x * scale + shift): kernels.groupnorm_silu's op or its reference.
    norm_act: Callable[..., Tensor]
    # (x, block_bytes) → its blocks' per-channel moments: norm_stats._fused_channel_moments or its reference.
    channel_moments: Callable[[Tensor, int], Iterable[_Part]] = _channel_moments
    emit: Callable[[_Stream, int, int, Tensor], None] | None = None
    max_chunk_frames: int | None = None  # tests: at most this many frames per chunk, to cross chunk boundaries
    should_stop: StopCheck | None = None  # checked before every op (k6fast.cancel)

    def empty(self, *shape: int) -> Tensor:
        return torch.empty(shape, dtype=self.dtype, device=self.device, memory_format=self.memory_format)

    def moments(self, x: Tensor, groups: int) -> _Moments:
        return _moments(x, groups, self.channel_moments)

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
    coeffs1 = _norm_coeffs(stream, f"{op.name}.norm1", r.norm1, partial(ctx.moments, x))

    def fill1(t0: int, t1: int, dst: Tensor) -> None:
        ctx.norm_act(x[:, :, t0:t1], *coeffs1, dst, act=True)

    def sink1(t0: int, t1: int, out: Tensor) -> None:
        hbuf[:, :, t0:t1].copy_(out)

    _causal_conv(r.conv1, (b, n, h, w), fill1, sink1, stream, f"{op.name}.conv1", ctx)
    coeffs2 = _norm_coeffs(stream, f"{op.name}.norm2", r.norm2, partial(ctx.moments, hbuf))

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
    coeffs = _norm_coeffs(stream, f"{op.name}.group_norm", attn.group_norm, partial(ctx.moments, x))
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
    coeffs = _norm_coeffs(stream, "out.norm", dec.conv_norm_out, partial(ctx.moments, x))

    def fill(t0: int, t1: int, dst: Tensor) -> None:
        ctx.norm_act(x[:, :, t0:t1], *coeffs, dst, act=True)

    def sink(t0: int, t1: int, out: Tensor) -> None:
        assert ctx.emit is not None
        ctx.emit(stream, t0, t1, out)

    _causal_conv(dec.conv_out, (b, n, h, w), fill, sink, stream, "out.conv", ctx)
    stream.frames_out += n


# What runs a decoder op of each kind, looked up per op as the decode runs: tests wrap its entries to count, pause or
# stop the decode op by op.
OP_RUNNERS = {"conv_in": _conv_in, "resnet": _resnet, "upsample": _upsample, "attention": _attention, "out": _out}


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
        parts = (part for t0, t1 in chunks for part in ctx.channel_moments(upsampled(t0, t1), _NORM_BLOCK_BYTES))
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
    coeffs2 = _norm_coeffs(stream, f"{res.name}.norm2", r.norm2, partial(ctx.moments, hbuf))
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
        check_stop(ctx.should_stop, "video_decode", f"before decoder op {ops[i].name}")
        fusion = (fusions or {}).get(ops[i].name)
        if fusion is None:
            x = OP_RUNNERS[ops[i].kind](ops[i], x, stream, ctx)
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
