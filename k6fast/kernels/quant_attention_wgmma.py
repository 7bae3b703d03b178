"""The quantized attention core for sm_90 in Gluon: two consumer warpgroups and a TMA producer per CTA.

Why not the Triton kernel (`quant_attention_core._quant_attention_kernel`): Triton 3.6 (the GPU machine's) never keeps
an INT32-accumulator wgmma in flight, converts P to the FP8 A operand through warp shuffles and byte repacking (a
third of the softmax's instructions), and leaves no registers at 128-key tiles for more. Here one CTA holds 128
query rows as two warpgroups of 64 that run free of each other: while one computes its softmax, the other's MMAs
run. Making them take turns (FlashAttention-3's ping-pong, `pingpong=True`, an mbarrier per warpgroup passing the
turn) was slower on an H200 (measurements/sessions/2026-11-29_attention-tree/README.md, as the figures below).

  warpgroup, iteration t:  softmax of S_t -> P_t, packed to e4m3 in registers (the A operand of P·V);
                           issue S_{t+1} = Q·K_{t+1}ᵀ (INT8) and P_t·V_t (FP8, from zero); wait for both;
                           release K/V slot t;  acc = acc·alpha_t + P_t·V_t.

P never leaves its thread: the A operand's key order within each 32-key block is taken to be the score accumulator's
own (`_to_a_operand`), and Vᵀ comes in that key order (`quant_attention_prologue.v_key_order`, stored so by the
prologue). Two-level accumulation as the Triton kernel (each tile's P·V from zero, added in FP32); the same quantized
inputs (`QuantizedQKV` of quant_attention_prologue.py, FP8 P·V) and per-element softmax arithmetic; checked against
`attention_quantized_ref`.

A one-warp producer partition loads Q once and K/Vᵀ tiles into a STAGES-deep ring by TMA (a slot is refilled once
both warpgroups have released it; 4 deep by default, the fastest of rings 2 to 4 at W1 on an H200). Per consumer
thread: one score tile, the P·V tile and the accumulator, no spills at 240 registers.

What bounds it (ablations on an H200): one warpgroup's serial chain from its MMAs' wait through the softmax to the
next issue. Taking the softmax out (and then the K/V loads) shows how much of the time it holds; the fold and MUFU
exp2 are its largest parts; moving a half or a quarter of the exp2s to the FMA pipe, staggering the warpgroups,
ping-pong, issuing Q·Kᵀ before the exp2s and unrolling two tiles did not help; row max and sum as trees
(`gluon_hopper.row_reduce`) shortened the chain. Earlier measurements:
measurements/sessions/2026-11-29_attention-gluon-core/README.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language

# The softmax constants are the Triton core's (int32 + MAGIC_I's bits = fp32 1.5·2**23 + x; log2(FP8_MAX)).
from .attention_constants import LOG2_FP8_MAX, MAGIC_F, MAGIC_I, Q_BLOCK, on_device
from .gluon_hopper import GLUON_AVAILABLE
from .quant_attention_prologue import QuantizedQKV, v_key_order

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

__all__ = ["BLOCK_M", "DEFAULT_STAGES", "GLUON_AVAILABLE", "attention_quantized_wgmma", "wgmma_attention_supported"]

BLOCK_M = 128  # query rows per CTA: two warpgroups of 64 (one Q scale block, attention_constants.Q_BLOCK)
WG_ROWS = 64  # query rows per consumer warpgroup
DEFAULT_STAGES = 4  # K/Vᵀ ring depth (see the module docstring)
_WG_ROWS = triton.language.constexpr(WG_ROWS)


if GLUON_AVAILABLE:

    @gluon.jit
    def _probs(s, m_i, l_i, sc, t, N, BLOCK_N: gl.constexpr, MASK: gl.constexpr, s_layout: gl.constexpr):
        # Online softmax of one tile, as quant_attention_core._tile_probs (P scaled to e4m3's range). The row max is
        # taken on the int32 scores (exact, like the float max of the magic-number floats), so the 64 magic adds run
        # beside it instead of before it.
        f = (s + MAGIC_I).to(gl.float32, bitcast=True)
        if MASK:
            cols = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            valid = (cols < N)[None, :]
            # f's mask is redundant (p is masked below) but kept: without it ptxas allocated the main loop's
            # registers differently and the core ran slower on an H200
            # (measurements/sessions/2026-11-29_attention-tree/README.md).
            f = gl.where(valid, f, 0.0)
            s = gl.where(valid, s, -2147483647)  # below every valid score
        s_max = row_reduce(s, True, m_i)
        m_new = gl.maximum(m_i, s_max.to(gl.float32) * sc)
        alpha = gl.exp2(m_i - m_new)
        bias = m_new + MAGIC_F * sc - LOG2_FP8_MAX
        p = gl.exp2(f * sc - bias[:, None])
        if MASK:
            p = gl.where(valid, p, 0.0)
        l_i = l_i * alpha + row_reduce(p, False, l_i)
        return p, m_new, l_i, alpha

    @gluon.jit
    def _to_a_operand(p, p_layout: gl.constexpr):
        # P (fp32, the score accumulator's layout) -> the FP8 A operand of P·V, without moving data between threads.
        # In each 32-key block a thread's accumulator holds keys {8i + 2q + e} (i < 4, e < 2; q = lane % 4) and its
        # A-operand registers want keys {16·(i // 2) + 4q + 2·(i % 2) + e}: the same count, other positions. Taking
        # the A operand's key order to be this permutation of P's makes the conversion a per-thread byte packing;
        # Vᵀ's keys come in the same order (quant_attention_prologue.v_key_order; the prologue stores it so when asked).
        BM: gl.constexpr = p.shape[0]
        BN: gl.constexpr = p.shape[1]
        p = gl.reshape(p, [BM, BN // 32, 2, 2, 4, 2])  # (row, block, i // 2, i % 2, q, e)
        p = gl.convert_layout(gl.reshape(gl.permute(p, (0, 1, 2, 4, 3, 5)), [BM, BN]), p_layout, assert_trivial=True)
        # Four consecutive keys of a thread's row are one A register: two cvt.e4m3x2 and a move fill it (the
        # compiler's own fp32 -> fp8 conversion unpacks to bytes and repacks, 3x the instructions).
        return gl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
            "mov.b32 $0, {lo, hi}; }",
            "=r,r,r,r,r", [p], dtype=gl.float8e4nv, is_pure=True, pack=4,
        )  # fmt: skip

    @gluon.jit
    def _issue(
        t, q_s, p8, k_ring, v_ring, ready, turn, s_buf, pv_buf,
        WG: gl.constexpr, HAS_QK: gl.constexpr, HAS_PV: gl.constexpr, PINGPONG: gl.constexpr,
    ):  # fmt: skip
        # Step t of one warpgroup, on its turn: S_t = Q·K_tᵀ (if t < n_tiles) and P_{t-1}·V_{t-1} (from zero; none at
        # t = 0). The accumulator arguments are dead tiles passed for their registers (use_acc=False ignores them).
        STAGES: gl.constexpr = k_ring.shape[0]
        if HAS_QK:
            mbarrier.wait(ready.index(t % STAGES), (t // STAGES) & 1)
        if PINGPONG:
            mbarrier.wait(turn.index(WG), t & 1)
        if HAS_QK:
            s_buf = warpgroup_mma(
                q_s, k_ring.index(t % STAGES).permute((1, 0)), s_buf, use_acc=False, is_async=True
            )  # fmt: skip
        if HAS_PV:
            pv_buf = warpgroup_mma(
                p8, v_ring.index((t - 1) % STAGES).permute((1, 0)), pv_buf, use_acc=False, is_async=True
            )  # fmt: skip
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - WG))
        return s_buf, pv_buf

    @gluon.jit
    def _consumer(
        WG: gl.constexpr, q_smem, k_ring, v_ring, q_bar, ready, empty, turn, QS, KS, VS, VO, Out,
        stride_ob, stride_oh, stride_om, stride_od, pid_m, bh, H, M, N, M_PAD, N_PAD, Q_BLK: gl.constexpr,
        PINGPONG: gl.constexpr,
    ):  # fmt: skip
        STAGES: gl.constexpr = k_ring.shape[0]
        BLOCK_N: gl.constexpr = k_ring.shape[1]
        HEAD_DIM: gl.constexpr = k_ring.shape[2]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 32]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        row0 = pid_m * (2 * _WG_ROWS) + WG * _WG_ROWS
        n_tiles = N_PAD // BLOCK_N
        q_scale = gl.load(QS + bh * (M_PAD // Q_BLK) + row0 // Q_BLK)
        ks_ptr = KS + bh * n_tiles
        q_s = q_smem.index(WG)
        acc = gl.zeros([_WG_ROWS, HEAD_DIM], gl.float32, o_layout)
        pv = gl.zeros([_WG_ROWS, HEAD_DIM], gl.float32, o_layout)
        s = gl.zeros([_WG_ROWS, BLOCK_N], gl.int32, s_layout)
        p8 = gl.zeros([_WG_ROWS, BLOCK_N], gl.float8e4nv, p_layout)  # unused at step 0
        m_i = gl.full([_WG_ROWS], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([_WG_ROWS], gl.float32, row_s)
        mbarrier.wait(q_bar, 0)

        s, pv = _issue(0, q_s, p8, k_ring, v_ring, ready, turn, s, pv, WG, True, False, PINGPONG)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        # Iteration t: the softmax of S_t, then step t+1 (S_{t+1} and P_t·V_t), then P_t·V_t folded into acc. P_t is
        # made and used in one iteration, so the FP8 A operand never crosses the loop edge as separate bytes.
        k_scale = gl.load(ks_ptr)
        for t in range(0, n_tiles - 1):
            sc = q_scale * k_scale
            k_scale = gl.load(ks_ptr + t + 1)  # a step ahead: its latency stays off the softmax's path
            p, m_i, l_i, alpha = _probs(s, m_i, l_i, sc, t, N, BLOCK_N, False, s_layout)
            p8 = _to_a_operand(p, p_layout)
            s, pv = _issue(t + 1, q_s, p8, k_ring, v_ring, ready, turn, s, pv, WG, True, True, PINGPONG)
            s, pv = warpgroup_mma_wait(num_outstanding=0, deps=(s, pv))
            mbarrier.arrive(empty.index(t % STAGES))  # both K_t and V_t are read
            acc = acc * gl.convert_layout(alpha, row_o)[:, None] + pv
        t = n_tiles - 1  # the last key tile, ragged when N is not a multiple of BLOCK_N
        p, m_i, l_i, alpha = _probs(s, m_i, l_i, q_scale * k_scale, t, N, BLOCK_N, True, s_layout)
        # The last P·V.
        p8 = _to_a_operand(p, p_layout)
        s, pv = _issue(n_tiles, q_s, p8, k_ring, v_ring, ready, turn, s, pv, WG, False, True, PINGPONG)
        pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
        mbarrier.arrive(empty.index((n_tiles - 1) % STAGES))
        acc = acc * gl.convert_layout(alpha, row_o)[:, None] + pv

        offs_m = row0 + gl.arange(0, _WG_ROWS, layout=row_o)
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        out = acc / gl.convert_layout(l_i, row_o)[:, None]  # P's factor FP8_MAX is in both acc and l
        out = out * gl.load(VS + bh * HEAD_DIM + offs_d)[None, :] + gl.load(VO + bh * HEAD_DIM + offs_d)[None, :]
        b = (bh // H).to(gl.int64)
        h = (bh % H).to(gl.int64)
        ptrs = (
            Out + b * stride_ob + h * stride_oh + offs_m.to(gl.int64)[:, None] * stride_om + offs_d[None, :] * stride_od
        )
        gl.store(ptrs, out.to(Out.dtype.element_ty), mask=(offs_m < M)[:, None])

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_bar, ready, empty, bh, pid_m, M_PAD, N_PAD):
        STAGES: gl.constexpr = k_ring.shape[0]
        BLOCK_N: gl.constexpr = k_ring.shape[1]
        HEAD_DIM: gl.constexpr = k_ring.shape[2]
        q_row0 = bh * M_PAD + pid_m * (2 * _WG_ROWS)
        mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row0, 0], q_bar, q_smem.index(0))
        tma.async_copy_global_to_shared(q_desc, [q_row0 + _WG_ROWS, 0], q_bar, q_smem.index(1))
        k_row0 = bh * N_PAD
        v_row0 = bh * HEAD_DIM
        for j in range(0, N_PAD // BLOCK_N):
            slot = j % STAGES
            # Slot reuse: both warpgroups released its previous tile (a fresh barrier passes parity 1 at once).
            mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [k_row0 + j * BLOCK_N, 0], ready.index(slot), k_ring.index(slot))
            tma.async_copy_global_to_shared(v_desc, [v_row0, j * BLOCK_N], ready.index(slot), v_ring.index(slot))

    @gluon.jit
    def _qattn_wgmma_kernel(
        q_desc, k_desc, v_desc, QS, KS, VS, VO, Out,
        stride_ob, stride_oh, stride_om, stride_od, H, M, N, M_PAD, N_PAD,
        Q_BLK: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PINGPONG: gl.constexpr,
        num_warps: gl.constexpr,
    ):  # fmt: skip
        pid_m = gl.program_id(0)  # fastest: neighbouring CTAs share one head's K/V in L2
        bh = gl.program_id(1)
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
        k_ring = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_ring = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready, empty = ring_barriers(STAGES, 2)  # a slot is free once both consumer warpgroups released it
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        mbarrier.init(turn.index(0), count=1)
        mbarrier.init(turn.index(1), count=1)
        fence_async_shared()
        mbarrier.arrive(turn.index(0))  # warpgroup 0 goes first

        consumer_args = (
            q_smem, k_ring, v_ring, q_bar, ready, empty, turn, QS, KS, VS, VO, Out,
            stride_ob, stride_oh, stride_om, stride_od, pid_m, bh, H, M, N, M_PAD, N_PAD, Q_BLK,
            PINGPONG,
        )  # fmt: skip
        gl.warp_specialize(
            [
                (_consumer, (0,) + consumer_args),
                (_consumer, (1,) + consumer_args),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_bar, ready, empty, bh, pid_m,
                             M_PAD, N_PAD)),
            ],
            [4, 1],
            [CONSUMER_REGS, 24],
        )  # fmt: skip


def wgmma_attention_supported(qkv: QuantizedQKV) -> bool:
    """Whether the Gluon core runs these quantized inputs: sm_90, FP8 P·V, head_dim 64 or 128, Gluon importable."""
    dev = qkv.q8.device
    return (
        GLUON_AVAILABLE
        and dev.type == "cuda"
        and torch.cuda.get_device_capability(dev) == (9, 0)
        and qkv.pv_fp8
        and qkv.q8.shape[3] in (64, 128)
        and qkv.k_block in (64, 128)
    )


def attention_quantized_wgmma(
    qkv: QuantizedQKV, *, stages: int = DEFAULT_STAGES, consumer_regs: int = 240, pingpong: bool = False
) -> torch.Tensor:
    """The Gluon core on a FP8-P·V ``QuantizedQKV`` (its key tile is qkv.k_block) -> [B, H, M, D] in qkv.out_dtype."""
    if not qkv.pv_fp8:
        raise ValueError("attention_quantized_wgmma: expected a pv_fp8 QuantizedQKV")
    if stages < 2:  # a warpgroup waits for tile t+1's slot before it releases tile t's
        raise ValueError(f"attention_quantized_wgmma: stages must be >= 2, found {stages}")
    if not wgmma_attention_supported(qkv):
        dev = qkv.q8.device
        cap = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
        raise ValueError(
            "attention_quantized_wgmma: expected an sm_90 GPU with Gluon, head_dim 64 or 128 and k_block 64 or 128; "
            f"found device {dev} (capability {cap}), Gluon {GLUON_AVAILABLE}, head_dim {qkv.q8.shape[3]}, "
            f"k_block {qkv.k_block}"
        )
    b, h, m_pad, d = qkv.q8.shape
    n_pad = qkv.k8.shape[2]
    bn = qkv.k_block
    # quantize_qkv pads M to Q_BLOCK (128) = BLOCK_M: one Q scale per CTA.
    out = torch.empty((b, h, qkv.num_q, d), dtype=qkv.out_dtype, device=qkv.q8.device)

    def desc(t: torch.Tensor, block: list[int], dtype):
        return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, dtype))

    q_desc = desc(qkv.q8.view(b * h * m_pad, d), [WG_ROWS, d], gl.int8)
    k_desc = desc(qkv.k8.view(b * h * n_pad, d), [bn, d], gl.int8)
    vt = qkv.vt if qkv.v_key_perm else v_key_order(qkv.vt)  # quantize_qkv(v_key_perm=True) saves this copy
    v_desc = desc(vt.view(b * h * d, n_pad), [d, bn], gl.float8e4nv)
    with on_device(qkv.q8.device):
        _qattn_wgmma_kernel[(m_pad // BLOCK_M, b * h)](
            q_desc, k_desc, v_desc, qkv.q_scale, qkv.k_scale, qkv.v_scale, qkv.v_offset, out,
            *out.stride(), h, qkv.num_q, qkv.num_kv, m_pad, n_pad,
            Q_BLK=Q_BLOCK, STAGES=stages, CONSUMER_REGS=consumer_regs, PINGPONG=pingpong, num_warps=4,
        )  # fmt: skip
    return out
