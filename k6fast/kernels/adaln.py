"""Fused AdaLN modulation and gated residual for the K6 DiT blocks.

What it holds:
- `layernorm_modulate(x, scale, shift)`: y = bf16(LN(x.float()) * (1 + scale) + shift), LayerNorm without affine,
  all in fp32: diffusers' `apply_scale_shift(norm(x.float()), x, scale, shift)` in one read of x and one write of
  y (PyTorch runs it as six kernels moving ~36 bytes per element instead of 4). With `out_fp8=True` it writes e4m3
  plus a per-row scale for the FP8 GEMM that follows instead of bf16.
- `gated_residual(x, out, gate)` / `gated_residual_` (in place into x): y = bf16(x.float() + gate.float() *
  out.float()), diffusers' `apply_gate_sum`, in one pass (6 bytes per element instead of ~38).
- `gated_residual_modulate(x, out, gate, scale, shift)`: the two above back to back, as the DiT blocks call them
  (a residual, then the next sub-layer's modulation of the same stream), in one pass over the rows: x_new and h
  bit-identical to `gated_residual` then `layernorm_modulate`, 8 bytes per element instead of 10 and one launch.

Each has a pure-PyTorch `*_ref` beside it with the same signature; those are the exact diffusers math.

Check: `pytest tests/test_adaln.py` (CPU + interpreter; `-m gpu` on a GPU machine).
Benchmark: `python measurements/bench_elementwise.py --out elementwise.json`.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from .adaln_layout import _check_activation, _modulation_layout, _per_sample, row_tile
from .fallback import cuda_at_least, kernel_runs
from .fp8_linear import e4m3_quantize, e4m3_scales, fp8_native, quantize_rows_fp8_ref

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------------------------
# Dispatch: which implementation runs where.
#
#   op                                   CPU / other   CUDA sm_80+                          CUDA below sm_80
#   layernorm_modulate, gated_residual(_) reference     Triton                               reference (logged once)
#   gated_residual_modulate
#   layernorm_modulate(out_fp8=True)      reference     Triton on sm_89+ (e4m3 conversion),  reference (logged once)
#                                                       reference on sm_80/86 (logged once)
# ---------------------------------------------------------------------------------------------------------------


def _use_triton(op: str, device: torch.device, need_fp8: bool) -> bool:
    if need_fp8 and device.type == "cuda" and not fp8_native(device):
        return kernel_runs(logger, op, device, False, "e4m3 conversion needs sm_89 or newer")
    return kernel_runs(logger, op, device, cuda_at_least(device, (8, 0)), "bf16 kernels need sm_80 or newer")


# ---------------------------------------------------------------------------------------------------------------
# layernorm_modulate
# ---------------------------------------------------------------------------------------------------------------


# fp32 values per program of the norm kernels: a 4096-wide K6 row, 16 values per thread at 8 warps, stays in
# registers. Both norm kernels use it, so the fused residual + norm reduces each row exactly as the norm alone does.
NORM_TILE = 4096


def layernorm_modulate_ref(
    x: Tensor, scale: Tensor, shift: Tensor, *, eps: float = 1e-5, out_fp8: bool = False
) -> Tensor | tuple[Tensor, Tensor]:
    """diffusers' `apply_scale_shift(LayerNorm(D, elementwise_affine=False)(x.float()), x, scale, shift)`.

    x: [..., D] bf16 (fp16/fp32 allowed); scale, shift: [D], [1, D] or [B, D] with x [B, ..., D], fp32 or bf16
    → [..., D] x.dtype; with out_fp8 → `quantize_rows_fp8_ref` of that (e4m3 [..., D], fp32 scale [..., 1])."""
    normed = F.layer_norm(x.float(), (x.shape[-1],), eps=eps)
    scale, shift = _per_sample(scale, x), _per_sample(shift, x)
    y = (normed * (scale.float() + 1.0) + shift.float()).to(dtype=x.dtype)
    return quantize_rows_fp8_ref(y) if out_fp8 else y


@triton.jit
def _modulate_rows(
    x,  # [ROWS, BLOCK_D] fp32, padding lanes (mask False) 0
    mask,
    sample,  # [ROWS] int64: each row's modulation sample
    cols,
    D,
    scale_ptr,
    stride_scale_b,
    stride_scale_d,
    shift_ptr,
    stride_shift_b,
    stride_shift_d,
    eps,
):
    """LN(x) * (1 + scale) + shift in fp32, [ROWS, BLOCK_D]. Shared by both norm kernels, so that with the same tile
    and warps they reduce in the same order and round alike."""
    # Two-pass moments over the row held in registers: no E[x²] - E[x]² cancellation for rows with a large mean.
    mean = tl.sum(x, axis=1) / D
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.math.rsqrt(tl.sum(xc * xc, axis=1) / D + eps)
    scale = tl.load(scale_ptr + sample[:, None] * stride_scale_b + cols[None, :] * stride_scale_d, mask=mask, other=0.0)
    shift = tl.load(shift_ptr + sample[:, None] * stride_shift_b + cols[None, :] * stride_shift_d, mask=mask, other=0.0)
    # Same order as diffusers: normed * (scale + 1) + shift in fp32, one rounding to the output dtype at the end.
    return (xc * rstd[:, None]) * (scale.to(tl.float32) + 1.0) + shift.to(tl.float32)


@triton.jit
def _layernorm_modulate_kernel(
    x_ptr,  # [n_rows, D] bf16/fp16/fp32, row stride stride_x, unit column stride
    scale_ptr,  # modulation, element (sample, d) at sample * stride_scale_b + d * stride_scale_d
    shift_ptr,
    y_ptr,  # [n_rows, D] x dtype, or e4m3 when OUT_FP8; contiguous
    q_scale_ptr,  # [n_rows] fp32 when OUT_FP8, else unused
    n_rows,
    D,
    rows_per_sample,
    stride_x,
    stride_scale_b,
    stride_scale_d,
    stride_shift_b,
    stride_shift_d,
    eps,
    OUT_FP8: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < D)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    sample = (rows // rows_per_sample).to(tl.int64)
    y = _modulate_rows(
        x, mask, sample, cols, D, scale_ptr, stride_scale_b, stride_scale_d, shift_ptr, stride_shift_b, stride_shift_d,
        eps,
    )  # fmt: skip

    out_offsets = rows64[:, None] * D + cols[None, :]
    if OUT_FP8:
        # Quantize exactly the values the bf16 path would hand the GEMM (rounded to x's dtype first), so the fused
        # and unfused paths feed the FP8 GEMM the same operands. Padding lanes are 0 and do not affect the absmax.
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
        inv, q_scale = e4m3_scales(tl.max(tl.abs(y), axis=1))
        tl.store(y_ptr + out_offsets, e4m3_quantize(y, inv), mask=mask)
        tl.store(q_scale_ptr + rows64, q_scale, mask=row_ok)
    else:
        tl.store(y_ptr + out_offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


def layernorm_modulate_triton(
    x: Tensor, scale: Tensor, shift: Tensor, *, eps: float = 1e-5, out_fp8: bool = False
) -> Tensor | tuple[Tensor, Tensor]:
    """The Triton kernel alone, on whatever device x is on (CUDA, or CPU under TRITON_INTERPRET=1).
    Shapes and dtypes as `layernorm_modulate`; inputs must have passed its checks."""
    d = x.shape[-1]
    n_rows = x.numel() // d if d else 0
    sb, sd, scale_rows = _modulation_layout(x, scale, "layernorm_modulate", "scale")
    hb, hd, shift_rows = _modulation_layout(x, shift, "layernorm_modulate", "shift")
    # A per-sample [B, D] vector's rows per sample, else all rows: broadcast vectors have batch stride 0, so any of
    # them reads the right row at that granularity.
    rows_per_sample = min(scale_rows, shift_rows)
    if out_fp8:
        y = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        q_scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    else:
        y = torch.empty_like(x)
        q_scale = y  # unused by the kernel when OUT_FP8 is False
    if n_rows == 0:
        return (y, q_scale) if out_fp8 else y
    block_d, rows, num_warps = row_tile(d, n_rows, NORM_TILE)
    _layernorm_modulate_kernel[(triton.cdiv(n_rows, rows),)](
        x, scale, shift, y, q_scale, n_rows, d, rows_per_sample, d, sb, sd, hb, hd, eps,
        OUT_FP8=out_fp8, ROWS=rows, BLOCK_D=block_d, num_warps=num_warps,
    )  # fmt: skip
    return (y, q_scale) if out_fp8 else y


@torch.library.custom_op("k6fast::layernorm_modulate", mutates_args=())
def _layernorm_modulate_op(x: Tensor, scale: Tensor, shift: Tensor, eps: float) -> Tensor:
    if _use_triton("layernorm_modulate", x.device, need_fp8=False):
        return layernorm_modulate_triton(x, scale, shift, eps=eps)
    return layernorm_modulate_ref(x, scale, shift, eps=eps)


@_layernorm_modulate_op.register_fake
def _(x: Tensor, scale: Tensor, shift: Tensor, eps: float) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("k6fast::layernorm_modulate_fp8", mutates_args=())
def _layernorm_modulate_fp8_op(x: Tensor, scale: Tensor, shift: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    if _use_triton("layernorm_modulate(out_fp8=True)", x.device, need_fp8=True):
        return layernorm_modulate_triton(x, scale, shift, eps=eps, out_fp8=True)
    return layernorm_modulate_ref(x, scale, shift, eps=eps, out_fp8=True)


@_layernorm_modulate_fp8_op.register_fake
def _(x: Tensor, scale: Tensor, shift: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


def layernorm_modulate(
    x: Tensor, scale: Tensor, shift: Tensor, *, eps: float = 1e-5, out_fp8: bool = False
) -> Tensor | tuple[Tensor, Tensor]:
    """y = LN(x.float()) * (1 + scale) + shift in fp32, rounded once to x.dtype (LayerNorm without affine).

    x: [..., tokens, D] bf16 (fp16/fp32 allowed), contiguous; scale, shift: [D], [1, D], or [B, D] with
    x [B, ..., D]; fp32 (K6's modulation layers stay fp32) or bf16, any strides (chunks of the modulation output
    are fine). Returns [..., D] x.dtype, or with `out_fp8=True` (y rounded to x.dtype, then quantized per row:
    e4m3 [..., D], fp32 scale [..., 1]) ready for `fp8_linear((yq, y_scale), ...)`. Lossless without out_fp8.

    Triton on CUDA sm_80+ (out_fp8: sm_89+), the reference elsewhere (logged once)."""
    op = "layernorm_modulate"
    _check_activation(x, op)
    _modulation_layout(x, scale, op, "scale")
    _modulation_layout(x, shift, op, "shift")
    if out_fp8:
        return _layernorm_modulate_fp8_op(x, scale, shift, eps)
    return _layernorm_modulate_op(x, scale, shift, eps)


# ---------------------------------------------------------------------------------------------------------------
# gated_residual
# ---------------------------------------------------------------------------------------------------------------


def gated_residual_ref(x: Tensor, out: Tensor, gate: Tensor) -> Tensor:
    """diffusers' `apply_gate_sum`: x [..., D], out [..., D], gate [D], [1, D] or [B, D] with x [B, ..., D]
    → bf16(x.float() + gate.float() * out.float()) in x.dtype. Also the reference of the in-place variant."""
    return (x.float() + _per_sample(gate, x).float() * out.float()).to(dtype=x.dtype)


@triton.jit
def _gated_rows(
    x_ptr, out_ptr, gate_ptr, n_rows, D, rows_per_sample, stride_gate_b, stride_gate_d,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """This program's rows of x + gate * out in fp32 (padding lanes 0), with their offsets, mask, columns and
    modulation samples. Shared by both residual kernels, so they compute the residual alike."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    offsets = rows.to(tl.int64)[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    out = tl.load(out_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    sample = (rows // rows_per_sample).to(tl.int64)
    gate = tl.load(gate_ptr + sample[:, None] * stride_gate_b + cols[None, :] * stride_gate_d, mask=mask, other=0.0)
    return x + gate.to(tl.float32) * out, offsets, mask, cols, sample


