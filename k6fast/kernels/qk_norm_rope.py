"""Fused per-head RMSNorm + rotary embedding of attention queries and keys, one pass over q or k.

What it holds:
- `rms_norm_rope(x, weight, cos, sin, eps)`: for x [B, N, H, D] (a projection's output viewed per head),
  y = RoPE(RMSNorm(x) * weight) with K6's interleaved channel pairs (2i, 2i+1). The reference sequence runs as
  several passes under eager PyTorch and as one to three Inductor reductions under torch.compile (their cost in a Pro
  block: measurements/sessions/2026-11-29_block-profile/README.md). Here: one read of x, one write of y.
- `rms_norm_rope_ref`: that reference sequence (`F.rms_norm`, then `apply_rope`), the exact maths of the DiT forward,
  which runs it on every path without the fused kernels.
- `apply_rope(x, cos, sin)`: the rotation alone, in fp32 (the reference's second step).

Rounding follows the reference: the normalised, weighted row is rounded once to x's dtype, then rotated in fp32 and
rounded again (the reference hands `apply_rope` the dtype-rounded output of `F.rms_norm`).

Check: `pytest tests/test_qk_norm_rope.py` (CPU + interpreter; `-m gpu` on a GPU machine).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from .fallback import cuda_at_least, kernel_runs

logger = logging.getLogger(__name__)

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _use_triton(device: torch.device) -> bool:
    return kernel_runs(logger, "rms_norm_rope", device, cuda_at_least(device, (8, 0)), "needs CUDA sm_80 or newer")


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding over interleaved channel pairs (2i, 2i+1), rotated in fp32.
    x: [B, N, H, D] (any float dtype); cos, sin: fp32 [N, D // 2] → [B, N, H, D] x.dtype."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    return out.flatten(-2).to(x.dtype)


def rms_norm_rope_ref(
    x: Tensor, weight: Tensor, cos: Tensor | None = None, sin: Tensor | None = None, eps: float | None = None
) -> Tensor:
    """`F.rms_norm(x, (D,), weight.to(x.dtype), eps)`, then `apply_rope(·, cos, sin)` when cos is given: the DiT
    forward's own sequence. eps None: as `nn.RMSNorm(eps=None)` in the reference model (F.rms_norm then uses the
    epsilon of fp32, its computation type).
    x: [B, N, H, D]; weight: [D]; cos, sin: fp32 [N, D // 2] or None → [B, N, H, D] x.dtype."""
    y = F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps)
    return y if cos is None else apply_rope(y, cos, sin)


