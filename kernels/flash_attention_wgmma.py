"""Exact BF16/FP16 attention for sm_90 in Gluon: the quantized core's CTA shape with 16-bit operands throughout.

Why: on an H200 cuDNN's SDPA is the fastest exact attention PyTorch offers, and attention is most of a Pro block's
device time on the exact path. At 16-bit the MMAs per key tile take twice the FP8 core's time while the softmax
costs the same, so a warpgroup's softmax hides behind MMAs (its own P·V and the other warpgroup's): faster than
cuDNN at W1 on an H200, bounded by the K/V ring's depth (measurements/sessions/2026-11-29_exact-attention/README.md).

  CTA: 128 query rows = two consumer warpgroups of 64 that run free of each other, and a one-warp TMA producer that
  loads Q once and K and V tiles ([BLOCK_N, D] each, straight from the [B, N, H, D] projections: no copies, no
  transposes; wgmma reads V's tile N-major) into a STAGES-deep ring (3 at 128 keys: 2 left the tensor cores waiting
  for loads, slower than cuDNN at W1 on an H200, in the same record).
  warpgroup, iteration t:  issue S_{t+1} = Q·K_{t+1}ᵀ and acc += P_t·V_t; wait for S_{t+1} only; its softmax (fp32,
                           exp2 with the scale folded in) runs while P_t·V_t is in flight -> P_{t+1} in bf16/fp16
                           registers (the score accumulator's layout is the A operand's at 16 bits: no data moves);
                           wait for P_t·V_t, release slot t, acc *= alpha_{t+1}.

Rows past the sequence in a tile read the next sequence's (or TMA's zero-filled) rows: their keys are masked to
-inf (only the ragged tile needs it; it is loaded first) and their queries are never stored. Checked against FP32
attention by the flash-attention rule (no worse than twice SDPA's error), as every exact kernel here.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language

from .attention_constants import on_device
from .gluon_hopper import GLUON_AVAILABLE

if GLUON_AVAILABLE:
    from .gluon_hopper import (
        TensorDescriptor,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        ring_barriers,
        row_reduce,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

__all__ = [
    "DEFAULT_BLOCK_N",
    "DEFAULT_STAGES",
    "GLUON_AVAILABLE",
    "flash_attention",
    "flash_attention_op",
    "flash_attention_supported",
]

WG_ROWS = 64  # query rows per consumer warpgroup; a CTA has two
DEFAULT_BLOCK_N = 128
DEFAULT_STAGES = 3
_WG_ROWS = triton.language.constexpr(WG_ROWS)
_LOG2E = 1.4426950408889634


if GLUON_AVAILABLE:

    @gluon.jit
    def _softmax(s, m_i, l_i, qk_scale, t, N, BLOCK_N: gl.constexpr, MASK: gl.constexpr, s_layout: gl.constexpr):
        # Online softmax of one tile in the exp2 domain: m is the running row max of s·qk_scale (qk_scale > 0).
        if MASK:
            cols = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            s = gl.where((cols < N)[None, :], s, float("-inf"))
        s_max = row_reduce(s, True, m_i)
        m_new = gl.maximum(m_i, s_max * qk_scale)
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s * qk_scale - m_new[:, None])
        l_i = l_i * alpha + row_reduce(p, False, l_i)
        return p, m_new, l_i, alpha

    @gluon.jit
    def _a_operand(p, acc, dtype: gl.constexpr):
        # P in the operands' dtype as the A operand of P·V: at 16 bits the score accumulator's layout is the A
        # operand's, so this is a per-thread conversion.
        layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2)
        return gl.convert_layout(p.to(dtype), layout, assert_trivial=True)

    @gluon.jit
    def _consumer(
        WG: gl.constexpr, q_smem, k_ring, v_ring, q_bar, ready, empty, Out,
        stride_ob, stride_om, stride_oh, pid_m, b, h, M, N, qk_scale,
    ):  # fmt: skip
        STAGES: gl.constexpr = k_ring.shape[0]
        BLOCK_N: gl.constexpr = k_ring.shape[1]
        HEAD_DIM: gl.constexpr = k_ring.shape[2]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        n_tiles = gl.cdiv(N, BLOCK_N)
        q_s = q_smem.index(WG)
        acc = gl.zeros([_WG_ROWS, HEAD_DIM], gl.float32, o_layout)
        s = gl.zeros([_WG_ROWS, BLOCK_N], gl.float32, s_layout)
        m_i = gl.full([_WG_ROWS], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([_WG_ROWS], gl.float32, row_s)
        mbarrier.wait(q_bar, 0)

        # The ragged tile (the last, when N is not a multiple of BLOCK_N) comes first (`_producer`): only the first
        # softmax masks, and a one-tile sequence needs no other path. Slot t % STAGES holds load t.
        mbarrier.wait(ready.index(0), 0)
        s = warpgroup_mma(q_s, k_ring.index(0).permute((1, 0)), s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        p, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, n_tiles - 1, N, BLOCK_N, True, s_layout)
        p16 = _a_operand(p, acc, k_ring.dtype)
        for t in range(0, n_tiles - 1):
            # Issue S_{t+1} and P_t·V_t; the softmax of S_{t+1} runs while P_t·V_t is in flight (FlashAttention-3's
            # intra-warpgroup overlap; the other warpgroup's MMAs fill the rest).
            mbarrier.wait(ready.index((t + 1) % STAGES), ((t + 1) // STAGES) & 1)
            s = warpgroup_mma(q_s, k_ring.index((t + 1) % STAGES).permute((1, 0)), s, use_acc=False, is_async=True)
            acc = warpgroup_mma(p16, v_ring.index(t % STAGES), acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
            p, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, t, N, BLOCK_N, False, s_layout)
            acc, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p16))
            mbarrier.arrive(empty.index(t % STAGES))  # K_t and V_t are read
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p16 = _a_operand(p, acc, k_ring.dtype)
        t = n_tiles - 1
        acc = warpgroup_mma(p16, v_ring.index(t % STAGES), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(t % STAGES))

        offs_m = pid_m * (2 * _WG_ROWS) + WG * _WG_ROWS + gl.arange(0, _WG_ROWS, layout=row_o)
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        out = acc / gl.convert_layout(l_i, row_o)[:, None]
        base = Out + b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
        ptrs = base + offs_m.to(gl.int64)[:, None] * stride_om + offs_d[None, :]
        gl.store(ptrs, out.to(Out.dtype.element_ty), mask=(offs_m < M)[:, None])

    @gluon.jit
    def _producer(
        q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_bar, ready, empty, pid_m, b, h, M, N,
        Q_ROWS_B, KV_ROWS_B, ROWS_H, COL_H,
    ):  # fmt: skip
        STAGES: gl.constexpr = k_ring.shape[0]
        BLOCK_N: gl.constexpr = k_ring.shape[1]
        q_row0 = b * Q_ROWS_B + h * (M * ROWS_H) + pid_m * (2 * _WG_ROWS)
        col = h * COL_H
        mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row0, col], q_bar, q_smem.index(0))
        tma.async_copy_global_to_shared(q_desc, [q_row0 + _WG_ROWS, col], q_bar, q_smem.index(1))
        kv_row0 = b * KV_ROWS_B + h * (N * ROWS_H)
        n_tiles = gl.cdiv(N, BLOCK_N)
        for j in range(0, n_tiles):
            slot = j % STAGES
            # Slot reuse: both warpgroups released its previous tile (a fresh barrier passes parity 1 at once).
            mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            row = kv_row0 + ((j + n_tiles - 1) % n_tiles) * BLOCK_N  # the ragged last tile first
            tma.async_copy_global_to_shared(k_desc, [row, col], ready.index(slot), k_ring.index(slot))
            tma.async_copy_global_to_shared(v_desc, [row, col], ready.index(slot), v_ring.index(slot))

    @gluon.jit
    def _flash_attention_kernel(
        q_desc, k_desc, v_desc, Out, stride_ob, stride_om, stride_oh, H, M, N,
        Q_ROWS_B, KV_ROWS_B, ROWS_H, COL_H, qk_scale,
        STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        pid_m = gl.program_id(0)  # fastest: neighbouring CTAs share one head's K/V in L2
        bh = gl.program_id(1)
        b = bh // H
        h = bh % H
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
        k_ring = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_ring = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready, empty = ring_barriers(STAGES, 2)  # a slot is free once both consumer warpgroups released it
        mbarrier.init(q_bar, count=1)
        fence_async_shared()

        consumer_args = (
            q_smem, k_ring, v_ring, q_bar, ready, empty, Out, stride_ob, stride_om, stride_oh, pid_m, b, h, M, N,
            qk_scale,
        )  # fmt: skip
        gl.warp_specialize(
            [
                (_consumer, (0,) + consumer_args),
                (_consumer, (1,) + consumer_args),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_bar, ready, empty, pid_m, b, h, M, N,
                             Q_ROWS_B, KV_ROWS_B, ROWS_H, COL_H)),
            ],
            [4, 1],
            [CONSUMER_REGS, 24],
        )  # fmt: skip


def flash_attention_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the Gluon kernel takes these [B, N, H, D] inputs: an sm_90 GPU, Gluon importable, bf16 or fp16 (all
    three the same), head_dim 64 or 128, no broadcasting."""
    return (
        GLUON_AVAILABLE
        and q.is_cuda
        and torch.cuda.get_device_capability(q.device) == (9, 0)
        and q.dtype in (torch.bfloat16, torch.float16)
        and q.dtype == k.dtype == v.dtype
        and q.ndim == 4
        and q.shape[-1] in (64, 128)
        and k.shape == v.shape
        and k.shape[0] == q.shape[0]
        and k.shape[2:] == q.shape[2:]
    )