@triton.jit
def _gated_residual_kernel(
    x_ptr,  # [n_rows, D] contiguous
    out_ptr,  # [n_rows, D] contiguous, any float dtype
    gate_ptr,  # element (sample, d) at sample * stride_gate_b + d * stride_gate_d
    y_ptr,  # [n_rows, D] x dtype, contiguous; may be x_ptr (in place: each element is read before it is written)
    n_rows,
    D,
    rows_per_sample,
    stride_gate_b,
    stride_gate_d,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    y, offsets, mask, _, _ = _gated_rows(
        x_ptr, out_ptr, gate_ptr, n_rows, D, rows_per_sample, stride_gate_b, stride_gate_d, ROWS, BLOCK_D
    )
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


def gated_residual_triton(x: Tensor, out: Tensor, gate: Tensor, *, inplace: bool = False) -> Tensor:
    """The Triton kernel alone, on whatever device x is on (CUDA, or CPU under TRITON_INTERPRET=1).
    Shapes and dtypes as `gated_residual`; with inplace=True the result is written into x, which is returned."""
    d = x.shape[-1]
    n_rows = x.numel() // d if d else 0
    gb, gd, rows_per_sample = _modulation_layout(x, gate, "gated_residual", "gate")
    y = x if inplace else torch.empty_like(x)
    if n_rows == 0:
        return y
    # 8192 elements per program: pure streaming, so larger tiles than the norm (which keeps fp32 rows live).
    block_d, rows, num_warps = row_tile(d, n_rows, 8192)
    _gated_residual_kernel[(triton.cdiv(n_rows, rows),)](
        x, out, gate, y, n_rows, d, rows_per_sample, gb, gd, ROWS=rows, BLOCK_D=block_d, num_warps=num_warps
    )
    return y


@torch.library.custom_op("k6fast::gated_residual", mutates_args=())
def _gated_residual_op(x: Tensor, out: Tensor, gate: Tensor) -> Tensor:
    if _use_triton("gated_residual", x.device, need_fp8=False):
        return gated_residual_triton(x, out, gate)
    return gated_residual_ref(x, out, gate)


@_gated_residual_op.register_fake
def _(x: Tensor, out: Tensor, gate: Tensor) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("k6fast::gated_residual_", mutates_args=("x",))
def _gated_residual_inplace_op(x: Tensor, out: Tensor, gate: Tensor) -> None:
    if _use_triton("gated_residual_", x.device, need_fp8=False):
        gated_residual_triton(x, out, gate, inplace=True)
    else:
        x.copy_(gated_residual_ref(x, out, gate))


@_gated_residual_inplace_op.register_fake
def _(x: Tensor, out: Tensor, gate: Tensor) -> None:
    return None


def _check_gated_residual(x: Tensor, out: Tensor, gate: Tensor, op: str) -> None:
    _check_activation(x, op)
    _check_activation(out, op, "out")
    if out.shape != x.shape or out.device != x.device:
        raise ValueError(
            f"{op}: expected out {tuple(x.shape)} on {x.device} like x, found {tuple(out.shape)} on {out.device}"
        )
    _modulation_layout(x, gate, op, "gate")


def gated_residual(x: Tensor, out: Tensor, gate: Tensor) -> Tensor:
    """y = x.float() + gate.float() * out.float(), rounded once to x.dtype. Lossless.

    x: [..., tokens, D] bf16 (fp16/fp32 allowed), contiguous; out: like x (any float dtype), contiguous;
    gate: [D], [1, D] or [B, D] with x [B, ..., D], fp32 or bf16, any strides. Returns a new [..., D] x.dtype.
    Triton on CUDA sm_80+, the reference elsewhere (logged once)."""
    _check_gated_residual(x, out, gate, "gated_residual")
    return _gated_residual_op(x, out, gate)


def gated_residual_(x: Tensor, out: Tensor, gate: Tensor) -> Tensor:
    """`gated_residual` written into x (saves the allocation and lets the residual stream stay in one buffer).
    Same shapes; returns x. `out` must not overlap x."""
    _check_gated_residual(x, out, gate, "gated_residual_")
    _gated_residual_inplace_op(x, out, gate)
    return x


# ---------------------------------------------------------------------------------------------------------------
# gated_residual_modulate: gated_residual, then layernorm_modulate of its result, in one pass
# ---------------------------------------------------------------------------------------------------------------


def gated_residual_modulate_ref(
    x: Tensor, out: Tensor, gate: Tensor, scale: Tensor, shift: Tensor, *, eps: float = 1e-5
) -> tuple[Tensor, Tensor]:
    """`gated_residual_ref` then `layernorm_modulate_ref` of its result. Shapes as `gated_residual_modulate`."""
    x_new = gated_residual_ref(x, out, gate)
    return x_new, layernorm_modulate_ref(x_new, scale, shift, eps=eps)


@triton.jit
def _gated_residual_modulate_kernel(
    x_ptr,  # [n_rows, D] contiguous
    out_ptr,  # [n_rows, D] contiguous, any float dtype
    gate_ptr,  # modulation vectors: element (sample, d) at sample * stride_b + d * stride_d
    scale_ptr,
    shift_ptr,
    x_new_ptr,  # [n_rows, D] x dtype, contiguous
    y_ptr,  # [n_rows, D] x dtype, contiguous
    n_rows,
    D,
    rows_per_sample,
    stride_gate_b,
    stride_gate_d,
    stride_scale_b,
    stride_scale_d,
    stride_shift_b,
    stride_shift_d,
    eps,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    x_new, offsets, mask, cols, sample = _gated_rows(
        x_ptr, out_ptr, gate_ptr, n_rows, D, rows_per_sample, stride_gate_b, stride_gate_d, ROWS, BLOCK_D
    )
    # Rounded to x's dtype as _gated_residual_kernel stores it: the norm below reads exactly what
    # _layernorm_modulate_kernel would load. Padding lanes are 0 + 0 * 0 = 0, as the norm needs.
    x_new = x_new.to(x_new_ptr.dtype.element_ty)
    tl.store(x_new_ptr + offsets, x_new, mask=mask)
    y = _modulate_rows(
        x_new.to(tl.float32), mask, sample, cols, D, scale_ptr, stride_scale_b, stride_scale_d, shift_ptr,
        stride_shift_b, stride_shift_d, eps,
    )  # fmt: skip
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


def gated_residual_modulate_triton(
    x: Tensor, out: Tensor, gate: Tensor, scale: Tensor, shift: Tensor, *, eps: float = 1e-5
) -> tuple[Tensor, Tensor]:
    """The Triton kernel alone, on whatever device x is on (CUDA, or CPU under TRITON_INTERPRET=1).
    Shapes and dtypes as `gated_residual_modulate`; inputs must have passed its checks."""
    op = "gated_residual_modulate"
    d = x.shape[-1]
    n_rows = x.numel() // d if d else 0
    gb, gd, gate_rows = _modulation_layout(x, gate, op, "gate")
    sb, sd, scale_rows = _modulation_layout(x, scale, op, "scale")
    hb, hd, shift_rows = _modulation_layout(x, shift, op, "shift")
    rows_per_sample = min(gate_rows, scale_rows, shift_rows)  # as in layernorm_modulate_triton
    x_new, y = torch.empty_like(x), torch.empty_like(x)
    if n_rows == 0:
        return x_new, y
    # The norm kernel's tile and warps (not the residual kernel's larger tile): the same reduction tree per row.
    block_d, rows, num_warps = row_tile(d, n_rows, NORM_TILE)
    _gated_residual_modulate_kernel[(triton.cdiv(n_rows, rows),)](
        x, out, gate, scale, shift, x_new, y, n_rows, d, rows_per_sample, gb, gd, sb, sd, hb, hd, eps,
        ROWS=rows, BLOCK_D=block_d, num_warps=num_warps,
    )  # fmt: skip
    return x_new, y


@torch.library.custom_op("k6fast::gated_residual_modulate", mutates_args=())
def _gated_residual_modulate_op(
    x: Tensor, out: Tensor, gate: Tensor, scale: Tensor, shift: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    if _use_triton("gated_residual_modulate", x.device, need_fp8=False):
        return gated_residual_modulate_triton(x, out, gate, scale, shift, eps=eps)
    return gated_residual_modulate_ref(x, out, gate, scale, shift, eps=eps)


@_gated_residual_modulate_op.register_fake
def _(x: Tensor, out: Tensor, gate: Tensor, scale: Tensor, shift: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


def gated_residual_modulate(
    x: Tensor, out: Tensor, gate: Tensor, scale: Tensor, shift: Tensor, *, eps: float = 1e-5
) -> tuple[Tensor, Tensor]:
    """x_new = `gated_residual(x, out, gate)`, h = `layernorm_modulate(x_new, scale, shift, eps=eps)`, in one pass:
    both bit-identical to those two calls (the same expressions, the norm's tile and reduction order). Lossless.

    x: [..., tokens, D] bf16 (fp16/fp32 allowed), contiguous; out: like x (any float dtype), contiguous; gate,
    scale, shift: [D], [1, D] or [B, D] with x [B, ..., D], fp32 or bf16, any strides. Returns (x_new, h), both new
    [..., D] x.dtype. Triton on CUDA sm_80+, the reference elsewhere (logged once)."""
    op = "gated_residual_modulate"
    _check_gated_residual(x, out, gate, op)
    _modulation_layout(x, scale, op, "scale")
    _modulation_layout(x, shift, op, "shift")
    return _gated_residual_modulate_op(x, out, gate, scale, shift, eps)