@triton.jit
def _rms_norm_rope_kernel(
    x_ptr,  # [rows, D] contiguous, rows = B * N * H in (b, n, h) order
    w_ptr,  # [D]
    cos_ptr,  # [N, D // 2] fp32 contiguous (unused without ROPE)
    sin_ptr,
    y_ptr,  # [rows, D] x dtype, contiguous
    n_rows,
    heads,
    tokens,
    eps,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= D
    ROWS: tl.constexpr,
    ROPE: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < D)[None, :]
    offsets = rows.to(tl.int64)[:, None] * D + cols[None, :]
    # Whole rows, loaded and stored contiguously (vectorised); the channel pairs are split apart in registers.
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    # Rounded to the output dtype as F.rms_norm's output is, before the rotation.
    y = (x * rstd[:, None] * w[None, :]).to(y_ptr.dtype.element_ty).to(tl.float32)
    if ROPE:
        y0, y1 = tl.split(tl.reshape(y, (ROWS, BLOCK_D // 2, 2)))
        pairs = tl.arange(0, BLOCK_D // 2)
        token = ((rows // heads) % tokens).to(tl.int64)
        angle = token[:, None] * (D // 2) + pairs[None, :]
        pair_mask = row_ok[:, None] & (pairs < D // 2)[None, :]
        c = tl.load(cos_ptr + angle, mask=pair_mask, other=0.0)
        s = tl.load(sin_ptr + angle, mask=pair_mask, other=0.0)
        y = tl.reshape(tl.join(y0 * c - y1 * s, y0 * s + y1 * c), (ROWS, BLOCK_D))
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_rope_triton(x: Tensor, weight: Tensor, cos: Tensor | None, sin: Tensor | None, eps: float) -> Tensor:
    """The Triton kernel alone, on whatever device x is on (CUDA, or CPU under TRITON_INTERPRET=1).
    Shapes as `rms_norm_rope`; inputs must have passed its checks."""
    b, n, h, d = x.shape
    y = torch.empty_like(x)
    rows = b * n * h
    if rows == 0:
        return y
    block_d = triton.next_power_of_2(d)
    rows_per_program = max(1, 4096 // block_d)  # 4096 values per program: 32 per thread at 4 warps
    rope = cos is not None
    _rms_norm_rope_kernel[(triton.cdiv(rows, rows_per_program),)](
        x, weight, cos if rope else x, sin if rope else x, y, rows, h, n, eps,
        D=d, BLOCK_D=block_d, ROWS=rows_per_program, ROPE=rope, num_warps=4,
    )  # fmt: skip
    return y


@torch.library.custom_op("k6fast::rms_norm_rope", mutates_args=())
def _rms_norm_rope_op(x: Tensor, weight: Tensor, cos: Tensor | None, sin: Tensor | None, eps: float) -> Tensor:
    if _use_triton(x.device):
        return rms_norm_rope_triton(x, weight, cos, sin, eps)
    return rms_norm_rope_ref(x, weight, cos, sin, eps)


@_rms_norm_rope_op.register_fake
def _(x: Tensor, weight: Tensor, cos: Tensor | None, sin: Tensor | None, eps: float) -> Tensor:
    return torch.empty_like(x)


def rms_norm_rope(
    x: Tensor, weight: Tensor, cos: Tensor | None = None, sin: Tensor | None = None, *, eps: float | None = None
) -> Tensor:
    """Per-head RMSNorm with weight, then the rotary embedding when cos/sin are given, in one pass.

    x: [B, N, H, D] bf16/fp16/fp32, contiguous, D even; weight: [D] (any float dtype; used in x's dtype, as the
    reference casts it); cos, sin: fp32 [N, D // 2], contiguous, or both None; eps None: what F.rms_norm(eps=None),
    so `nn.RMSNorm(eps=None)`, uses. Returns [B, N, H, D] x.dtype. Lossless against the reference up to one rounding
    of the last bit. Triton on CUDA sm_80+, the reference elsewhere (logged once)."""
    if x.dtype not in _DTYPES:
        raise ValueError(f"rms_norm_rope: expected x bfloat16, float16 or float32, found {x.dtype}")
    if x.ndim != 4 or x.shape[-1] % 2:
        raise ValueError(f"rms_norm_rope: expected x [B, N, H, D] with D even, found {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"rms_norm_rope: expected a contiguous x, found stride {x.stride()}")
    d, n = x.shape[-1], x.shape[1]
    if weight.shape != (d,) or weight.device != x.device:
        raise ValueError(
            f"rms_norm_rope: expected weight ({d},) on {x.device}, found {tuple(weight.shape)} on {weight.device}"
        )
    if (cos is None) != (sin is None):
        raise ValueError("rms_norm_rope: expected cos and sin both given or both None")
    if cos is not None:
        for name, t in (("cos", cos), ("sin", sin)):
            if t.shape != (n, d // 2) or t.dtype != torch.float32 or not t.is_contiguous() or t.device != x.device:
                raise ValueError(
                    f"rms_norm_rope: expected {name} fp32 contiguous ({n}, {d // 2}) on {x.device}, found "
                    f"{t.dtype} {tuple(t.shape)} on {t.device}"
                )
    # F.rms_norm(eps=None) uses the epsilon of its computation type, fp32 for every input dtype here (not
    # finfo(x.dtype).eps, which its documentation names: bf16's would be 0.0078).
    eps = torch.finfo(torch.float32).eps if eps is None else float(eps)
    # The weight in x's dtype, as the reference uses it (F.rms_norm gets weight.to(x.dtype)).
    return _rms_norm_rope_op(x, weight.to(x.dtype), cos, sin, eps)
