"""FP8 row-wise linear layers for the K6 DiT.

What it holds:
- `quantize_rows_fp8(x)`: one Triton pass per row: absmax, scale = absmax / E4M3_MAX, x · (E4M3_MAX / absmax) rounded
  to e4m3 (`formats.E4M3_MAX`, e4m3's largest value).
- `quantize_weight_fp8(w)`: the same per output channel, at load or (streamed bf16 weights) at use.
- extra columns (`extra_cols`, `residual`) that correct the weight's e4m3 rounding at the activations' largest
  channels; `fp8_outliers.outlier_columns(x, C)` chooses them and says what they buy.
- `fp8_linear(x, wq, w_scale, bias)`: quantize the activation rows, then `torch._scaled_mm` with row-wise scales
  (CUTLASS kernels in PyTorch). Lossy: e4m3 keeps 3 mantissa bits, so each operand carries a few percent RMS
  relative rounding error, and the product of the two more (tests/test_fp8_linear.py's FP8_REL_L2_VS_BF16 bounds
  it on Gaussian data with outlier channels).
- The FP16-accumulate GEMM (`fp16acc_linear`) is fp16acc_linear.py's.

Each public op has a pure-PyTorch `*_ref` beside it with the same signature.

Check: `pytest tests/test_fp8_linear.py` (CPU + interpreter; `-m gpu` on a GPU machine).
Benchmark: `python measurements/bench_gemm.py --out gemm.json`.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl
from torch import Tensor

from .fallback import kernel_runs
from .formats import E4M3_MAX, E4M3_VALUES
from .fp8_outliers import OUTLIER_WIDTH

logger = logging.getLogger(__name__)

# E4M3_MAX as a Triton constant, for the device helpers the fused-quantization kernels share.
_E4M3_MAX_JIT = tl.constexpr(E4M3_MAX)
# An all-zero row gets scale AMAX_FLOOR / E4M3_MAX instead of 0, so dequantization never divides by zero.
AMAX_FLOOR = 1e-12
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# Dispatch: which implementation runs where.
#
#   op                          CPU         CUDA sm_89 / sm_9x / sm_10x / sm_12x     other CUDA
#   quantize_rows_fp8           reference   Triton                                    reference (logged once)
#   fp8_linear (GEMM)           reference   torch._scaled_mm row-wise                 reference (logged once)
#
# PyTorch's row-wise `_scaled_mm` has CUTLASS kernels for sm_89 (Ada), sm_9x (Hopper), sm_10x/sm_11x (datacenter
# Blackwell, Thor) and sm_12x (GeForce/RTX Blackwell, e.g. RTX 5090; added mid-2025 in pytorch#155991) in the torch
# versions k6fast supports (>= 2.11). Triton emits e4m3 conversions natively from sm_89. Older cards have no FP8
# tensor cores at all.
# ---------------------------------------------------------------------------------------------------------------


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def fp8_native(device: torch.device) -> bool:
    """True where FP8 e4m3 tensor cores and row-wise `torch._scaled_mm` exist (CUDA sm_89, sm_9x..sm_12x)."""
    if device.type != "cuda":
        return False
    major, minor = _capability(device)
    return (major, minor) == (8, 9) or major in (9, 10, 11, 12)


def _use_fp8_kernels(op: str, device: torch.device) -> bool:
    return kernel_runs(
        logger,
        op,
        device,
        fp8_native(device),
        "no FP8 tensor cores (needs sm_89 or newer)",
        elsewhere="no FP8 kernels here",
    )


# ---------------------------------------------------------------------------------------------------------------
# Row-wise e4m3 quantization
# ---------------------------------------------------------------------------------------------------------------


def quantize_rows_fp8_ref(
    x: Tensor, extra_cols: Tensor | None = None, residual: bool = False, qmax: float = E4M3_MAX
) -> tuple[Tensor, Tensor]:
    """x: [..., K] bf16/fp16/fp32 → (xq: [..., K + C] float8_e4m3fn, scale: [..., 1] fp32) with x ≈ xq[..., :K] * scale.

    scale = max(absmax(row), 1e-12) / qmax; qmax = E4M3_MAX (e4m3's largest value) unless a GEMM needs a smaller range
    (`fp8_fp16acc.FP16_CHUNK_QMAX`: FP16 accumulation must not overflow); it must be an e4m3 value. The multiplier
    qmax / absmax is computed once per row and applied by multiplication, so the Triton kernel (IEEE division via
    div_rn) reproduces these bits. Both divisions here are tensor / tensor on purpose: PyTorch turns `qmax / t` into
    reciprocal(t) · qmax and, on CUDA, `t / qmax` into t · (1 / qmax), each one rounding more than an IEEE division.

    extra_cols (int [C], or None for C = 0) appends the columns x[..., extra_cols] on the same scale (index -1: a
    zero column): their e4m3 values again, or with `residual` what e4m3 rounding left of them (x·qmax/absmax − its
    e4m3 value, itself in e4m3). See `outlier_columns` for what the two are for.
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(AMAX_FLOOR)
    e4m3_max = torch.full_like(amax, qmax)
    xq = (xf * (e4m3_max / amax)).clamp(-qmax, qmax).to(torch.float8_e4m3fn)
    if extra_cols is not None:
        picked = xf[..., extra_cols.clamp_min(0).long()]
        picked = torch.where(extra_cols >= 0, picked, 0.0)  # -1: a +0 column (x · False would be -0 for x < 0)
        scaled = (picked * (e4m3_max / amax)).clamp(-qmax, qmax)
        extra = scaled.to(torch.float8_e4m3fn)
        if residual:
            extra = (scaled - extra.float()).to(torch.float8_e4m3fn)
        xq = torch.cat([xq, extra], dim=-1)
    return xq, amax / e4m3_max


@triton.jit
def e4m3_scales_to(amax, qmax):
    """Per-row absmax (fp32) → (qmax / absmax, absmax / qmax). div_rn is IEEE division, so the scales match PyTorch
    bit for bit (plain `/` is approximate)."""
    amax = tl.maximum(amax, 1e-12)
    return tl.math.div_rn(qmax, amax), tl.math.div_rn(amax, qmax)


@triton.jit
def e4m3_quantize_to(x, inv_scale, qmax):
    """x fp32 [ROWS, BLOCK] * inv_scale [ROWS] → e4m3, saturated at ±qmax (the product can round just above it)."""
    return tl.clamp(x * inv_scale[:, None], -qmax, qmax).to(tl.float8e4nv)


@triton.jit
def e4m3_scales(amax):
    """Device helper shared with kernels that fuse quantization (adaln): `e4m3_scales_to` with qmax = E4M3_MAX."""
    return e4m3_scales_to(amax, _E4M3_MAX_JIT)


@triton.jit
def e4m3_quantize(x, inv_scale):
    """`e4m3_quantize_to` with qmax = E4M3_MAX (shared with adaln)."""
    return e4m3_quantize_to(x, inv_scale, _E4M3_MAX_JIT)


@triton.jit
def _extra_columns(x_rows, q_rows, cols_ptr, inv, row_ok, K, C: tl.constexpr, RESIDUAL: tl.constexpr, QMAX):
    # The C appended columns (quantize_rows_fp8_ref's extra_cols): x at cols_ptr's channels on the row's scale, as
    # e4m3 again or, with RESIDUAL, what e4m3 rounding left of them.
    j = tl.arange(0, C)
    idx = tl.load(cols_ptr + j)
    v = tl.load(x_rows + tl.maximum(idx, 0)[None, :], mask=row_ok[:, None] & (idx >= 0)[None, :], other=0.0)
    v = v.to(tl.float32)  # padding columns (index -1) are zeros and load nothing
    scaled = tl.clamp(v * inv[:, None], -QMAX, QMAX)
    extra = scaled.to(tl.float8e4nv)
    if RESIDUAL:
        extra = (scaled - extra.to(tl.float32)).to(tl.float8e4nv)
    tl.store(q_rows + K + j[None, :], extra, mask=row_ok[:, None])


@triton.jit
def _quantize_rows_fp8_kernel(
    x_ptr,  # [n_rows, K] bf16/fp16/fp32, row stride stride_x, unit column stride
    q_ptr,  # [n_rows, K + C] e4m3, contiguous
    scale_ptr,  # [n_rows] fp32
    cols_ptr,  # [C] int32: the channels appended after K, -1 for a zero column (any pointer when C == 0)
    n_rows,
    K,
    stride_x,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
    C: tl.constexpr,
    RESIDUAL: tl.constexpr,
    QMAX: tl.constexpr,  # largest quantized magnitude (an e4m3 value; E4M3_MAX unless a GEMM needs a smaller range)
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows64[:, None] * stride_x
    q_rows = q_ptr + rows64[:, None] * (K + C)
    if SINGLE_PASS:
        # The whole row sits in registers: HBM is read once and written once.
        mask = row_ok[:, None] & (cols < K)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        inv, scale = e4m3_scales_to(tl.max(tl.abs(x), axis=1), QMAX)
        tl.store(q_rows + cols[None, :], e4m3_quantize_to(x, inv, QMAX), mask=mask)
    else:
        # Rows longer than one block: the second sweep re-reads the row, which the first sweep just left in L2.
        amax = tl.zeros([ROWS], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask = row_ok[:, None] & (k0 + cols < K)[None, :]
            x = tl.load(x_rows + k0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        inv, scale = e4m3_scales_to(amax, QMAX)
        for k0 in range(0, K, BLOCK_K):
            mask = row_ok[:, None] & (k0 + cols < K)[None, :]
            x = tl.load(x_rows + k0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(q_rows + k0 + cols[None, :], e4m3_quantize_to(x, inv, QMAX), mask=mask)
    if C > 0:
        _extra_columns(x_rows, q_rows, cols_ptr, inv, row_ok, K, C, RESIDUAL, QMAX)
    tl.store(scale_ptr + rows64, scale, mask=row_ok)


# One program holds at most this many fp32 values of a row (64 per thread at 16 warps); longer rows take two sweeps.
MAX_SINGLE_PASS = 16384


def quantize_rows_fp8_triton(
    x: Tensor, extra_cols: Tensor | None = None, residual: bool = False, qmax: float = E4M3_MAX
) -> tuple[Tensor, Tensor]:
    """The Triton kernel alone, on whatever device x is on (CUDA, or CPU under TRITON_INTERPRET=1).
    x: [..., K] bf16/fp16/fp32 with rows contiguous → (xq [..., K + C] e4m3, scale [..., 1] fp32); extra_cols as in
    `quantize_rows_fp8_ref` (int32 [C], C a power of two), and qmax."""
    k = x.shape[-1]
    c = 0 if extra_cols is None else extra_cols.numel()
    x2 = x.reshape(-1, k)
    n_rows = x2.shape[0]
    xq = torch.empty((*x.shape[:-1], k + c), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    if n_rows == 0 or k == 0:
        scale.fill_(AMAX_FLOOR / qmax)
        return xq, scale
    block_k = min(triton.next_power_of_2(k), MAX_SINGLE_PASS)
    rows = max(1, min(4096 // block_k, triton.next_power_of_2(n_rows)))
    num_warps = min(16, max(4, rows * block_k // 1024))
    _quantize_rows_fp8_kernel[(triton.cdiv(n_rows, rows),)](
        x2, xq, scale, scale if extra_cols is None else extra_cols, n_rows, k, x2.stride(0),
        ROWS=rows, BLOCK_K=block_k, SINGLE_PASS=block_k >= k, C=c, RESIDUAL=residual, QMAX=qmax, num_warps=num_warps,
    )  # fmt: skip
    return xq, scale


@torch.library.custom_op("k6fast::quantize_rows_fp8", mutates_args=())
def _quantize_rows_fp8_op(
    x: Tensor, extra_cols: Tensor | None, residual: bool, qmax: float = E4M3_MAX
) -> tuple[Tensor, Tensor]:
    if _use_fp8_kernels("quantize_rows_fp8", x.device):
        return quantize_rows_fp8_triton(x, extra_cols, residual, qmax)
    return quantize_rows_fp8_ref(x, extra_cols, residual, qmax)


@_quantize_rows_fp8_op.register_fake
def _(x: Tensor, extra_cols: Tensor | None, residual: bool, qmax: float = E4M3_MAX) -> tuple[Tensor, Tensor]:
    c = 0 if extra_cols is None else extra_cols.shape[0]
    return (
        x.new_empty((*x.shape[:-1], x.shape[-1] + c), dtype=torch.float8_e4m3fn),
        x.new_empty((*x.shape[:-1], 1), dtype=torch.float32),
    )


def _check_rows(x: Tensor, name: str) -> None:
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: expected dtype bfloat16, float16 or float32, found {x.dtype}")
    if x.ndim < 1:
        raise ValueError(f"{name}: expected a tensor [..., K], found a 0-d tensor")
    if not x.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, found shape {tuple(x.shape)} stride {x.stride()}")


def _check_extra_cols(extra_cols: Tensor | None, device: torch.device) -> None:
    # Shape and dtype only: a range check would read the indices back to the host on every call.
    if extra_cols is None:
        return
    ok = extra_cols.dtype == torch.int32 and extra_cols.ndim == 1 and extra_cols.device == device
    if not ok or extra_cols.numel() != OUTLIER_WIDTH:
        raise ValueError(
            f"extra_cols: expected int32 [{OUTLIER_WIDTH}] on {device}, found {extra_cols.dtype} "
            f"{tuple(extra_cols.shape)} on {extra_cols.device}"
        )


def _check_qmax(qmax: float) -> None:
    # A lookup in the e4m3 values built at import: no tensor and no device read per call.
    if not (qmax > 0.0 and qmax in E4M3_VALUES):
        raise ValueError(f"qmax: expected a positive e4m3 value <= {E4M3_MAX}, found {qmax}")


def quantize_rows_fp8(
    x: Tensor, extra_cols: Tensor | None = None, residual: bool = False, qmax: float = E4M3_MAX
) -> tuple[Tensor, Tensor]:
    """x: [..., K] bf16/fp16/fp32, contiguous → (xq: [..., K + C] float8_e4m3fn, scale: [..., 1] fp32).

    Per-row absmax scaling (x ≈ xq[..., :K] * scale); one read of x and one write of xq; extra_cols (int32 [C]),
    residual and qmax as in `quantize_rows_fp8_ref`. Triton on FP8-capable CUDA devices, the reference elsewhere
    (logged once)."""
    _check_rows(x, "quantize_rows_fp8")
    _check_extra_cols(extra_cols, x.device)
    _check_qmax(qmax)
    return _quantize_rows_fp8_op(x, extra_cols, residual, float(qmax))


def quantize_weight_fp8(
    w: Tensor, residual_cols: Tensor | None = None, qmax: float = E4M3_MAX
) -> tuple[Tensor, Tensor]:
    """w: [N, K] (nn.Linear layout) → (wq: [N, K + C] float8_e4m3fn, scale: [1, N] fp32), one scale per output channel.

    wq stays row-major, so `wq.t()` is the column-major [K, N] operand `_scaled_mm` wants, and [1, N] is the scale
    layout it wants for that operand. residual_cols (int32 [C]) appends what e4m3 rounding left of those input
    channels (`outlier_columns`); qmax as in `quantize_rows_fp8_ref`."""
    if w.ndim != 2:
        raise ValueError(f"quantize_weight_fp8: expected a weight [N, K], found shape {tuple(w.shape)}")
    wq, scale = quantize_rows_fp8(w.contiguous(), residual_cols, residual=True, qmax=qmax)
    return wq, scale.reshape(1, -1)


# ---------------------------------------------------------------------------------------------------------------
# FP8 linear: quantized activations × quantized weights with row-wise scales
# ---------------------------------------------------------------------------------------------------------------

Fp8Input = Tensor | tuple[Tensor, Tensor]


def _check_fp8_operands(
    xq: Tensor, x_scale: Tensor, wq: Tensor, w_scale: Tensor, bias: Tensor | None, out_dtype: torch.dtype
) -> None:
    if xq.dtype != torch.float8_e4m3fn or wq.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_linear: expected float8_e4m3fn operands, found x {xq.dtype}, weight {wq.dtype}")
    if wq.ndim != 2:
        raise ValueError(f"fp8_linear: expected a weight [N, K], found shape {tuple(wq.shape)}")
    n, k = wq.shape
    if xq.ndim < 1 or xq.shape[-1] != k:
        raise ValueError(f"fp8_linear: expected x [..., {k}] to match the weight [N, K={k}], found {tuple(xq.shape)}")
    if k % 16 or n % 16:
        raise ValueError(f"fp8_linear: FP8 tensor cores need K and N to be multiples of 16, found K={k}, N={n}")
    if not xq.is_contiguous() or not wq.is_contiguous():
        raise ValueError("fp8_linear: expected contiguous x and weight (row-major; wq.t() is the column-major operand)")
    if x_scale.dtype != torch.float32 or x_scale.shape != (*xq.shape[:-1], 1) or not x_scale.is_contiguous():
        raise ValueError(
            f"fp8_linear: expected a contiguous float32 x_scale of shape {(*xq.shape[:-1], 1)}, "
            f"found {x_scale.dtype} {tuple(x_scale.shape)}"
        )
    if w_scale.dtype != torch.float32 or w_scale.numel() != n or w_scale.shape not in ((1, n), (n,)):
        raise ValueError(
            f"fp8_linear: expected a float32 w_scale of shape (1, {n}) or ({n},), "
            f"found {w_scale.dtype} {tuple(w_scale.shape)}"
        )
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"fp8_linear: expected out_dtype bfloat16, float16 or float32, found {out_dtype}")
    if bias is not None:
        # The CUTLASS row-wise epilogue adds a bias of the output dtype; fp32 outputs take no bias at all.
        if out_dtype == torch.float32:
            raise ValueError("fp8_linear: a bias needs out_dtype bfloat16 or float16, found float32")
        if bias.shape != (n,) or bias.dtype != out_dtype:
            raise ValueError(f"fp8_linear: expected bias ({n},) {out_dtype}, found {tuple(bias.shape)} {bias.dtype}")
    devices = {t.device for t in (xq, x_scale, wq, w_scale, bias) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"fp8_linear: expected all operands on one device, found {sorted(map(str, devices))}")


def fp8_linear_ref(
    x: Fp8Input,
    wq: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """The same quantized product as `fp8_linear`, computed in fp32 from dequantized operands.

    x: [..., K] float (quantized here with `quantize_rows_fp8_ref`) or (xq [..., K] e4m3, x_scale [..., 1] fp32);
    wq: [N, K] e4m3; w_scale: [1, N] or [N] fp32; bias: [N] or None → [..., N] out_dtype. The exact
    product of the quantized operands (no fast accumulation); fp32 matmuls here follow PyTorch's TF32 setting (off
    by default)."""
    xq, x_scale = x if isinstance(x, tuple) else quantize_rows_fp8_ref(x)
    n, k = wq.shape
    a = xq.reshape(-1, k).float() * x_scale.reshape(-1, 1)
    b = wq.float() * w_scale.reshape(n, 1)
    y = a @ b.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype).reshape(*xq.shape[:-1], n)


# The GEMM is a custom op so that the architecture dispatch (and its once-logged fallback) stays out of traced graphs.
@torch.library.custom_op("k6fast::fp8_rowwise_mm", mutates_args=())
def _fp8_rowwise_mm_op(
    xq: Tensor,
    x_scale: Tensor,
    wq: Tensor,
    w_scale: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
    fast_accum: bool,
) -> Tensor:
    """xq [M, K] e4m3 row-major, x_scale [M, 1] fp32, wq [N, K] e4m3 row-major, w_scale [1, N] fp32 → [M, N]."""
    if _use_fp8_kernels("fp8_linear", xq.device):
        # wq.t() is [K, N] column-major, the layout cuBLASLt/CUTLASS FP8 kernels require for the second operand.
        return torch._scaled_mm(
            xq, wq.t(), scale_a=x_scale, scale_b=w_scale, bias=bias, out_dtype=out_dtype, use_fast_accum=fast_accum
        )
    return fp8_linear_ref((xq, x_scale), wq, w_scale, bias, out_dtype)  # exact: fast_accum has no meaning here


@_fp8_rowwise_mm_op.register_fake
def _(
    xq: Tensor,
    x_scale: Tensor,
    wq: Tensor,
    w_scale: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
    fast_accum: bool,
) -> Tensor:
    return xq.new_empty((xq.shape[0], wq.shape[0]), dtype=out_dtype)


def fp8_linear(
    x: Fp8Input,
    wq: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    fast_accum: bool = False,
) -> Tensor:
    """y = x @ w.t() (+ bias) with FP8 e4m3 operands and row-wise scales. Lossy (see the module docstring).

    x: [..., K] bf16/fp16/fp32 activations, quantized per row here (one Triton pass), or a precomputed
    (xq [..., K] e4m3, x_scale [..., 1] fp32), e.g. from `layernorm_modulate(..., out_fp8=True)`;
    wq: [N, K] e4m3 and w_scale: [1, N] (or [N]) fp32 from `quantize_weight_fp8`; bias: [N] of out_dtype or None.
    K and N must be multiples of 16. Returns [..., N] out_dtype (bf16 by default).

    `fast_accum=True` lets Hopper accumulate inside the tensor core's reduced-precision accumulator across the whole
    K loop (faster, less exact); the default promotes to fp32 every few K steps.
    Native (`torch._scaled_mm`) on sm_89 / sm_9x / sm_10x / sm_12x; the reference elsewhere (logged once)."""
    if isinstance(x, tuple):
        xq, x_scale = x
    else:
        _check_rows(x, "fp8_linear")
        xq, x_scale = quantize_rows_fp8(x)
    _check_fp8_operands(xq, x_scale, wq, w_scale, bias, out_dtype)
    n, k = wq.shape
    y = _fp8_rowwise_mm_op(
        xq.reshape(-1, k), x_scale.reshape(-1, 1), wq, w_scale.reshape(1, n), bias, out_dtype, fast_accum
    )
    return y.reshape(*xq.shape[:-1], n)
