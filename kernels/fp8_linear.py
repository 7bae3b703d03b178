"""FP8 row-wise linear layers and the FP16-accumulate GEMM for the K6 DiT.

What it holds:
- `quantize_rows_fp8(x)`: one Triton pass per row: absmax, scale = absmax / 448, x · (448 / absmax) rounded to e4m3.
- `quantize_weight_fp8(w)`: the same per output channel, at load or (streamed bf16 weights) at use.
- extra columns (`extra_cols`, `residual`) that correct the weight's e4m3 rounding at the activations' largest
  channels; `fp8_outliers.outlier_columns(x, C)` chooses them and says what they buy.
- `fp8_linear(x, wq, w_scale, bias)`: quantize the activation rows, then `torch._scaled_mm` with row-wise scales
  (CUTLASS kernels in PyTorch). Lossy: e4m3 keeps 3 mantissa bits, so each operand carries about 2.5% RMS
  relative rounding error and a product of incoherent sums about 3.5% (CPU measurement, Gaussian data with
  outlier channels).
- `fp16acc_linear(x, w, bias)`: a Triton GEMM on FP16 operands that accumulates in FP16 inside each K chunk and
  in FP32 across chunks. Only GeForce cards (sm_89, sm_120) run FP16-accumulate MMA at twice the FP32-accumulate
  rate; on datacenter cards (A100/H100/H200/B200) both rates are equal, so this kernel has no speed gain there.
  On sm_90 the default 64-wide chunk runs a Gluon wgmma kernel instead (kernels/fp16acc_wgmma.py).

Each public op has a pure-PyTorch `*_ref` beside it with the same signature.

Check: `pytest tests/test_fp8_linear.py` (CPU + interpreter; `-m gpu` on a GPU machine).
Benchmark: `python measurements/bench_gemm.py --out gemm.json`.
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl
from torch import Tensor

from .fp8_outliers import OUTLIER_WIDTH
from .fp16acc_wgmma import BLOCK_K as WGMMA_CHUNK
from .fp16acc_wgmma import fp16acc_wgmma, fp16acc_wgmma_supported
from .tiles import store_tile, wrapped_tile

logger = logging.getLogger(__name__)

E4M3_MAX = 448.0
# An all-zero row gets scale AMAX_FLOOR / 448 instead of 0, so dequantization never divides by zero.
AMAX_FLOOR = 1e-12
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# Dispatch: which implementation runs where.
#
#   op                          CPU         CUDA sm_89 / sm_9x / sm_10x / sm_12x     other CUDA
#   quantize_rows_fp8           reference   Triton                                    reference (logged once)
#   fp8_linear (GEMM)           reference   torch._scaled_mm row-wise                 reference (logged once)
#   fp16acc_linear              reference   Triton (any sm_80+; Gluon wgmma on sm_90)  reference below sm_80
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


@functools.cache
def _log_reference_once(op: str, device: str, why: str) -> None:
    # Cached on (op, device, why) so each fallback is announced once per process, not per call.
    level = logging.INFO if device == "cpu" else logging.WARNING
    logger.log(level, "%s on %s runs the PyTorch reference: %s", op, device, why)


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    major, minor = _capability(device)
    return f"cuda sm_{major}{minor}"


def _use_fp8_kernels(op: str, device: torch.device) -> bool:
    if fp8_native(device):
        return True
    if device.type == "cuda":
        why = "no FP8 tensor cores (needs sm_89 or newer)"
    else:
        why = "CPU tensors" if device.type == "cpu" else "no FP8 kernels here"
    _log_reference_once(op, _device_name(device), why)
    return False


def _use_fp16acc_kernel(device: torch.device) -> bool:
    if device.type == "cuda" and _capability(device) >= (8, 0):
        return True
    if device.type == "cuda":
        why = "Triton bf16/fp16 MMA needs sm_80 or newer"
    else:
        why = "CPU tensors" if device.type == "cpu" else "no Triton kernels here"
    _log_reference_once("fp16acc_linear", _device_name(device), why)
    return False


# ---------------------------------------------------------------------------------------------------------------
# Row-wise e4m3 quantization
# ---------------------------------------------------------------------------------------------------------------


def quantize_rows_fp8_ref(x: Tensor, extra_cols: Tensor | None = None, residual: bool = False) -> tuple[Tensor, Tensor]:
    """x: [..., K] bf16/fp16/fp32 → (xq: [..., K + C] float8_e4m3fn, scale: [..., 1] fp32) with x ≈ xq[..., :K] * scale.

    scale = max(absmax(row), 1e-12) / 448. The multiplier 448 / absmax is computed once per row and applied by
    multiplication, so the Triton kernel (IEEE division via div_rn) reproduces these bits. Both divisions here are
    tensor / tensor on purpose: PyTorch turns `448.0 / t` into reciprocal(t) · 448 and, on CUDA, `t / 448.0` into
    t · (1 / 448), each one rounding more than an IEEE division.

    extra_cols (int [C], or None for C = 0) appends the columns x[..., extra_cols] on the same scale (index -1: a
    zero column): their e4m3 values again, or with `residual` what e4m3 rounding left of them (x·448/absmax − its
    e4m3 value, itself in e4m3). See `outlier_columns` for what the two are for.
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(AMAX_FLOOR)
    e4m3_max = torch.full_like(amax, E4M3_MAX)
    xq = (xf * (e4m3_max / amax)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    if extra_cols is not None:
        picked = xf[..., extra_cols.clamp_min(0).long()]
        picked = torch.where(extra_cols >= 0, picked, 0.0)  # -1: a +0 column (x · False would be -0 for x < 0)
        scaled = (picked * (e4m3_max / amax)).clamp(-E4M3_MAX, E4M3_MAX)
        extra = scaled.to(torch.float8_e4m3fn)
        if residual:
            extra = (scaled - extra.float()).to(torch.float8_e4m3fn)
        xq = torch.cat([xq, extra], dim=-1)
    return xq, amax / e4m3_max


@triton.jit
def e4m3_scales(amax):
    """Device helper shared with kernels that fuse quantization (adaln): per-row absmax (fp32) → (448 / absmax,
    absmax / 448). div_rn is IEEE division, so the scales match PyTorch bit for bit (plain `/` is approximate)."""
    amax = tl.maximum(amax, 1e-12)
    return tl.math.div_rn(448.0, amax), tl.math.div_rn(amax, 448.0)


@triton.jit
def e4m3_quantize(x, inv_scale):
    """x fp32 [ROWS, BLOCK] * inv_scale [ROWS] → e4m3, saturated at ±448 (the product can round just above 448)."""
    return tl.clamp(x * inv_scale[:, None], -448.0, 448.0).to(tl.float8e4nv)


@triton.jit
def _extra_columns(x_rows, q_rows, cols_ptr, inv, row_ok, K, C: tl.constexpr, RESIDUAL: tl.constexpr):
    # The C appended columns (quantize_rows_fp8_ref's extra_cols): x at cols_ptr's channels on the row's scale, as
    # e4m3 again or, with RESIDUAL, what e4m3 rounding left of them.
    j = tl.arange(0, C)
    idx = tl.load(cols_ptr + j)
    v = tl.load(x_rows + tl.maximum(idx, 0)[None, :], mask=row_ok[:, None] & (idx >= 0)[None, :], other=0.0)
    v = v.to(tl.float32)  # padding columns (index -1) are zeros and load nothing
    scaled = tl.clamp(v * inv[:, None], -448.0, 448.0)
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
        inv, scale = e4m3_scales(tl.max(tl.abs(x), axis=1))
        tl.store(q_rows + cols[None, :], e4m3_quantize(x, inv), mask=mask)
    else:
        # Rows longer than one block: the second sweep re-reads the row, which the first sweep just left in L2.
        amax = tl.zeros([ROWS], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask = row_ok[:, None] & (k0 + cols < K)[None, :]
            x = tl.load(x_rows + k0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        inv, scale = e4m3_scales(amax)
        for k0 in range(0, K, BLOCK_K):
            mask = row_ok[:, None] & (k0 + cols < K)[None, :]
            x = tl.load(x_rows + k0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(q_rows + k0 + cols[None, :], e4m3_quantize(x, inv), mask=mask)
    if C > 0:
        _extra_columns(x_rows, q_rows, cols_ptr, inv, row_ok, K, C, RESIDUAL)
    tl.store(scale_ptr + rows64, scale, mask=row_ok)


# One program holds at most this many fp32 values of a row (64 per thread at 16 warps); longer rows take two sweeps.
_MAX_SINGLE_PASS = 16384


def quantize_rows_fp8_triton(
    x: Tensor, extra_cols: Tensor | None = None, residual: bool = False
) -> tuple[Tensor, Tensor]:
    """The Triton kernel alone, on whatever device x is on (CUDA, or CPU under TRITON_INTERPRET=1).
    x: [..., K] bf16/fp16/fp32 with rows contiguous → (xq [..., K + C] e4m3, scale [..., 1] fp32); extra_cols as in
    `quantize_rows_fp8_ref` (int32 [C], C a power of two)."""
    k = x.shape[-1]
    c = 0 if extra_cols is None else extra_cols.numel()
    x2 = x.reshape(-1, k)
    n_rows = x2.shape[0]
    xq = torch.empty((*x.shape[:-1], k + c), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    if n_rows == 0 or k == 0:
        scale.fill_(AMAX_FLOOR / E4M3_MAX)
        return xq, scale
    block_k = min(triton.next_power_of_2(k), _MAX_SINGLE_PASS)
    rows = max(1, min(4096 // block_k, triton.next_power_of_2(n_rows)))
    num_warps = min(16, max(4, rows * block_k // 1024))
    _quantize_rows_fp8_kernel[(triton.cdiv(n_rows, rows),)](
        x2, xq, scale, scale if extra_cols is None else extra_cols, n_rows, k, x2.stride(0),
        ROWS=rows, BLOCK_K=block_k, SINGLE_PASS=block_k >= k, C=c, RESIDUAL=residual, num_warps=num_warps,
    )  # fmt: skip
    return xq, scale


@torch.library.custom_op("k6fast::quantize_rows_fp8", mutates_args=())
def _quantize_rows_fp8_op(x: Tensor, extra_cols: Tensor | None, residual: bool) -> tuple[Tensor, Tensor]:
    if _use_fp8_kernels("quantize_rows_fp8", x.device):
        return quantize_rows_fp8_triton(x, extra_cols, residual)
    return quantize_rows_fp8_ref(x, extra_cols, residual)


@_quantize_rows_fp8_op.register_fake
def _(x: Tensor, extra_cols: Tensor | None, residual: bool) -> tuple[Tensor, Tensor]:
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


def quantize_rows_fp8(x: Tensor, extra_cols: Tensor | None = None, residual: bool = False) -> tuple[Tensor, Tensor]:
    """x: [..., K] bf16/fp16/fp32, contiguous → (xq: [..., K + C] float8_e4m3fn, scale: [..., 1] fp32).

    Per-row absmax scaling (x ≈ xq[..., :K] * scale); one read of x and one write of xq; extra_cols (int32 [C]) and
    residual as in `quantize_rows_fp8_ref`. Triton on FP8-capable CUDA devices, the reference elsewhere (logged
    once)."""
    _check_rows(x, "quantize_rows_fp8")
    _check_extra_cols(extra_cols, x.device)
    return _quantize_rows_fp8_op(x, extra_cols, residual)


def quantize_weight_fp8(w: Tensor, residual_cols: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """w: [N, K] (nn.Linear layout) → (wq: [N, K + C] float8_e4m3fn, scale: [1, N] fp32), one scale per output channel.

    wq stays row-major, so `wq.t()` is the column-major [K, N] operand `_scaled_mm` wants, and [1, N] is the scale
    layout it wants for that operand. residual_cols (int32 [C]) appends what e4m3 rounding left of those input
    channels (`outlier_columns`)."""
    if w.ndim != 2:
        raise ValueError(f"quantize_weight_fp8: expected a weight [N, K], found shape {tuple(w.shape)}")
    wq, scale = quantize_rows_fp8(w.contiguous(), residual_cols, residual=True)
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


# ---------------------------------------------------------------------------------------------------------------
# FP16-accumulate GEMM (FP16 inside each K chunk, FP32 across chunks)
# ---------------------------------------------------------------------------------------------------------------


def fp16acc_linear_ref(
    x: Tensor,
    w: Tensor,
    bias: Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    k_chunk: int | None = None,
) -> Tensor:
    """fp32 matmul of the fp16-rounded operands: x [..., K], w [N, K], bias [N] or None → [..., N] out_dtype.

    `k_chunk` is accepted for signature parity; the reference accumulates everything in fp32, so the kernel differs
    from it by its fp16 rounding inside each chunk (≈ 3e-4 relative L2 at K = 4096 and 16384 in a CPU emulation
    with 32-wide chunks; 1.7e-3 measured on an H200 with 64-wide chunks and bf16 output, the output rounding)."""
    y = x.to(torch.float16).float() @ w.to(torch.float16).float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


@triton.jit
def _fp16acc_linear_kernel(
    x_ptr,  # [M, K] bf16 or fp16, row stride stride_xm, unit column stride
    w_ptr,  # [N, K] fp16, row stride stride_wn, unit column stride (nn.Linear layout)
    bias_ptr,  # [N] any float dtype, or a dummy when HAS_BIAS is False
    y_ptr,  # [M, N] out dtype, row stride stride_ym
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K is a multiple of the chunk (BLOCK_K * CHUNK_STEPS)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CHUNK_STEPS: tl.constexpr,  # BLOCK_K-deep MMAs per fp16 chunk: the chunk is BLOCK_K * CHUNK_STEPS wide
    GROUP_M: tl.constexpr,
):
    offs_m, offs_n, rm, rn = wrapped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + rn[None, :].to(tl.int64) * stride_wn + offs_k[:, None]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for c in range(0, tl.cdiv(K, BLOCK_K * CHUNK_STEPS)):
        # FP16 accumulation is confined to one chunk (|partial sums| must stay below 65504; the rounding error grows
        # with the chunk length only): the chunk's MMAs chain on an fp16 accumulator (no wait between them), then
        # the chunk is added to the fp32 accumulator.
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float16)
        for s in tl.static_range(CHUNK_STEPS):
            if EVEN_K:
                a = tl.load(x_ptrs)
                b = tl.load(w_ptrs)
            else:  # steps past K load zeros
                k_ok = offs_k < K - (c * CHUNK_STEPS + s) * BLOCK_K
                a = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
                b = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
            part = tl.dot(a.to(tl.float16), b.to(tl.float16), part, out_dtype=tl.float16)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        acc += part.to(tl.float32)

    store_tile(y_ptr, acc, bias_ptr, offs_m, offs_n, M, N, stride_ym, HAS_BIAS)


FP16ACC_CHUNKS = (32, 64, 128, 256)


def fp16acc_default_chunk(device: torch.device) -> int:
    """64 on sm_90, the Gluon kernel's chunk (the Triton kernel there: 0.62x cuBLAS BF16 at 64 vs 0.50x at 32,
    measurements/sessions/2026-11-29_h200-kernels2); 32 elsewhere, GeForce included, where no chunk width has been
    measured and the shorter chunk's fp16 partial sums reach 65504 later."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0):
        return 64
    return 32


def fp16acc_chunk_steps(k_chunk: int) -> tuple[int, int]:
    """(BLOCK_K, CHUNK_STEPS) of a chunk width: MMAs at most 64 deep, chained CHUNK_STEPS times on fp16."""
    block_k = min(k_chunk, 64)
    return block_k, k_chunk // block_k


# Tiles for sm_90 (wgmma, 227 KB shared memory) and sm_89/sm_120 (mma.sync, ~100 KB): configs that do not fit a
# card's shared memory are skipped by the autotuner. Each chunk ends in a wait for its MMAs and an fp16→fp32 add of
# the whole tile on the ALUs, so longer chunks (fewer waits) and configs that put two CTAs on an SM (one CTA's adds
# overlap the other's MMAs) are what is tried.
_FP16ACC_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 256, "BLOCK_N": 128, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 256, "GROUP_M": 8}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "GROUP_M": 8}, num_warps=4, num_stages=4),
]
_fp16acc_linear_tuned = triton.autotune(
    configs=_FP16ACC_CONFIGS, key=["M", "N", "K", "BLOCK_K", "CHUNK_STEPS", "HAS_BIAS"]
)(_fp16acc_linear_kernel)
# Under the interpreter (CPU tensors) autotuning would time every config on the CPU: one small tile instead.
_INTERPRETER_TILE = {"BLOCK_M": 32, "BLOCK_N": 32, "GROUP_M": 4}


def fp16acc_linear_triton(
    x: Tensor,
    w: Tensor,
    bias: Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    k_chunk: int | None = None,
) -> Tensor:
    """The Triton kernel alone, on whatever device x is on (CUDA, or CPU under TRITON_INTERPRET=1).
    Shapes and dtypes as `fp16acc_linear`."""
    k_chunk = fp16acc_default_chunk(x.device) if k_chunk is None else k_chunk
    k = x.shape[-1]
    n = w.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    # A bf16 weight is cast here on every call (4·N·K bytes of traffic, <1% of the GEMM at W1 shapes); cast once at
    # load instead. bf16 → fp16 is exact for |v| in [6.1e-5, 65504]; larger magnitudes become inf, smaller ones lose
    # bits as fp16 subnormals. Activations are converted inside the kernel, tile by tile, with the same caveat.
    w16 = w if w.dtype == torch.float16 else w.to(torch.float16)
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    args = (x2, w16, bias if bias is not None else y, y, m, n, k, x2.stride(0), w16.stride(0), y.stride(0))
    block_k, steps = fp16acc_chunk_steps(k_chunk)
    flags = {"HAS_BIAS": bias is not None, "EVEN_K": k % k_chunk == 0, "BLOCK_K": block_k, "CHUNK_STEPS": steps}
    if x.device.type == "cuda":
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)
        _fp16acc_linear_tuned[grid](*args, **flags)
    else:
        tile = _INTERPRETER_TILE
        grid = (triton.cdiv(m, tile["BLOCK_M"]) * triton.cdiv(n, tile["BLOCK_N"]),)
        _fp16acc_linear_kernel[grid](*args, **flags, **tile)
    return y.reshape(*x.shape[:-1], n)


def _fp16acc_linear_wgmma(x: Tensor, w: Tensor, bias: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    # The sm_90 kernel reads fp16 operands by TMA, so bf16 activations are converted in one pass first.
    k = x.shape[-1]
    x16 = x.reshape(-1, k).to(torch.float16)
    w16 = w if w.dtype == torch.float16 else w.to(torch.float16)
    return fp16acc_wgmma(x16, w16, bias, out_dtype=out_dtype).reshape(*x.shape[:-1], w.shape[0])


@torch.library.custom_op("k6fast::fp16acc_linear", mutates_args=())
def _fp16acc_linear_op(x: Tensor, w: Tensor, bias: Tensor | None, out_dtype: torch.dtype, k_chunk: int) -> Tensor:
    if _use_fp16acc_kernel(x.device):
        if k_chunk == WGMMA_CHUNK and fp16acc_wgmma_supported(x, w):
            return _fp16acc_linear_wgmma(x, w, bias, out_dtype)
        return fp16acc_linear_triton(x, w, bias, out_dtype=out_dtype, k_chunk=k_chunk)
    return fp16acc_linear_ref(x, w, bias, out_dtype=out_dtype, k_chunk=k_chunk)


@_fp16acc_linear_op.register_fake
def _(x: Tensor, w: Tensor, bias: Tensor | None, out_dtype: torch.dtype, k_chunk: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]), dtype=out_dtype)


def fp16acc_linear(
    x: Tensor,
    w: Tensor,
    bias: Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    k_chunk: int | None = None,
) -> Tensor:
    """y = x @ w.t() (+ bias) on FP16 operands, accumulating in FP16 inside each `k_chunk`-wide K chunk (32, 64,
    128 or 256; a chunk wider than 64 chains 64-deep MMAs on its fp16 accumulator; None: `fp16acc_default_chunk`)
    and in FP32 across chunks.
    Lossy: operands are rounded to fp16 (exact for bf16 values of magnitude 6.1e-5 to 65504; larger ones overflow)
    and each chunk's partial sum is rounded to fp16.

    x: [..., K] bf16/fp16 with rows contiguous; w: [N, K] fp16 (cast once at load; bf16 is cast per call);
    bias: [N] float or None → [..., N] out_dtype (bf16 by default).

    Speed: FP16-accumulate MMA runs at twice the FP32-accumulate rate only on GeForce cards (sm_89, sm_120). On
    datacenter cards (A100, H100, H200, B200) both rates are equal, so there this kernel is no faster than cuBLAS
    BF16 and exists for numerical parity with the GeForce path. On sm_90 with k_chunk=64 a Gluon kernel
    (kernels/fp16acc_wgmma.py: TMA, fp16-accumulator wgmma kept in flight) runs the call: 0.62-0.69x cuBLAS BF16 at
    the W1 shapes including the activations' conversion to fp16 (0.71-0.78x on fp16 activations), where the Triton
    kernel reaches 0.58-0.62x (measurements/sessions/2026-11-29_fp16acc-wgmma; the Triton kernel's tiles and chunks:
    2026-11-29_fp16acc-sweep). GeForce cards are not measured. Triton on CUDA sm_80+; the reference elsewhere."""
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"fp16acc_linear: expected bf16/fp16 x and w, found x {x.dtype}, w {w.dtype}")
    if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[1]:
        raise ValueError(
            f"fp16acc_linear: expected x [..., K] and w [N, K] with equal K, found x {tuple(x.shape)}, "
            f"w {tuple(w.shape)}"
        )
    if not x.is_contiguous() or not w.is_contiguous():
        raise ValueError("fp16acc_linear: expected contiguous x and w")
    devices = {t.device for t in (x, w, bias) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"fp16acc_linear: expected all operands on one device, found {sorted(map(str, devices))}")
    if bias is not None and (bias.shape != (w.shape[0],) or bias.dtype not in _FLOAT_DTYPES):
        raise ValueError(
            f"fp16acc_linear: expected a float bias ({w.shape[0]},), found {bias.dtype} {tuple(bias.shape)}"
        )
    k_chunk = fp16acc_default_chunk(x.device) if k_chunk is None else k_chunk
    if k_chunk not in FP16ACC_CHUNKS:
        raise ValueError(f"fp16acc_linear: expected k_chunk one of {FP16ACC_CHUNKS}, found {k_chunk}")
    if out_dtype not in _FLOAT_DTYPES:
        raise ValueError(f"fp16acc_linear: expected out_dtype bfloat16, float16 or float32, found {out_dtype}")
    return _fp16acc_linear_op(x, w, bias, out_dtype, k_chunk)