def _rows_view(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """x [B, N, H, D] -> (a 2-D view TMA can tile, rows per batch element, ROWS_H, COL_H): head h of token t of
    batch element b is row b·rows + h·ROWS_H·N + t, columns h·COL_H onwards. Two layouts are taken as they are: the
    projections' own (rows = tokens, columns = H·D, any aligned row stride: ROWS_H 0, COL_H D) and contiguous
    head-major ([B, H, N, D] transposed; rows = heads·tokens: ROWS_H 1, COL_H 0). Anything else is copied to the
    first."""
    bsz, n, h, d = x.shape
    sb, sn, sh, sd = x.stride()
    aligned = x.data_ptr() % 16 == 0
    if aligned and sd == 1 and sh == d and sn % 8 == 0 and (bsz == 1 or sb == n * sn):
        return x.as_strided((bsz * n, h * d), (sn, 1)), n, 0, d
    if aligned and sd == 1 and sn == d and sh == n * d and (bsz == 1 or sb == h * n * d):
        return x.as_strided((bsz * h * n, d), (d, 1)), h * n, 1, 0
    return _rows_view(x.contiguous())


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    sm_scale: float | None = None,
    block_n: int = DEFAULT_BLOCK_N,
    stages: int = DEFAULT_STAGES,
    consumer_regs: int = 240,
) -> torch.Tensor:
    """softmax(q·kᵀ·sm_scale)·v without a mask. q: [B, M, H, D], k/v: [B, N, H, D] (the DiT's token-major layout; a
    head-major tensor transposed to it is taken as is) -> a new contiguous [B, M, H, D] in q's dtype."""
    if not flash_attention_supported(q, k, v):
        cap = torch.cuda.get_device_capability(q.device) if q.is_cuda else None
        raise ValueError(
            "flash_attention: expected an sm_90 GPU with Gluon and [B, N, H, D] bf16/fp16 q, k, v of one dtype with "
            f"head_dim 64 or 128 and matching batch and heads; found device {q.device} (capability {cap}), Gluon "
            f"{GLUON_AVAILABLE}, dtypes {q.dtype}/{k.dtype}/{v.dtype}, shapes {tuple(q.shape)}/{tuple(k.shape)}/"
            f"{tuple(v.shape)}"
        )
    if block_n not in (64, 128) or stages < 2:
        raise ValueError(f"flash_attention: expected block_n 64 or 128 and stages >= 2, found {block_n}, {stages}")
    bsz, m, h, d = q.shape
    n = k.shape[1]
    if n == 0:
        raise ValueError("flash_attention: expected at least one key, found k and v with 0 tokens")
    out = torch.empty((bsz, m, h, d), dtype=q.dtype, device=q.device)
    if m == 0 or bsz * h == 0:
        return out
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    if not scale > 0.0:
        raise ValueError(f"flash_attention: expected sm_scale > 0, found {scale}")
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16

    def desc(x: torch.Tensor, rows: int):
        block = [rows, d]
        return TensorDescriptor.from_tensor(x, block, gl.NVMMASharedLayout.get_default_for(block, gdt))

    q2, q_rows_b, rows_h, col_h = _rows_view(q)
    k2, kv_rows_b, k_rows_h, k_col_h = _rows_view(k)
    v2, v_rows_b, v_rows_h, v_col_h = _rows_view(v)
    if (k_rows_h, k_col_h, v_rows_b, v_rows_h, v_col_h) != (rows_h, col_h, kv_rows_b, rows_h, col_h):
        # One layout for all three (the producer computes one set of coordinates).
        q2, q_rows_b, rows_h, col_h = _rows_view(q.contiguous())
        k2, kv_rows_b, _, _ = _rows_view(k.contiguous())
        v2, _, _, _ = _rows_view(v.contiguous())
    with on_device(q.device):
        _flash_attention_kernel[(triton.cdiv(m, 2 * WG_ROWS), bsz * h)](
            desc(q2, WG_ROWS), desc(k2, block_n), desc(v2, block_n), out, out.stride(0), out.stride(1),
            out.stride(2), h, m, n, q_rows_b, kv_rows_b, rows_h, col_h, scale * _LOG2E,
            STAGES=stages, CONSUMER_REGS=consumer_regs, num_warps=4,
        )  # fmt: skip
    return out


# For compiled callers (the DiT's compiled block): one opaque op, as quant_attention_op, so the Python checks above
# neither break the graph nor become guards.
@torch.library.custom_op("k6fast::flash_attention", mutates_args=())
def flash_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`flash_attention(q, k, v)` with sm_scale 1/sqrt(D): [B, M, H, D] in, a contiguous [B, M, H, D] out."""
    return flash_attention(q, k, v)


@flash_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return q.new_empty(q.shape)
