"""GroupNorm from given statistics, then SiLU, written into a strided destination: the HunyuanVideo VAE decoder's
`silu(norm(x))` in front of every convolution.

What it holds:
- `groupnorm_silu(x, scale, shift, out, act=True)`: out = silu(x * scale + shift), scale and shift per (sample,
  channel), fp32 math, one rounding to out's dtype. With scale = gamma * rstd[group] and shift = beta -
  mean[group] * scale this is GroupNorm (the statistics come from the caller, who may have gathered them over more
  frames than x holds). x, out: [B, C, T, H, W], both unit-stride along W (NCDHW) or both along C (NDHWC); out may
  be a window of a larger buffer (a convolution's padded input). PyTorch runs it as addcmul, silu and a copy
  through an fp32 temporary, about 20 bytes per bf16 element; the kernel reads 2 and writes 2.
- `groupnorm_silu_ref`: the same in PyTorch, frame by frame, in blocks of rows past 64 MiB of fp32 (which
  bounds the fp32 temporary).

Check: `pytest tests/test_groupnorm_silu.py` (CPU + interpreter; `-m gpu` on a GPU machine).
Benchmark: `python measurements/bench_vae_decode.py` (the decode, with and without the kernel).
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl
from torch import Tensor

from .fallback import cuda_at_least, device_label, log_reference_once

logger = logging.getLogger(__name__)

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# ---------------------------------------------------------------------------------------------------------------
# Dispatch:   CUDA sm_80+ with x and out unit-stride along the same dim   Triton
#             CPU, older GPUs, or x and out in different layouts          reference (logged once)
# ---------------------------------------------------------------------------------------------------------------


def _check(x: Tensor, scale: Tensor, shift: Tensor, out: Tensor) -> None:
    if x.ndim != 5 or out.shape != x.shape:
        raise ValueError(f"groupnorm_silu: expected x and out [B, C, T, H, W] alike, found {x.shape} and {out.shape}")
    if x.dtype not in _DTYPES or out.dtype not in _DTYPES:
        raise ValueError(f"groupnorm_silu: expected bf16, fp16 or fp32 x and out, found {x.dtype} and {out.dtype}")
    b, c = x.shape[:2]
    for name, t in (("scale", scale), ("shift", shift)):
        if t.shape != (b, c) or t.dtype != torch.float32 or not t.is_contiguous() or t.device != x.device:
            raise ValueError(
                f"groupnorm_silu: expected {name} contiguous fp32 [{b}, {c}] on {x.device}, found "
                f"{t.dtype} {tuple(t.shape)} on {t.device}"
            )


def _inner_dim(x: Tensor, out: Tensor) -> int | None:
    """The dim the kernel vectorises over: W (4) or C (1), unit-stride in both tensors; None if neither is."""
    for dim in (4, 1):
        if x.stride(dim) == 1 and out.stride(dim) == 1:
            return dim
    return None


# The reference's fp32 temporary: a frame, or rows of one (a full-resolution frame of the VAE decoder's last up
# block is 425 MB in fp32).
_REF_BLOCK_BYTES = 64 << 20


def groupnorm_silu_ref(x: Tensor, scale: Tensor, shift: Tensor, out: Tensor, *, act: bool = True) -> Tensor:
    """out = silu(x * scale + shift) (no silu if not act) in fp32, rounded once to out's dtype; returns out.
    x, out: [B, C, T, H, W] any strides; scale, shift: fp32 [B, C]."""
    b, c = scale.shape
    scale4, shift4 = scale.view(b, c, 1, 1), shift.view(b, c, 1, 1)
    h, w = x.shape[3:]
    rows = max(1, _REF_BLOCK_BYTES // (b * c * w * 4))
    for i in range(x.shape[2]):
        for r0 in range(0, h, rows):
            y = torch.addcmul(shift4, x[:, :, i, r0 : r0 + rows], scale4)
            if act:
                torch.nn.functional.silu(y, inplace=True)
            out[:, :, i, r0 : r0 + rows].copy_(y)
    return out


@triton.jit
def _groupnorm_silu_kernel(
    x_ptr,  # element (row, col) at row offset (from the row's 4-d index and x strides) + col
    out_ptr,  # likewise with out strides
    scale_ptr,  # fp32, element (row, col) at (row index . coefficient strides) + col * cs_in
    shift_ptr,
    n_rows,
    n_cols,
    d1,
    d2,
    d3,
    xs0,
    xs1,
    xs2,
    xs3,
    os0,
    os1,
    os2,
    os3,
    cs0,
    cs1,
    cs2,
    cs3,
    cs_in,
    ACT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    # Whole-clip activations pass 2**31 elements (12.8 GB at W1): offsets in int64.
    r = rows.to(tl.int64)
    i3 = r % d3
    r = r // d3
    i2 = r % d2
    r = r // d2
    i1 = r % d1
    i0 = r // d1
    x_row = i0 * xs0 + i1 * xs1 + i2 * xs2 + i3 * xs3
    out_row = i0 * os0 + i1 * os1 + i2 * os2 + i3 * os3
    coef = (i0 * cs0 + i1 * cs1 + i2 * cs2 + i3 * cs3)[:, None] + cols[None, :] * cs_in
    x = tl.load(x_ptr + x_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a = tl.load(scale_ptr + coef, mask=mask, other=0.0)
    b = tl.load(shift_ptr + coef, mask=mask, other=0.0)
    y = x * a + b
    if ACT:
        y = y * tl.sigmoid(y)
    tl.store(out_ptr + out_row[:, None] + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def groupnorm_silu_triton(x: Tensor, scale: Tensor, shift: Tensor, out: Tensor, *, act: bool = True) -> Tensor:
    """The Triton kernel alone, on whatever device x is on (CUDA, or CPU under TRITON_INTERPRET=1). Shapes as
    `groupnorm_silu`; x and out must be unit-stride along W or along C, the same for both."""
    inner = _inner_dim(x, out)
    if inner is None:
        raise ValueError(
            f"groupnorm_silu_triton: expected x and out unit-stride along W or C, found strides {x.stride()} and "
            f"{out.stride()}"
        )
    perm = (0, 1, 2, 3, 4) if inner == 4 else (0, 2, 3, 4, 1)
    xp, op = x.permute(perm), out.permute(perm)
    c = x.shape[1]
    coef_strides = (c, 1, 0, 0, 0)  # scale[b, c] at b * C + c; T, H, W share it
    cs = [coef_strides[p] for p in perm]
    d0, d1, d2, d3, n_cols = xp.shape
    n_rows = d0 * d1 * d2 * d3
    if n_rows == 0 or n_cols == 0:
        return out
    block_c = min(triton.next_power_of_2(n_cols), 1024)
    block_r = max(1, 4096 // block_c)
    grid = (triton.cdiv(n_rows, block_r), triton.cdiv(n_cols, block_c))
    _groupnorm_silu_kernel[grid](
        xp, op, scale, shift, n_rows, n_cols, d1, d2, d3,
        *xp.stride()[:4], *op.stride()[:4], *cs[:4], cs[4],
        ACT=act, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=8 if block_r * block_c >= 4096 else 4,
    )  # fmt: skip
    return out


def groupnorm_silu(x: Tensor, scale: Tensor, shift: Tensor, out: Tensor, *, act: bool = True) -> Tensor:
    """out = silu(x * scale + shift) per (sample, channel), into out (any window of a buffer); returns out.

    x, out: [B, C, T, H, W] bf16/fp16/fp32; scale, shift: contiguous fp32 [B, C]."""
    _check(x, scale, shift, out)
    if x.device.type != "cuda":
        log_reference_once(logger, "groupnorm_silu", x.device.type, "not a CUDA tensor", level=logging.INFO)
        return groupnorm_silu_ref(x, scale, shift, out, act=act)
    if not cuda_at_least(x.device, (8, 0)):
        log_reference_once(logger, "groupnorm_silu", device_label(x.device), "the kernel needs sm_80 or newer")
        return groupnorm_silu_ref(x, scale, shift, out, act=act)
    if _inner_dim(x, out) is None:
        # Expected for the decoder's attention input in the NCDHW layout (tokens are channels-last): not a warning.
        why = "x and out are not both unit-stride along W or along C"
        log_reference_once(logger, "groupnorm_silu", "cuda", why, level=logging.INFO)
        return groupnorm_silu_ref(x, scale, shift, out, act=act)
    return groupnorm_silu_triton(x, scale, shift, out, act=act)
