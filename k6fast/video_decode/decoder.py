"""diffusers' HunyuanVideo VAE decoder as a list of ops (conv_in, mid-block resnets and attention, up-block resnets
and upsamplers, out), checked against the layer settings the decode relies on, and each op's input geometry over
the whole clip."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


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


def decoder_geometry(ops: list[_Op], t: int, h: int, w: int) -> list[_Geom]:
    """Input geometry of every op, plus the decoder's output as the last entry."""
    out, t_ratio, s_ratio = [], 1, 1
    for op in ops:
        out.append(_Geom(op.c_in, t, h, w, t_ratio, s_ratio))
        if op.kind == "upsample":
            t, h, w = 1 + op.t_up * (t - 1), h * op.s_up, w * op.s_up
            t_ratio, s_ratio = t_ratio * op.t_up, s_ratio * op.s_up
    out.append(_Geom(ops[-1].c_out, t, h, w, t_ratio, s_ratio))
    return out


def _fusable(ops: list[_Op], i: int) -> bool:
    """An upsampler with a resnet right after it: a pair the lean whole-clip decode may fuse."""
    return ops[i].kind == "upsample" and i + 1 < len(ops) and ops[i + 1].kind == "resnet"
