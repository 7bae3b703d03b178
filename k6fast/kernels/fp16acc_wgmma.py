"""FP16-accumulate GEMM for Hopper (sm_90) in Gluon: TMA loads and asynchronous wgmma with an fp16 accumulator.

`fp16acc_linear.fp16acc_linear` accumulates in FP16 inside each 64-wide K chunk and in FP32 across chunks. Plain Triton
never keeps such an MMA in flight on sm_90 (its wgmma pipeliner only makes FP32-accumulator dots asynchronous), so
each waits for the one before. Gluon exposes `warpgroup_mma(..., is_async=True)` and its waits directly:

- x and w tiles come in by TMA into a STAGES-deep shared-memory ring (both fp16, K-contiguous);
- the CTA tile is two 64-row halves, each with its own fp16 accumulator; per 64-wide K step both halves' MMAs are
  issued back to back, and half 0's fp16 -> fp32 add runs while half 1's MMAs are still in flight.

On an H200 at the W1 shapes (measurements/sessions/2026-11-29_fp16acc-wgmma/README.md) it is faster than the Triton
kernel, conversion pass included, and slower than cuBLAS BF16; the same kernel accumulating in FP32 is faster still:
the fp16 chunks cost that much because each step's fp16 accumulator is drained (wait 0) before its add, so the
tensor pipe empties every step. Keeping an fp16
accumulator in flight across the loop is what Gluon cannot do (it unpacks the accumulator right after the wgmma and
ptxas then serializes every wgmma, warning C7514); halving the drains (two steps unrolled, 128-wide chunks) cost
registers or ring depth, and a warp-specialized TMA producer did not help (all recorded there). FP16 accumulation has
no rate advantage on Hopper; this kernel only keeps the fp16acc arm from being slower there than it must be.

`fp16acc_wgmma(x16, w16, bias)` is the launcher; `fp16acc_wgmma_supported` says whether a call can use it.
The reference is `fp16acc_linear.fp16acc_linear_ref` (tests/test_fp16acc_wgmma.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from torch import Tensor

from .gluon_hopper import GLUON_AVAILABLE  # without Gluon, fp8_linear falls back to the Triton kernel
from .tiles import grouped_tile

if GLUON_AVAILABLE:
    from .gluon_hopper import TensorDescriptor, gl, gluon, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

__all__ = ["GLUON_AVAILABLE", "WgmmaTile", "fp16acc_wgmma", "fp16acc_wgmma_supported"]

BLOCK_K = 64  # the K step and the fp16 chunk: one TMA box of 64 fp16 = 128 bytes, the widest swizzle


@dataclass(frozen=True)
class WgmmaTile:
    """A launch tile. The default, 128x256 with two warpgroups side by side along N and a 4-deep ring (192 KB),
    was the fastest of the sweep at all three W1 shapes, 128x128 with one warpgroup (two CTAs an SM) close behind
    (measurements/sessions/2026-11-29_fp16acc-wgmma/README.md)."""

    block_m: int = 128
    block_n: int = 256
    num_warps: int = 8
    stages: int = 4
    group_m: int = 8


DEFAULT_TILE = WgmmaTile()


if GLUON_AVAILABLE:

    @gluon.jit
    def _fp16acc_wgmma_kernel(
        a_desc,  # x [M, K] fp16, block [BLOCK_M, BLOCK_K]
        b_desc,  # w [N, K] fp16, block [BLOCK_N, BLOCK_K]
        y_ptr,  # [M, N] out dtype, row stride stride_ym
        bias_ptr,  # [N] float, or any pointer when HAS_BIAS is False
        M,
        N,
        K,
        stride_ym,
        HAS_BIAS: gl.constexpr,
        STAGES: gl.constexpr,
        GROUP_M: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_KK: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]

        pid_m, pid_n = grouped_tile(gl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)  # scalar maths, shared
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N

        HALF_M: gl.constexpr = BLOCK_M // 2
        # One warpgroup per 64 rows; a second warpgroup (8 warps) takes the other half of the columns.
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, num_warps // 4], instr_shape=[16, BLOCK_N // (num_warps // 4), 16]
        )
        a_ring = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_ring = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)

        n_steps = gl.cdiv(K, BLOCK_KK)  # the last step's columns past K are TMA's zero fill
        tile_bytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
        for s in gl.static_range(STAGES - 1):  # prologue: the first STAGES-1 steps in flight
            _load_step(a_desc, b_desc, a_ring, b_ring, ready, s, off_m, off_n, n_steps, tile_bytes)

        # The tile is two 64-row halves, each with its own fp16 chunk accumulator (part0, part1: one 64-wide K step
        # each, issued back to back) and fp32 sum (acc0, acc1): half 0's fp16 -> fp32 add runs while half 1's MMAs
        # are in flight. No accumulator is carried in flight across the loop's back edge: Gluon unpacks an fp16
        # accumulator right after its wgmma, and across the back edge ptxas then serializes every wgmma (C7514).
        acc0 = gl.zeros([HALF_M, BLOCK_N], gl.float32, mma_layout)
        acc1 = gl.zeros([HALF_M, BLOCK_N], gl.float32, mma_layout)
        part0 = gl.zeros([HALF_M, BLOCK_N], gl.float16, mma_layout)
        part1 = gl.zeros([HALF_M, BLOCK_N], gl.float16, mma_layout)
        for step in range(n_steps):
            slot = step % STAGES
            mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
            a = a_ring.index(slot)
            b = b_ring.index(slot).permute((1, 0))  # w's [BLOCK_N, BLOCK_K] tile as the K-major B operand
            part0 = warpgroup_mma(a.slice(0, HALF_M), b, part0, use_acc=False, is_async=True)
            part1 = warpgroup_mma(a.slice(HALF_M, HALF_M), b, part1, use_acc=False, is_async=True)
            part0 = warpgroup_mma_wait(num_outstanding=1, deps=(part0,))
            acc0 += part0.to(gl.float32)
            part1 = warpgroup_mma_wait(num_outstanding=0, deps=(part1,))
            # Every MMA up to this step's has retired: the slot of step - 1 takes step + STAGES - 1.
            _load_step(a_desc, b_desc, a_ring, b_ring, ready, step + STAGES - 1, off_m, off_n, n_steps, tile_bytes)
            acc1 += part1.to(gl.float32)

        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))

        _store_half(acc0, off_m, y_ptr, bias_ptr, off_n, M, N, stride_ym, HAS_BIAS, HALF_M, BLOCK_N, mma_layout)
        _store_half(acc1, off_m + HALF_M, y_ptr, bias_ptr, off_n, M, N, stride_ym, HAS_BIAS, HALF_M, BLOCK_N,
                    mma_layout)  # fmt: skip

    @gluon.jit
    def _load_step(a_desc, b_desc, a_ring, b_ring, ready, step, off_m, off_n, n_steps, tile_bytes: gl.constexpr):
        # TMA loads of one K step (x and w tiles) into its ring slot; a step past the end is predicated off.
        slot = step % a_ring.shape[0]
        k = step * a_desc.block_type.shape[1]
        live = step < n_steps
        mbarrier.expect(ready.index(slot), tile_bytes, pred=live)
        tma.async_copy_global_to_shared(a_desc, [off_m, k], ready.index(slot), a_ring.index(slot), pred=live)
        tma.async_copy_global_to_shared(b_desc, [off_n, k], ready.index(slot), b_ring.index(slot), pred=live)

    @gluon.jit
    def _store_half(acc, off_m, y_ptr, bias_ptr, off_n, M, N, stride_ym, HAS_BIAS: gl.constexpr,
                    ROWS: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr):  # fmt: skip
        offs_m = off_m + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        n_ok = offs_n < N
        if HAS_BIAS:
            acc += gl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(gl.float32)[None, :]
        ptrs = y_ptr + offs_m.to(gl.int64)[:, None] * stride_ym + offs_n[None, :]
        gl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & n_ok[None, :])


def fp16acc_wgmma_supported(x: Tensor, w: Tensor) -> bool:
    """Whether `fp16acc_wgmma` can run this call: Gluon present, an sm_90 CUDA device, rows 16-byte aligned for
    TMA (K a multiple of 8, contiguous operands)."""
    if not GLUON_AVAILABLE or x.device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(x.device) != (9, 0):
        return False
    k = x.shape[-1]
    return k % 8 == 0 and x.is_contiguous() and w.is_contiguous() and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0


def _shared_layout(block_shape: list[int]):
    return gl.NVMMASharedLayout.get_default_for(block_shape, gl.float16)


def fp16acc_wgmma(
    x16: Tensor,
    w16: Tensor,
    bias: Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    tile: WgmmaTile = DEFAULT_TILE,
) -> Tensor:
    """y = x16 @ w16.t() (+ bias), FP16 accumulation inside each 64-wide K chunk, FP32 across chunks.
    x16: [M, K] fp16, w16: [N, K] fp16, both contiguous (see `fp16acc_wgmma_supported`) → [M, N] out_dtype."""
    if x16.dtype != torch.float16 or w16.dtype != torch.float16:
        raise ValueError(f"fp16acc_wgmma: expected fp16 x and w, found {x16.dtype}, {w16.dtype}")
    m, k = x16.shape
    n = w16.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=x16.device)
    if m == 0:
        return y
    a_desc = TensorDescriptor.from_tensor(x16, [tile.block_m, BLOCK_K], _shared_layout([tile.block_m, BLOCK_K]))
    b_desc = TensorDescriptor.from_tensor(w16, [tile.block_n, BLOCK_K], _shared_layout([tile.block_n, BLOCK_K]))
    grid = (triton.cdiv(m, tile.block_m) * triton.cdiv(n, tile.block_n),)
    _fp16acc_wgmma_kernel[grid](
        a_desc, b_desc, y, bias if bias is not None else y, m, n, k, y.stride(0),
        HAS_BIAS=bias is not None, STAGES=tile.stages, GROUP_M=tile.group_m, num_warps=tile.num_warps,
    )  # fmt: skip
    return y
