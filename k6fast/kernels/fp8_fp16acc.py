"""FP8 GEMM for GeForce (sm_89, sm_120): e4m3 MMAs accumulating each K chunk in FP16, the chunks added in FP32.

Why: on GeForce Ada and Blackwell, FP8 MMA with an FP16 accumulator (`QMMA.16832.F16.E4M3.E4M3`) runs at twice the
rate of the FP32-accumulator form (`QMMA.16832.F32...`) that `torch._scaled_mm` uses; datacenter cards run both at one
rate. This is the approach SageAttention2++ takes for P·V: short FP16 accumulations, added into FP32.

Overflow: FP16 saturates at 65504, so a chunk's partial sums must stay below it. Operands are quantized per row to
±qmax instead of ±E4M3_MAX (`FP16_CHUNK_QMAX`), with qmax² · chunk ≤ 65504: 44 for 32-wide chunks, 30 for 64, 22 for
128. That bound holds for any data; it costs nothing in precision while values stay in e4m3's normal range (its
relative rounding does not depend on the scale), only values below qmax · 2^-6 / absmax of their row lose bits.

What it holds:
- `fp8_fp16acc_linear(xq, x_scale, wq, w_scale, bias)`: y = (xq @ wq.t()) · x_scale · w_scale (+ bias); the public
  op (a custom op). `fp8_fp16acc_linear_triton` is the Triton kernel alone.
- `fp8_fp16acc_linear_ref`: an emulation: exact products, each 32-deep MMA's sum added to an FP16 accumulator (one
  rounding per MMA, as the hardware rounds at least that often), the chunk's FP16 result added to FP32.
  `fp8_linear.fp8_linear_ref` is the FP32-accumulate product the kernel's error is judged against.

Dispatch: CUDA sm_89 and newer: Triton; elsewhere the emulation (logged once). The DiT's fp8 arm takes this kernel on
GeForce sm_89/sm_12x only (k6fast/dit/arch.py); elsewhere it keeps `torch._scaled_mm`.

Checked on the CPU: the emulation against the FP32-accumulate product (tests/test_fp8_fp16acc.py: ≤ 2e-3 relative
L2 at K up to 16,384), the kernel under the Triton interpreter (its dot rounds each chunk's exact sum to FP16 once:
at 32-wide chunks the emulation's result bit for bit), and the SASS for sm_120 and sm_89 (tests/test_sass_geforce.py:
`QMMA.16832.F16.E4M3.E4M3` only, no FP32-accumulate QMMA, no spills).
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl
from torch import Tensor

from .fallback import cuda_at_least, kernel_runs
from .tiles import launch_gemm, store_tile, wrapped_tile

logger = logging.getLogger(__name__)

FP16_MAX = 65504.0
MMA_K = 32  # K depth of one FP8 MMA (m16n8k32): the accumulator is rounded to FP16 at least this often
# chunk width → the largest e4m3 value q with q² · chunk <= 65504
FP16_CHUNK_QMAX = {32: 44.0, 64: 30.0, 128: 22.0}
# 32: one MMA per FP32 add. Wider chunks halve the adds but double the operand fragments a thread holds: at 64 the
# 128x128 tile spills on sm_120 (tests/test_sass_geforce.py compiles these configs; no GeForce card to time them).
DEFAULT_CHUNK = 32
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _use_kernel(device: torch.device) -> bool:
    return kernel_runs(
        logger, "fp8_fp16acc_linear", device, cuda_at_least(device, (8, 9)),
        "no FP8 tensor cores (needs sm_89 or newer)", what="the PyTorch emulation",
    )  # fmt: skip


def fp8_fp16acc_linear_ref(
    xq: Tensor,
    x_scale: Tensor,
    wq: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    chunk: int = DEFAULT_CHUNK,
) -> Tensor:
    """Emulation of the kernel's accumulation: per `chunk`-wide K chunk an FP16 accumulator that each 32-deep MMA's
    exact sum is added to (rounded to FP16 after every MMA), the chunk added to an FP32 total, then the row and channel
    scales. xq: [M, K] e4m3, x_scale: [M, 1] fp32, wq: [N, K] e4m3, w_scale: [1, N] or [N] fp32 → [M, N] out_dtype."""
    m, k = xq.shape
    n = wq.shape[0]
    a, b = xq.float(), wq.float()
    total = torch.zeros((m, n), dtype=torch.float32, device=xq.device)
    for c0 in range(0, k, chunk):
        part = torch.zeros((m, n), dtype=torch.float16, device=xq.device)
        for k0 in range(c0, min(c0 + chunk, k), MMA_K):
            mma = a[:, k0 : k0 + MMA_K] @ b[:, k0 : k0 + MMA_K].t()  # exact: e4m3 products, sums of 32 below 2^24
            part = (part.float() + mma).to(torch.float16)
        total += part.float()
    y = total * x_scale.reshape(m, 1) * w_scale.reshape(1, n)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


@triton.jit
def _fp8_fp16acc_kernel(
    x_ptr,  # [M, K] e4m3, row stride stride_xm
    xs_ptr,  # [M] fp32 row scales
    w_ptr,  # [N, K] e4m3, row stride stride_wn (nn.Linear layout)
    ws_ptr,  # [N] fp32 channel scales
    bias_ptr,  # [N] any float dtype, or a dummy when HAS_BIAS is False
    y_ptr,  # [M, N] out dtype, row stride stride_ym
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K is a multiple of BLOCK_K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # the FP16 chunk: BLOCK_K / 32 MMAs chained on one FP16 accumulator
    GROUP_M: tl.constexpr,
):
    offs_m, offs_n, rm, rn = wrapped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + rn[None, :].to(tl.int64) * stride_wn + offs_k[:, None]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:  # columns past K load zeros
            k_ok = offs_k < K - k * BLOCK_K
            a = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        # A fresh FP16 accumulator per chunk; the conversion before the add keeps Triton from folding the add into
        # the dot (which would make it an FP32-accumulate MMA).
        acc += tl.dot(a, b, out_dtype=tl.float16).to(tl.float32)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    acc = acc * tl.load(xs_ptr + offs_m % M)[:, None] * tl.load(ws_ptr + offs_n % N)[None, :]
    store_tile(y_ptr, acc, bias_ptr, offs_m, offs_n, M, N, stride_ym, HAS_BIAS)


# Starting points for mma.sync cards (~100 KB of shared memory on sm_89/sm_120); configs that do not fit are skipped
# by the autotuner. The tiles that build without register spills at 32-wide chunks for sm_120 and sm_89 (128x256 and
# 128x128 on 4 warps spill); which is fastest is for a GeForce run of measurements/bench_gemm.py to say.
FP8_FP16ACC_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 256, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "GROUP_M": 8}, num_warps=4, num_stages=4),
]
_tuned = triton.autotune(configs=FP8_FP16ACC_CONFIGS, key=["M", "N", "K", "BLOCK_K", "HAS_BIAS"])(_fp8_fp16acc_kernel)


def fp8_fp16acc_linear_triton(
    xq: Tensor,
    x_scale: Tensor,
    wq: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    chunk: int = DEFAULT_CHUNK,
) -> Tensor:
    """The Triton kernel alone, on whatever device xq is on (CUDA, or CPU under TRITON_INTERPRET=1); arguments as
    `fp8_fp16acc_linear` with xq [M, K] row-major."""
    m, k = xq.shape
    n = wq.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return y
    xs, ws = x_scale.reshape(m).contiguous(), w_scale.reshape(n).contiguous()
    args = (xq, xs, wq, ws, bias if bias is not None else y, y, m, n, k, xq.stride(0), wq.stride(0), y.stride(0))
    flags = {"HAS_BIAS": bias is not None, "EVEN_K": k % chunk == 0, "BLOCK_K": chunk}
    launch_gemm(_fp8_fp16acc_kernel, _tuned, m, n, xq.device, args, flags)
    return y


@torch.library.custom_op("k6fast::fp8_fp16acc_mm", mutates_args=())
def _fp8_fp16acc_op(
    xq: Tensor, x_scale: Tensor, wq: Tensor, w_scale: Tensor, bias: Tensor | None, out_dtype: torch.dtype, chunk: int
) -> Tensor:
    if _use_kernel(xq.device):
        return fp8_fp16acc_linear_triton(xq, x_scale, wq, w_scale, bias, out_dtype, chunk)
    return fp8_fp16acc_linear_ref(xq, x_scale, wq, w_scale, bias, out_dtype, chunk)


@_fp8_fp16acc_op.register_fake
def _(xq, x_scale, wq, w_scale, bias, out_dtype, chunk) -> Tensor:
    return xq.new_empty((xq.shape[0], wq.shape[0]), dtype=out_dtype)


def fp8_fp16acc_linear(
    x: tuple[Tensor, Tensor],
    wq: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    chunk: int = DEFAULT_CHUNK,
) -> Tensor:
    """y = x @ w.t() (+ bias) from e4m3 operands quantized to ±FP16_CHUNK_QMAX[chunk], FP16 accumulation inside each
    `chunk`-wide K chunk (32, 64 or 128), FP32 across chunks. Lossy (e4m3 operands; FP16 rounding of each chunk).

    x: (xq [..., K] e4m3, x_scale [..., 1] fp32) from `quantize_rows_fp8(x, qmax=FP16_CHUNK_QMAX[chunk])`;
    wq: [N, K] e4m3 and w_scale: [1, N] or [N] fp32 from `quantize_weight_fp8(w, qmax=...)` with the same qmax;
    bias: [N] float or None. Returns [..., N] out_dtype. Operands quantized to a larger range may overflow FP16: the
    caller owns that contract (checked here on the CPU path only, where reading the data back is free)."""
    if chunk not in FP16_CHUNK_QMAX:
        raise ValueError(f"fp8_fp16acc_linear: expected chunk one of {tuple(FP16_CHUNK_QMAX)}, found {chunk}")
    xq, x_scale = x
    if xq.dtype != torch.float8_e4m3fn or wq.dtype != torch.float8_e4m3fn or wq.ndim != 2:
        raise ValueError(f"fp8_fp16acc_linear: expected e4m3 xq [..., K] and wq [N, K], found {xq.dtype}, {wq.dtype}")
    n, k = wq.shape
    if xq.shape[-1] != k or x_scale.shape != (*xq.shape[:-1], 1) or w_scale.numel() != n:
        raise ValueError(
            f"fp8_fp16acc_linear: expected xq [..., {k}], x_scale [..., 1], w_scale of {n}, found "
            f"{tuple(xq.shape)}, {tuple(x_scale.shape)}, {tuple(w_scale.shape)}"
        )
    if bias is not None and (bias.shape != (n,) or bias.dtype not in _FLOAT_DTYPES):
        raise ValueError(f"fp8_fp16acc_linear: expected a float bias ({n},), found {bias.dtype} {tuple(bias.shape)}")
    if xq.device.type == "cpu" and xq.numel() and wq.numel():
        qmax = FP16_CHUNK_QMAX[chunk]
        if xq.float().abs().max() > qmax or wq.float().abs().max() > qmax:
            raise ValueError(f"fp8_fp16acc_linear: operands must lie within ±{qmax} for {chunk}-wide FP16 chunks")
    y = _fp8_fp16acc_op(
        xq.reshape(-1, k).contiguous(), x_scale.reshape(-1, 1), wq.contiguous(), w_scale, bias, out_dtype, chunk
    )
    return y.reshape(*xq.shape[:-1], n)
