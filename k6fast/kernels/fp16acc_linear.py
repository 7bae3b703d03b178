"""FP16-accumulate GEMM for the K6 DiT: FP16 operands, FP16 accumulation inside each K chunk, FP32 across chunks.

Only GeForce cards (sm_89, sm_120) run FP16-accumulate MMA at twice the FP32-accumulate rate; on datacenter cards
(A100/H100/H200/B200) both rates are equal, so this kernel has no speed gain there. On sm_90 the default 64-wide chunk
runs a Gluon wgmma kernel instead (fp16acc_wgmma.py). `tests/test_sass_geforce.py` compiles the Triton kernel
for sm_120 and sm_89 on the CPU and checks that its SASS holds FP16-accumulate HMMA (`HMMA.16816.F16`) only.

What it holds: `fp16acc_linear(x, w, bias)` (the public op, a custom op), `fp16acc_linear_triton` (the Triton kernel
alone, also under the interpreter) and `fp16acc_linear_ref` (the fp32 product of the fp16-rounded operands).

Dispatch:
  CPU                          reference (logged once)
  CUDA sm_90, 64-wide chunks   Gluon wgmma (fp16acc_wgmma.py)
  CUDA sm_80 and newer         Triton
  older CUDA                   reference (logged once)

Check: `pytest tests/test_fp8_linear.py -k fp16acc` (CPU + interpreter; `-m gpu` on a GPU machine).
Benchmark: `python measurements/bench_gemm.py --out gemm.json`.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl
from torch import Tensor

from .fallback import cuda_at_least, kernel_runs
from .fp16acc_wgmma import BLOCK_K as WGMMA_CHUNK
from .fp16acc_wgmma import fp16acc_wgmma, fp16acc_wgmma_supported
from .tiles import launch_gemm, store_tile, wrapped_tile

logger = logging.getLogger(__name__)

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _use_fp16acc_kernel(device: torch.device) -> bool:
    return kernel_runs(
        logger, "fp16acc_linear", device, cuda_at_least(device, (8, 0)), "Triton bf16/fp16 MMA needs sm_80 or newer"
    )


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
    from it by its fp16 rounding inside each chunk, below the bf16 output's own rounding at the W1 shapes on an H200
    (measurements/sessions/2026-11-29_fp16acc-wgmma/README.md)."""
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
    """64 on sm_90, the Gluon kernel's chunk (the Triton kernel there is faster at 64 than at 32:
    measurements/sessions/2026-11-29_h200-kernels2/README.md); 32 elsewhere, GeForce included, where no chunk width
    has been measured and the shorter chunk's fp16 partial sums reach 65504 later."""
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
FP16ACC_CONFIGS = [
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
    configs=FP16ACC_CONFIGS, key=["M", "N", "K", "BLOCK_K", "CHUNK_STEPS", "HAS_BIAS"]
)(_fp16acc_linear_kernel)


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
    launch_gemm(_fp16acc_linear_kernel, _fp16acc_linear_tuned, m, n, x.device, args, flags)
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
    (fp16acc_wgmma.py: TMA, fp16-accumulator wgmma kept in flight) runs the call, faster there than the
    Triton kernel though still slower than cuBLAS BF16 (measurements/sessions/2026-11-29_fp16acc-wgmma/README.md; the
    Triton kernel's tiles and chunks: measurements/sessions/2026-11-29_fp16acc-sweep/README.md). Triton on CUDA
    sm_80+; the reference elsewhere."""
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
