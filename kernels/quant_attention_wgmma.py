"""Experimental: the quantized attention core for sm_90 in Gluon, with the INT8 Q·Kᵀ kept in flight.

Triton's wgmma pipeliner never keeps an INT32-accumulator dot in flight (only FP32 ones), so in
`quant_attention._quant_attention_kernel` every Q·Kᵀ waits at once and a tile's softmax can only overlap the
previous tile's P·V. Gluon issues and waits wgmma explicitly, so here (FlashAttention-3's intra-warpgroup order):

  iteration j (S_j ready): issue Q·K_{j+1}ᵀ;  softmax of S_j (overlaps Q·K_{j+1}ᵀ and P·V_{j-1});
                           wait for both, fold P·V_{j-1} into acc;  issue P_j·V_j (in flight into iteration j+1).

K and Vᵀ tiles come in by TMA into a STAGES-deep ring. Same quantized inputs (`QuantizedQKV`, FP8 P·V) and the
same per-element softmax arithmetic as the Triton kernel; `attention_quantized_wgmma` is checked against
`quant_attention.attention_quantized_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language

from .quant_attention import Q_BLOCK, QuantizedQKV

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    GLUON_AVAILABLE = True
except ImportError:  # pragma: no cover
    GLUON_AVAILABLE = False

__all__ = ["GLUON_AVAILABLE", "attention_quantized_wgmma"]

_MAGIC_I = triton.language.constexpr(0x4B400000)  # see quant_attention: int32 + these bits = fp32 1.5 * 2**23 + x
_MAGIC_F = triton.language.constexpr(12582912.0)
_LOG2_FP8_MAX = triton.language.constexpr(8.807354922057604)  # log2(448)


if GLUON_AVAILABLE:

    @gluon.jit
    def _load_kv(k_desc, v_desc, k_ring, v_ring, ready, j, n_tiles, k_row0, v_row0, BLOCK_N: gl.constexpr):
        slot = j % k_ring.shape[0]
        live = j < n_tiles
        mbarrier.expect(ready.index(slot), k_desc.block_type.nbytes + v_desc.block_type.nbytes, pred=live)
        tma.async_copy_global_to_shared(
            k_desc, [k_row0 + j * BLOCK_N, 0], ready.index(slot), k_ring.index(slot), pred=live
        )
        tma.async_copy_global_to_shared(v_desc, [v_row0, j * BLOCK_N], ready.index(slot), v_ring.index(slot), pred=live)

    @gluon.jit
    def _probs(s, m_i, l_i, sc, j, N, BLOCK_N: gl.constexpr, MASK: gl.constexpr, s_layout: gl.constexpr):
        # Online softmax of one tile, as quant_attention._tile_probs (P scaled to e4m3's range).
        f = (s + _MAGIC_I).to(gl.float32, bitcast=True)
        if MASK:
            cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            valid = (cols < N)[None, :]
            f = gl.where(valid, f, 0.0)
        m_new = gl.maximum(m_i, (gl.max(f, 1) - _MAGIC_F) * sc)
        alpha = gl.exp2(m_i - m_new)
        bias = m_new + _MAGIC_F * sc - _LOG2_FP8_MAX
        p = gl.exp2(f * sc - bias[:, None])
        if MASK:
            p = gl.where(valid, p, 0.0)
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, m_new, l_i, alpha

    @gluon.jit
    def _qattn_wgmma_kernel(
        q_desc, k_desc, v_desc, QS, KS, VS, VO, Out,
        stride_ob, stride_oh, stride_om, stride_od, H, M, N, M_PAD, N_PAD,
        Q_BLK: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        pid_m = gl.program_id(0)
        bh = gl.program_id(1)

        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 32]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 32]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
        k_ring = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_ring = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)

        n_tiles = N_PAD // BLOCK_N
        k_row0 = bh * N_PAD
        v_row0 = bh * HEAD_DIM
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [bh * M_PAD + pid_m * BLOCK_M, 0], q_bar, q_smem)
        for s in gl.static_range(STAGES - 1):
            _load_kv(k_desc, v_desc, k_ring, v_ring, ready, s, n_tiles, k_row0, v_row0, BLOCK_N)

        q_scale = gl.load(QS + bh * (M_PAD // Q_BLK) + (pid_m * BLOCK_M) // Q_BLK)
        ks_ptr = KS + bh * n_tiles
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, s_layout)
        o_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)

        mbarrier.wait(q_bar, 0)
        mbarrier.wait(ready.index(0), 0)
        s_cur = warpgroup_mma(q_smem, k_ring.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s_cur = warpgroup_mma_wait(num_outstanding=0, deps=(s_cur,))
        pv = warpgroup_mma_init(o_zero)  # "P·V of tile -1": nothing
        alpha_pv = gl.full([BLOCK_M], 1.0, gl.float32, row_o)  # acc's rescale before pv is folded in
        for j in range(0, n_tiles - 1):
            # Q·K_{j+1}ᵀ in flight while the softmax of tile j runs (P·V_{j-1}, issued last iteration, may be too).
            nslot = (j + 1) % STAGES
            mbarrier.wait(ready.index(nslot), ((j + 1) // STAGES) & 1)
            s_nxt = warpgroup_mma(q_smem, k_ring.index(nslot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            sc = q_scale * gl.load(ks_ptr + j)
            p, m_i, l_i, alpha = _probs(s_cur, m_i, l_i, sc, j, N, BLOCK_N, False, s_layout)
            # Wait for both (P·V_{j-1} and Q·K_{j+1}ᵀ): a wait that left Q·K_{j+1}ᵀ in flight while acc reads P·V's
            # registers makes ptxas serialize every wgmma (C7514; it cannot order groups across the loop's edge).
            pv, s_cur = warpgroup_mma_wait(num_outstanding=0, deps=(pv, s_nxt))
            acc = acc * alpha_pv[:, None] + pv
            # Its K/V slot (tile j-1) is free: refill it with tile j-1+STAGES.
            _load_kv(k_desc, v_desc, k_ring, v_ring, ready, j + STAGES - 1, n_tiles, k_row0, v_row0, BLOCK_N)
            p8 = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
            slot = j % STAGES
            pv = warpgroup_mma(p8, v_ring.index(slot).permute((1, 0)), o_zero, use_acc=False, is_async=True)
            alpha_pv = gl.convert_layout(alpha, row_o)
        # the last tile (ragged when N is not a multiple of BLOCK_N)
        j = n_tiles - 1
        sc = q_scale * gl.load(ks_ptr + j)
        p, m_i, l_i, alpha = _probs(s_cur, m_i, l_i, sc, j, N, BLOCK_N, True, s_layout)
        pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
        acc = acc * alpha_pv[:, None] + pv
        p8 = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
        pv = warpgroup_mma(p8, v_ring.index(j % STAGES).permute((1, 0)), o_zero, use_acc=False, is_async=True)
        pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
        acc = acc * gl.convert_layout(alpha, row_o)[:, None] + pv

        mbarrier.invalidate(q_bar)
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))

        offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_o)
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        out = acc / gl.convert_layout(l_i, row_o)[:, None]  # P's factor 448 is in both acc and l
        out = out * gl.load(VS + bh * HEAD_DIM + offs_d)[None, :] + gl.load(VO + bh * HEAD_DIM + offs_d)[None, :]
        b = (bh // H).to(gl.int64)
        h = (bh % H).to(gl.int64)
        ptrs = (
            Out + b * stride_ob + h * stride_oh + offs_m.to(gl.int64)[:, None] * stride_om + offs_d[None, :] * stride_od
        )
        gl.store(ptrs, out.to(Out.dtype.element_ty), mask=(offs_m < M)[:, None])


def attention_quantized_wgmma(
    qkv: QuantizedQKV, *, block_m: int = 64, num_warps: int = 4, stages: int = 3
) -> torch.Tensor:
    """The Gluon core on a FP8-P·V ``QuantizedQKV`` (its key tile is qkv.k_block) -> [B, H, M, D] in qkv.out_dtype."""
    if not qkv.pv_fp8:
        raise ValueError("attention_quantized_wgmma: expected a pv_fp8 QuantizedQKV")
    b, h, m_pad, d = qkv.q8.shape
    n_pad = qkv.k8.shape[2]
    bn = qkv.k_block
    if m_pad % block_m:
        raise ValueError(f"attention_quantized_wgmma: M_pad {m_pad} is not a multiple of block_m {block_m}")
    out = torch.empty((b, h, qkv.num_q, d), dtype=qkv.out_dtype, device=qkv.q8.device)

    def desc(t: torch.Tensor, block: list[int], dtype):
        return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, dtype))

    q_desc = desc(qkv.q8.view(b * h * m_pad, d), [block_m, d], gl.int8)
    k_desc = desc(qkv.k8.view(b * h * n_pad, d), [bn, d], gl.int8)
    v_desc = desc(qkv.vt.view(b * h * d, n_pad), [d, bn], gl.float8e4nv)
    _qattn_wgmma_kernel[(m_pad // block_m, b * h)](
        q_desc, k_desc, v_desc, qkv.q_scale, qkv.k_scale, qkv.v_scale, qkv.v_offset, out,
        *out.stride(), h, qkv.num_q, qkv.num_kv, m_pad, n_pad,
        Q_BLK=Q_BLOCK, STAGES=stages, num_warps=num_warps,
    )  # fmt: skip
    return out
