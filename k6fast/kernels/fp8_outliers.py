"""Outlier columns for the fp8 GEMM: which input channels get their weight rounding corrected.

With per-row activation and per-channel weight scales each e4m3 operand carries a few percent RMS relative rounding
error, more on the product. In a DiT a few input channels carry most of the activations' energy (outlier channels),
so most of the weight rounding's contribution to the output comes from those channels' weight columns. Appending C
columns to both operands, x's values at the C largest channels and what e4m3 rounding left of w's columns there (in
e4m3 on the same scales; `fp8_linear.quantize_rows_fp8(..., extra_cols, residual)`), adds that remainder back and
lowers the layer's error on DiT-like inputs (nothing is gained on inputs without outlier channels).

The block appended is 128 wide (the C chosen channels, then zero columns) so K stays a multiple of 128: with K + 16,
cuBLAS's FP8 GEMM left its fast kernel. On an H200 with 32 channels and the kernels below the corrected layer kept
nearly all of plain fp8's speed at the three W1 shapes for a clearly lower error
(measurements/sessions/2026-11-29_fp8-outliers/README.md, run 17).

The channels are chosen per call from the absmax of every 64th row. `outlier_columns` runs two Triton kernels on
CUDA: a column absmax over the sampled rows split across ~1024 programs (merged by an integer atomic max on the
bits), and one program that finds the C-th largest value by bisection on its bits and writes the chosen channels in
ascending order, where torch's strided reduction + topk ran one thread block on one long row and cost a visible
share of the layer (same record).
`outlier_columns_ref` is the same choice in PyTorch (ties go to the lower channel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

OUTLIER_COUNTS = (0, 16, 32, 64)  # C: how many channels get corrected (0: off)
OUTLIER_WIDTH = 128  # columns appended when C > 0: C chosen, the rest zeros, so K stays a multiple of 128
ROW_STRIDE = 64  # rows sampled for the channel absmax: outlier channels are outliers on every token
_MAX_SELECT_BLOCK = 1 << 14  # widest K the one-program selection was tested at on a GPU; wider runs the reference
ABSMAX_COLUMNS = 128
ABSMAX_ROWS = 32  # sampled rows per load: 8 KB of bf16 in flight per program
_ABSMAX_PROGRAMS = 1024  # column blocks × row splits aimed at: enough loads in flight to run at HBM bandwidth


def outlier_columns_ref(x: Tensor, count: int) -> Tensor:
    """x [..., K] → int32 [OUTLIER_WIDTH]: the `count` channels with the largest absmax over every 64th row (ties to
    the lower channel) in ascending order, then -1s (zero columns). Fewer than `count` when K < count."""
    flat = x.reshape(-1, x.shape[-1])
    sampled = flat[::ROW_STRIDE]
    amax = sampled.abs().amax(dim=0).float() if len(sampled) else flat.new_zeros(flat.shape[-1], dtype=torch.float32)
    order = torch.sort(amax, descending=True, stable=True).indices  # stable: equal values keep channel order
    chosen = order[: min(count, amax.numel())].sort().values.to(torch.int32)
    return torch.cat([chosen, chosen.new_full((OUTLIER_WIDTH - chosen.numel(),), -1)])


@triton.jit
def _sampled_column_absmax_kernel(
    x_ptr,  # [n_rows, K], unit column stride
    amax_ptr,  # [K] int32, zeros: the bits of each column's absmax over the sampled rows (atomic max)
    n_sampled,
    K,
    stride_sample,  # elements between two sampled rows (ROW_STRIDE rows)
    SPLIT: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < K
    amax = tl.zeros([BLOCK_C], dtype=tl.float32)
    for first in range(tl.program_id(1) * ROWS, n_sampled, SPLIT * ROWS):
        rows = first + tl.arange(0, ROWS)
        ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_sample + cols[None, :]
        v = tl.load(ptrs, mask=(rows < n_sampled)[:, None] & col_ok[None, :], other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(v.to(tl.float32)), axis=0))
    # Non-negative floats order like their bits as integers, so an integer atomic max merges the row splits exactly.
    tl.atomic_max(amax_ptr + cols, amax.to(tl.int32, bitcast=True), mask=col_ok)


@triton.jit
def _select_top_channels_kernel(
    amax_ptr,  # [K] int32: bits of non-negative floats
    out_ptr,  # [WIDTH] int32
    K,
    COUNT: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    cols = tl.arange(0, BLOCK)
    bits = tl.load(amax_ptr + cols, mask=cols < K, other=-1)  # padding columns: -1, never chosen
    want = tl.minimum(K, COUNT)
    # Bisection for T, the want-th largest value: count(bits >= lo) >= want > count(bits >= hi).
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0x7F800001, tl.int32)  # above +inf
    for _ in range(31):
        mid = lo + (hi - lo) // 2
        if tl.sum((bits >= mid).to(tl.int32)) >= want:
            lo = mid
        else:
            hi = mid
    above = bits > lo
    ties = bits == lo
    # All channels above T, then the lowest-indexed channels equal to T up to `want`, stored in channel order.
    chosen = above | (ties & (tl.cumsum(ties.to(tl.int32), axis=0) <= want - tl.sum(above.to(tl.int32))))
    slot = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
    tl.store(out_ptr + slot, cols, mask=chosen)
    pad = tl.arange(0, WIDTH)
    tl.store(out_ptr + pad, tl.full([WIDTH], -1, tl.int32), mask=pad >= want)


def outlier_columns_triton(x: Tensor, count: int) -> Tensor:
    """`outlier_columns_ref` on a CUDA x [..., K] (contiguous rows) in two Triton launches (and a zero fill)."""
    flat = x.reshape(-1, x.shape[-1])
    n_rows, k = flat.shape
    n_sampled = triton.cdiv(n_rows, ROW_STRIDE)
    col_blocks = triton.cdiv(k, ABSMAX_COLUMNS)
    split = max(1, min(_ABSMAX_PROGRAMS // col_blocks, triton.cdiv(n_sampled, ABSMAX_ROWS)))
    amax_bits = torch.zeros(k, dtype=torch.int32, device=x.device)
    _sampled_column_absmax_kernel[(col_blocks, split)](
        flat, amax_bits, n_sampled, k, flat.stride(0) * ROW_STRIDE,
        SPLIT=split, ROWS=ABSMAX_ROWS, BLOCK_C=ABSMAX_COLUMNS, num_warps=4,
    )  # fmt: skip
    out = torch.empty(OUTLIER_WIDTH, dtype=torch.int32, device=x.device)
    block = triton.next_power_of_2(k)
    warps = 16 if block >= 8192 else 8
    _select_top_channels_kernel[(1,)](amax_bits, out, k, COUNT=count, WIDTH=OUTLIER_WIDTH, BLOCK=block, num_warps=warps)
    return out


@torch.library.custom_op("k6fast::outlier_columns", mutates_args=())
def _outlier_columns_op(x: Tensor, count: int) -> Tensor:
    if x.is_cuda and triton.next_power_of_2(x.shape[-1]) <= _MAX_SELECT_BLOCK:
        return outlier_columns_triton(x, count)
    return outlier_columns_ref(x, count)


@_outlier_columns_op.register_fake
def _(x: Tensor, count: int) -> Tensor:
    return x.new_empty((OUTLIER_WIDTH,), dtype=torch.int32)


def outlier_columns(x: Tensor, count: int) -> Tensor | None:
    """The `count` input channels of x [..., K] with the largest absmax over every 64th row, in ascending order, then
    -1s (zero columns): int32 [OUTLIER_WIDTH] for `quantize_rows_fp8` / `quantize_weight_fp8`; None when count is 0.
    Triton on CUDA, the reference elsewhere; both choose the same channels (ties go to the lower channel)."""
    if count not in OUTLIER_COUNTS:
        raise ValueError(f"outlier_columns: expected count in {OUTLIER_COUNTS}, found {count}")
    if count == 0:
        return None
    if x.ndim < 1 or x.shape[-1] == 0 or not x.is_contiguous():
        raise ValueError(f"outlier_columns: expected a contiguous tensor [..., K > 0], found shape {tuple(x.shape)}")
    return _outlier_columns_op(x, count)
