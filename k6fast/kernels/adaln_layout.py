"""How the AdaLN kernels (adaln.py) see their operands, and the checks that hold them to it; private to them.

x is [..., D] (rows = tokens). A modulation vector is [D] (shared by all rows), [1, D], or [B, D] with x [B, ..., D]
(one vector per sample, rows of sample b are x[b].reshape(-1, D)), as diffusers broadcasts them. A kernel program
takes whole rows (`row_tile`).
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_activation(x: Tensor, op: str, name: str = "x") -> None:
    if x.dtype not in _ACT_DTYPES:
        raise ValueError(f"{op}: expected {name} bfloat16, float16 or float32, found {x.dtype}")
    if x.ndim < 2:
        raise ValueError(f"{op}: expected {name} [..., tokens, D] with at least 2 dims, found {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"{op}: expected a contiguous {name}, found shape {tuple(x.shape)} stride {x.stride()}")


def _modulation_layout(x: Tensor, vec: Tensor, op: str, name: str) -> tuple[int, int, int]:
    """→ (batch stride, column stride, rows per sample) of a modulation vector for x viewed as [rows, D]."""
    d = x.shape[-1]
    rows = x.numel() // d if d else 0
    if vec.dtype not in _ACT_DTYPES:
        raise ValueError(f"{op}: expected {name} float32, bfloat16 or float16, found {vec.dtype}")
    if vec.device != x.device:
        raise ValueError(f"{op}: expected {name} on {x.device}, found {vec.device}")
    if vec.ndim == 1 and vec.shape[0] == d:
        return 0, vec.stride(0), max(rows, 1)
    if vec.ndim == 2 and vec.shape[1] == d:
        if vec.shape[0] == 1:
            return 0, vec.stride(1), max(rows, 1)
        if x.ndim > 2 and vec.shape[0] == x.shape[0]:
            return vec.stride(0), vec.stride(1), max(rows // x.shape[0], 1)
    batch = x.shape[0] if x.ndim > 2 else 1
    raise ValueError(
        f"{op}: expected {name} of shape ({d},), (1, {d}) or ({batch}, {d}) for x {tuple(x.shape)}, "
        f"found {tuple(vec.shape)}"
    )


def _per_sample(vec: Tensor, x: Tensor) -> Tensor:
    """diffusers' broadcast of a [B, D] modulation vector over x [B, ..., D]: reshape to [B, 1, ..., 1, D]."""
    if x.ndim > 2 and vec.ndim == 2:
        return vec.reshape((vec.shape[0],) + (1,) * (x.ndim - 2) + (vec.shape[-1],))
    return vec


def row_tile(d: int, n_rows: int, elements: int) -> tuple[int, int, int]:
    """→ (BLOCK_D, rows per program, num_warps): a whole row per program; short rows are stacked up to `elements`."""
    block_d = triton.next_power_of_2(d)
    rows = max(1, min(elements // block_d, triton.next_power_of_2(n_rows)))
    num_warps = min(16, max(4, rows * block_d // 512))
    return block_d, rows, num_warps
