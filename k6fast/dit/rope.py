"""Rotary position embeddings as (cos, sin) tables over interleaved channel pairs.

Kandinsky 6 rotates channel pairs (2i, 2i+1) of every head. The tables here hold one angle per pair, fp32, shaped
[tokens, head_dim // 2]; the rotation itself (`k6fast.kernels.qk_norm_rope.apply_rope`, the reference of the fused
q/k norm kernel) broadcasts them over heads. This is the same rotation as diffusers' 2x2-matrix form
(`apply_rotary`), with half the table memory and no per-element matrix product.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def inverse_freqs(dim: int, max_period: float = 10000.0) -> Tensor:
    """fp32 [dim]: exp(-ln(max_period) * i / dim)."""
    return torch.exp(-math.log(max_period) * torch.arange(dim, dtype=torch.float32) / dim)


def rope_1d(positions: Tensor, head_dim: int, freqs_scaling: float = 1.0) -> tuple[Tensor, Tensor]:
    """Text and audio RoPE. positions: int [N] → (cos, sin) fp32 [N, head_dim // 2]."""
    freqs = (inverse_freqs(head_dim // 2) * freqs_scaling).to(positions.device)
    angles = positions.to(torch.float32)[:, None] * freqs[None, :]
    return torch.cos(angles), torch.sin(angles)


def rope_3d(
    positions: tuple[Tensor, Tensor, Tensor],
    axes_dims: tuple[int, int, int],
    scale_factor: tuple[float, float, float],
) -> tuple[Tensor, Tensor]:
    """Video RoPE over a (T, H, W) token grid. positions: one int index tensor per axis (lengths T, H, W) →
    (cos, sin) fp32 [T*H*W, sum(axes_dims) // 2], tokens in (t, h, w) row-major order."""
    sizes = [int(p.shape[0]) for p in positions]
    per_axis = []
    for axis, (pos, dim, scale) in enumerate(zip(positions, axes_dims, scale_factor, strict=True)):
        freqs = inverse_freqs(dim // 2).to(pos.device)
        angles = pos.to(torch.float32)[:, None] * freqs[None, :] / scale
        shape = [1, 1, 1, dim // 2]
        shape[axis] = sizes[axis]
        per_axis.append(angles.view(shape).expand(*sizes, dim // 2))
    angles = torch.cat(per_axis, dim=-1).reshape(-1, sum(axes_dims) // 2)
    return torch.cos(angles), torch.sin(angles)
