"""The Triton attention core of k6fast's quantized attention (quant_attention.py): INT8 Q·Kᵀ, online
softmax in FP32, FP8 (or FP16) P·V, on the operands the prologue (quant_attention_prologue.py) made. FP8 P·V sums
each key tile in FP32 or, on a ``QuantizedQKV`` with pv_fp16_acc (the default on GeForce sm_89/sm_12x), each 32 keys
in FP16 and those in FP32 (see ``_tile_pv``).

- ``attention_quantized(qkv, *, config)``: the core on a ``QuantizedQKV`` (steps 3 and 4 of the scheme).
- ``attention_quantized_ref``: the kernel's online softmax step by step in PyTorch (FP32; the same key tile per
  update, because the FP8 rounding of P depends on the running maximum).
- ``QuantAttentionConfig`` and the per-GPU table of launch parameters; ``CANDIDATE_CONFIGS`` for the sweep.

On sm_90 with FP8 P·V the Gluon core (quant_attention_wgmma.py) runs instead; quant_attention.py decides.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .attention_constants import (
    FP8_MAX,
    K_BLOCK,
    K_BLOCKS,
    LOG2_FP8_MAX,
    MAGIC_F,
    MAGIC_I,
    PV_CHUNK,
    Q_BLOCK,
    on_device,
)
from .quant_attention_prologue import QuantizedQKV, _interpreted, _require_triton, v_token_order

# 2**f on [-0.5, 0.5], relative error 7.6e-5 (near-minimax, degree 3).
_EXP2_C0 = tl.constexpr(0.99992755)
_EXP2_C1 = tl.constexpr(0.69326108)
_EXP2_C2 = tl.constexpr(0.24261758)
_EXP2_C3 = tl.constexpr(0.05517415)


@dataclass(frozen=True)
class QuantAttentionConfig:
    """Launch parameters of the attention core; none of them changes the numerics except ``block_n``, ``exp2_poly``
    and, with FP16 P·V, ``pipeline`` (each tile's P·V is then added to the FP32 accumulator instead of accumulated by
    the MMA into it).

    block_m: query rows per program (64 or 128; divides Q_BLOCK so a program sees one Q scale).
    block_n: keys per tile = keys per K scale = keys per online-softmax update (64 or 128). Changes the numerics
      (the K scale granularity), so the quantization is done for it: ``quantize_qkv(..., k_block=block_n)``.
    unroll: key tiles per loop iteration (1 or 2).
    exp2_poly: with unroll 2, the second tile of each pair computes exp2 with a cubic polynomial on the FMA units
      instead of the MUFU unit (FlashAttention-4's trick: MUFU does 16 exp2/clk/SM on sm_90, about as long as the
      INT8 and FP8 MMAs of the tile take). It costs about 8 FMA/ALU instructions per element on pipes the softmax
      already keeps busy, so whether it pays is for the benchmark sweep to say. Relative error of P 7.6e-5, far
      below P's FP8/FP16 rounding.
    pipeline: keep each tile's P·V MMA in flight through the next tile's softmax (the loop order is in the kernel;
      unroll 1 only). Needs registers for a second [block_m, head_dim] FP32 tile.
    maxnreg: registers per thread the compiler may use (None: its choice, up to 255). A cap lets more programs share
      an SM (65,536 registers), so one program's softmax overlaps another's MMAs, at the price of spills.
    """

    block_m: int = 128
    num_warps: int = 8
    num_stages: int = 3
    unroll: int = 1
    exp2_poly: bool = False
    maxnreg: int | None = None
    block_n: int = K_BLOCK
    pipeline: bool = False

    def __post_init__(self) -> None:
        if self.block_m not in (64, 128):
            raise ValueError(f"block_m: expected 64 or 128, found {self.block_m}")
        if self.num_warps not in (4, 8):
            raise ValueError(f"num_warps: expected 4 or 8, found {self.num_warps}")
        if not 1 <= self.num_stages <= 5:
            raise ValueError(f"num_stages: expected 1..5, found {self.num_stages}")
        if self.unroll not in (1, 2):
            raise ValueError(f"unroll: expected 1 or 2, found {self.unroll}")
        if self.exp2_poly and self.unroll != 2:
            raise ValueError(f"exp2_poly needs unroll=2 (it alternates with MUFU exp2), found unroll={self.unroll}")
        if self.pipeline and self.unroll != 1:
            raise ValueError(f"pipeline needs unroll=1, found unroll={self.unroll}")
        if self.block_n not in K_BLOCKS:
            raise ValueError(f"block_n: expected one of {K_BLOCKS}, found {self.block_n}")
        if self.maxnreg is not None and not 64 <= self.maxnreg <= 255:
            raise ValueError(f"maxnreg: expected None or 64..255, found {self.maxnreg}")


_DEFAULT_CONFIG = QuantAttentionConfig()
# Per compute capability, then (head_dim, FP8 P·V); anything missing runs _DEFAULT_CONFIG. Update from
# `measurements/bench_attention.py --sweep` results.
_CONFIGS: dict[tuple[int, int], dict[tuple[int, bool], QuantAttentionConfig]] = {
    # The fastest of the sweep at W1 on an H200 (measurements/sessions/2026-11-29_attention-sweep/README.md): with FP8
    # P·V one warpgroup and 128-key tiles at both head dims; FP16 P·V is best with the default.
    (9, 0): {
        (128, True): QuantAttentionConfig(64, 4, 3, block_n=128),
        (64, True): QuantAttentionConfig(64, 4, 4, maxnreg=168, block_n=128),
    },
}
# What `bench_attention.py --sweep` tries; small on purpose (each one is a separate compile).
CANDIDATE_CONFIGS: tuple[QuantAttentionConfig, ...] = (
    QuantAttentionConfig(128, 8, 3),
    QuantAttentionConfig(128, 8, 2, maxnreg=128),
    # One warpgroup per program: with registers and shared memory for two or three programs per SM, one program's
    # softmax runs while another's MMAs do (the overlap FA3 gets from ping-pong scheduling). 168 registers x 128
    # threads fit three programs per SM.
    QuantAttentionConfig(64, 4, 3),
    QuantAttentionConfig(64, 4, 2, maxnreg=168),
    QuantAttentionConfig(64, 4, 3, maxnreg=168),
    QuantAttentionConfig(64, 4, 4, maxnreg=168),
    # Overlap inside one program (see `pipeline`). On an H200 (head_dim 128, FP8 P·V) it paid where registers allow,
    # with 64-key tiles; with 128-key tiles the second FP32 tile spills. Splitting 64 rows over two warpgroups to
    # halve the registers cost more in row-max/sum exchanges than it saved: not listed
    # (measurements/sessions/2026-11-29_attention-pipeline/README.md).
    QuantAttentionConfig(64, 4, 3, pipeline=True),
    QuantAttentionConfig(128, 8, 3, pipeline=True),
)


def config_for(device: torch.device, head_dim: int, pv_fp8: bool) -> QuantAttentionConfig:
    """The core's launch configuration on `device` for this head_dim and P·V precision (the table's entry, else the
    default config); `attention_quantized` uses it when given none."""
    if device.type != "cuda":
        return _DEFAULT_CONFIG
    return _CONFIGS.get(torch.cuda.get_device_capability(device), {}).get((head_dim, pv_fp8), _DEFAULT_CONFIG)


# ---------------------------------------------------------------------------------------------------------------------
# Attention core
# ---------------------------------------------------------------------------------------------------------------------


def attention_quantized(qkv: QuantizedQKV, *, config: QuantAttentionConfig | None = None) -> torch.Tensor:
    """Triton attention core on a ``QuantizedQKV`` -> [B, H, M, D] in qkv.out_dtype. ``config`` None: the table's,
    with its key tile set to qkv.k_block; a config given must have block_n == qkv.k_block."""
    if config is None:
        config = dataclasses.replace(config_for(qkv.q8.device, qkv.q8.shape[3], qkv.pv_fp8), block_n=qkv.k_block)
    if config.block_n != qkv.k_block:
        raise ValueError(
            f"config.block_n: expected {qkv.k_block}, the k_block qkv was quantized with, found {config.block_n}"
        )
    if qkv.v_key_perm:
        raise ValueError("attention_quantized: expected vt in token order (v_key_perm=False), the Gluon core's is not")
    if qkv.pv_fp16_acc and not qkv.pv_fp8:
        raise ValueError("attention_quantized: pv_fp16_acc=True expects pv_fp8=True (an FP8 V in ±2.25), found FP16 V")
    _require_triton(qkv.q8.device)
    cfg = config
    if qkv.pv_fp8 and _interpreted():
        raise ValueError("pv_fp8=True: the Triton interpreter rounds FP8 wrongly; expected a pv_fp8=False QuantizedQKV")
    with on_device(qkv.q8.device):
        return launch_attention(qkv, cfg)


def launch_attention(qkv: QuantizedQKV, cfg: QuantAttentionConfig) -> torch.Tensor:
    """Launch the Triton core on `qkv` with `cfg`, without `attention_quantized`'s checks: for checks of the core where
    `attention_quantized` refuses to run it (FP8 P·V under the interpreter, whose FP8 rounding they match by replacing
    `p_to_fp8_ref`). Everything else calls `attention_quantized`."""
    b, h, m_pad, d = qkv.q8.shape
    n_pad = qkv.k8.shape[2]
    out = torch.empty((b, h, qkv.num_q, d), dtype=qkv.out_dtype, device=qkv.q8.device)
    _quant_attention_kernel[(m_pad // cfg.block_m, b * h)](
        qkv.q8, qkv.q_scale, qkv.k8, qkv.k_scale, qkv.vt,
        qkv.v_scale if qkv.pv_fp8 else qkv.k_scale, qkv.v_offset if qkv.pv_fp8 else qkv.k_scale, out,
        *out.stride(), h, qkv.num_q, qkv.num_kv, m_pad, n_pad,
        HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, Q_BLK=Q_BLOCK,
        PV_FP8=qkv.pv_fp8, FP8_NO_FOLD=_fp8_no_fold(qkv.q8.device), UNROLL=cfg.unroll, EXP2_POLY=cfg.exp2_poly,
        PIPELINE=cfg.pipeline, PV_FP16_ACC=qkv.pv_fp16_acc, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg}),
    )  # fmt: skip
    return out


def _fp8_no_fold(device: torch.device) -> bool:
    # See the FP8 branch of _attend_tile: everywhere but sm_90 an explicit max_num_imprecise_acc keeps acc + P·V apart.
    return not (device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0))


def p_to_fp8_ref(p_scaled: torch.Tensor) -> torch.Tensor:
    """P·FP8_MAX (fp32) -> e4m3 values as fp32, saturating like cvt.rn.satfinite. A seam the interpreter test
    replaces."""
    return p_scaled.clamp_max(FP8_MAX).to(torch.float8_e4m3fn).float()


def pv_fp16_chunks_ref(p_q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[BH, M, kb] x [BH, kb, D] e4m3 values -> the FP16-accumulate P·V of one tile as the kernel sums it: per
    32-key chunk (one m16n8k32 MMA) the exact sum of its products rounded once to FP16, the chunks added in FP32.
    Sums in float64, where 32 products of two e4m3 values are exact."""
    pv = torch.zeros((p_q.shape[0], p_q.shape[1], v.shape[2]), device=p_q.device)
    for c in range(0, p_q.shape[2], PV_CHUNK):
        chunk = torch.matmul(p_q[:, :, c : c + PV_CHUNK].double(), v[:, c : c + PV_CHUNK].double())
        pv += chunk.to(torch.float16).float()
    return pv


def attention_quantized_ref(qkv: QuantizedQKV) -> torch.Tensor:
    """PyTorch reference of ``attention_quantized``: the kernel's online softmax, qkv.k_block keys per update, in
    FP32; with qkv.pv_fp16_acc, P·V in FP16 per 32 keys (``pv_fp16_chunks_ref``).

    The INT8 products and FP8/FP16 operands are exact in FP32 (and in TF32), so the matmuls are exact per product
    whatever the float32 matmul precision.
    """
    b, h, m_pad, d = qkv.q8.shape
    n, n_pad = qkv.num_kv, qkv.k8.shape[2]
    q8 = qkv.q8.reshape(b * h, m_pad, d).float()
    k8 = qkv.k8.reshape(b * h, n_pad, d).float()
    v = (v_token_order(qkv.vt) if qkv.v_key_perm else qkv.vt).reshape(b * h, d, n_pad).float().transpose(1, 2)
    q_scale = qkv.q_scale.reshape(b * h, -1).repeat_interleave(Q_BLOCK, dim=1)  # per query row
    k_scale = qkv.k_scale.reshape(b * h, -1)

    m_i = torch.full((b * h, m_pad), float("-inf"), device=q8.device)
    l_i = torch.zeros((b * h, m_pad), device=q8.device)
    acc = torch.zeros((b * h, m_pad, d), device=q8.device)
    kb = qkv.k_block
    for j in range(n_pad // kb):
        cols = slice(j * kb, (j + 1) * kb)
        s = torch.matmul(q8, k8[:, cols].transpose(1, 2)) * (q_scale * k_scale[:, j : j + 1])[:, :, None]
        if (j + 1) * kb > n:
            s[:, :, n - j * kb :] = float("-inf")
        m_new = torch.maximum(m_i, s.amax(dim=2))
        alpha = torch.exp2(m_i - m_new)
        p = torch.exp2(s - m_new[:, :, None])
        l_i = l_i * alpha + p.sum(dim=2)
        p_q = p_to_fp8_ref(p * FP8_MAX) if qkv.pv_fp8 else p.to(torch.float16).float()
        pv = pv_fp16_chunks_ref(p_q, v[:, cols]) if qkv.pv_fp16_acc else torch.matmul(p_q, v[:, cols])
        acc = acc * alpha[:, :, None] + pv
        m_i = m_new
    out = acc / l_i[:, :, None]
    if qkv.pv_fp8:
        # Undoes V's and P's scales, then adds v_offset (V's mean, corrected for V_q's mean rounding error).
        out = out * (qkv.v_scale.reshape(b * h, 1, d) * (1.0 / FP8_MAX)) + qkv.v_offset.reshape(b * h, 1, d)
    return out[:, : qkv.num_q].reshape(b, h, qkv.num_q, d).to(qkv.out_dtype)


# ---------------------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------------------


@triton.jit
def _exp2_poly(x):
    # 2**x for x <= 0 on the FMA/ALU pipes. x = j + f with j = round(x), f in [-0.5, 0.5]: adding 1.5·2**23 rounds
    # x to an integer held in t's low mantissa bits; 2**j is then added straight into the exponent bits of 2**f.
    # Below -64 the result (2**-64) is zero to FP8 and FP16 P anyway; the clamp keeps the exponent arithmetic valid.
    x = tl.maximum(x, -64.0)
    t = x + MAGIC_F
    f = x - (t - MAGIC_F)
    p = ((_EXP2_C3 * f + _EXP2_C2) * f + _EXP2_C1) * f + _EXP2_C0
    bits = p.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _tile_scores(q, k_ptrs, start_n, HEAD_DIM: tl.constexpr):
    # S = q8·k8ᵀ of one key tile (int32, exact).
    k = tl.load(k_ptrs + start_n * HEAD_DIM)  # [BLOCK_N, D] int8; rows past N are zero padding
    return tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N] int32


@triton.jit
def _attend_tile(
    acc, l_i, m_i, q, q_scale, k_ptrs, vt_ptrs, ks_ptr, start_n, N,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PV_FP8: tl.constexpr, FP8_NO_FOLD: tl.constexpr,
    PV_FP16_ACC: tl.constexpr, MASK: tl.constexpr, POLY: tl.constexpr,
):  # fmt: skip
    # One BLOCK_N-key tile: S = q8·k8ᵀ (int32, exact), online-softmax update, acc += P·V.
    qk = _tile_scores(q, k_ptrs, start_n, HEAD_DIM)
    p, l_i, m_new, alpha = _tile_probs(l_i, m_i, qk, q_scale, ks_ptr, start_n, N, BLOCK_N, PV_FP8, MASK, POLY)
    acc = acc * alpha[:, None]
    if PV_FP8:
        acc = acc + _tile_pv(p, vt_ptrs, start_n, BLOCK_N, PV_FP8, FP8_NO_FOLD, PV_FP16_ACC)
    else:
        acc = tl.dot(p.to(tl.float16), tl.trans(tl.load(vt_ptrs + start_n)), acc)
    return acc, l_i, m_new


@triton.jit
def _tile_probs(
    l_i, m_i, qk, q_scale, ks_ptr, start_n, N,
    BLOCK_N: tl.constexpr, PV_FP8: tl.constexpr, MASK: tl.constexpr, POLY: tl.constexpr,
):  # fmt: skip
    # Online softmax of one tile's scores: P (scaled to e4m3's range with FP8 P·V), the new row sum and max, and
    # alpha, the factor the accumulator must be rescaled by.
    sc = q_scale * tl.load(ks_ptr + start_n // BLOCK_N)  # includes sm_scale·log2(e)
    f = (qk + MAGIC_I).to(tl.float32, bitcast=True)  # = 1.5·2**23 + qk exactly; monotonic in qk
    if MASK:
        valid = (start_n + tl.arange(0, BLOCK_N))[None, :] < N
        f = tl.where(valid, f, 0.0)  # below every valid f, so the row max ignores it; no inf, so no inf·0 NaN
    # sc > 0, so max(qk·sc) = (max f - 1.5·2**23)·sc and every score costs a single FMA: qk·sc - m = f·sc - bias.
    m_new = tl.maximum(m_i, (tl.max(f, 1) - MAGIC_F) * sc)
    alpha = tl.exp2(m_i - m_new)
    bias = m_new + MAGIC_F * sc
    if PV_FP8:
        bias -= LOG2_FP8_MAX  # P comes out already scaled to e4m3's range [0, FP8_MAX]; l carries the same factor
    x = f * sc - bias[:, None]
    p = _exp2_poly(x) if POLY else tl.exp2(x)
    if MASK:
        p = tl.where(valid, p, 0.0)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, l_i, m_new, alpha


@triton.jit
def _tile_pv(
    p, vt_ptrs, start_n, BLOCK_N: tl.constexpr, PV_FP8: tl.constexpr, FP8_NO_FOLD: tl.constexpr,
    PV_FP16_ACC: tl.constexpr,
):  # fmt: skip
    # One tile's P·V from zero, in FP32 (the caller adds it to the accumulator).
    vt = tl.load(vt_ptrs + start_n)  # [D, BLOCK_N], tokens contiguous: tl.trans makes a K-major B operand
    if PV_FP16_ACC:
        # GeForce (sm_89, sm_12x): the FP8 MMA with an FP16 accumulator (QMMA.16832.F16.E4M3.E4M3) runs at twice the
        # rate of the FP32-accumulator form there. Each 32-key chunk is one MMA deep (m16n8k32) from zero, so its
        # FP16 sum is bounded by 32 · FP8_MAX · V_FP16_ACC_MAX = 32,256 < 65,504 (the prologue quantized V to ±2.25 for
        # it); the chunks are added in FP32. SageAttention2++'s scheme. Splitting the tile into chunks costs no data
        # movement: the halves are register bits of both P's accumulator layout and Vᵀ's load layout (the SASS has
        # the same shared-memory traffic as the unsplit FP32 form); what it adds is an FP16 -> FP32 conversion and an
        # FP32 add per chunk and accumulator element.
        p8 = p.to(tl.float8e4nv)  # saturating (cvt.rn.satfinite): P·FP8_MAX <= FP8_MAX
        if BLOCK_N == 128:
            p_lo, p_hi = _key_halves(p8)
            v_lo, v_hi = _key_halves(vt)
            pv = _pv_fp16_chunks64(p_lo, v_lo) + _pv_fp16_chunks64(p_hi, v_hi)
        else:
            pv = _pv_fp16_chunks64(p8, vt)
    elif PV_FP8:
        # FP8 MMAs keep only ~14 significant bits when they add into their accumulator (DeepSeek-V3 report on
        # sm_90; SageAttention 2 saw the same on sm_89), a loss that grows with the number of keys summed there.
        # Each tile's P·V therefore starts from zero and is added to acc in FP32 (SageAttention 2's two-level
        # accumulation). On sm_90 that is a plain add: tl.dot(..., acc, max_num_imprecise_acc=BLOCK_N) would read
        # the wgmma accumulator mid-pipeline and ptxas then serializes every wgmma of the kernel (warning C7514,
        # seen compiling for sm_90a with Triton 3.8), and Triton's default for FP8 there (2**30) already stops its
        # combine pass from folding `acc + dot` back into the dot. Elsewhere the default is 0 and the fold happens,
        # so a nonzero value is passed; outside sm_90's wgmma lowering it has no other effect.
        # The conversion saturates (cvt.rn.satfinite), which caps P·FP8_MAX rounded a hair above FP8_MAX.
        if FP8_NO_FOLD:
            pv = tl.dot(p.to(tl.float8e4nv), tl.trans(vt), max_num_imprecise_acc=BLOCK_N)
        else:
            pv = tl.dot(p.to(tl.float8e4nv), tl.trans(vt))
    else:
        pv = tl.dot(p.to(tl.float16), tl.trans(vt))
    return pv


@triton.jit
def _key_halves(x):
    # [R, 2K] -> ([R, K], [R, K]): keys [0, K) and [K, 2K) (tl.split takes a trailing dimension of 2).
    R: tl.constexpr = x.shape[0]
    K: tl.constexpr = x.shape[1] // 2
    return tl.split(tl.permute(tl.reshape(x, [R, 2, K]), [0, 2, 1]))


@triton.jit
def _pv_fp16_chunks64(p8, vt):
    # P·V of 64 keys as two 32-key FP8 MMAs, each from zero with an FP16 accumulator, added in FP32. Converting
    # before the add keeps Triton from chaining the second MMA onto the first's FP16 accumulator.
    p0, p1 = _key_halves(p8)
    v0, v1 = _key_halves(vt)
    c0 = tl.dot(p0, tl.trans(v0), out_dtype=tl.float16)
    c1 = tl.dot(p1, tl.trans(v1), out_dtype=tl.float16)
    return c0.to(tl.float32) + c1.to(tl.float32)


@triton.jit
def _quant_attention_kernel(
    Q8, QS, K8, KS, VT, VS, VO, Out,  # see QuantizedQKV (VO: v_offset); out: [B, H, M, D] q.dtype; VS, VO: PV_FP8 only
    stride_ob, stride_oh, stride_om, stride_od,
    H, M, N, M_PAD, N_PAD,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, Q_BLK: tl.constexpr,
    PV_FP8: tl.constexpr, FP8_NO_FOLD: tl.constexpr, UNROLL: tl.constexpr, EXP2_POLY: tl.constexpr,
    PIPELINE: tl.constexpr, PV_FP16_ACC: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)  # fastest: neighbouring programs share one head's K/V in L2
    bh = tl.program_id(1)
    bh64 = bh.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)

    q = tl.load(Q8 + bh64 * M_PAD * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :])
    q_scale = tl.load(QS + bh64 * (M_PAD // Q_BLK) + (pid_m * BLOCK_M) // Q_BLK)
    k_ptrs = K8 + bh64 * N_PAD * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    vt_ptrs = VT + bh64 * HEAD_DIM * N_PAD + offs_d[:, None] * N_PAD + offs_n[None, :]
    ks_ptr = KS + bh64 * (N_PAD // BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    n_full = N // BLOCK_N
    if UNROLL == 2:
        for start_n in range(0, (n_full // 2) * 2 * BLOCK_N, 2 * BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_scale, k_ptrs, vt_ptrs, ks_ptr, start_n, N,
                HEAD_DIM, BLOCK_N, PV_FP8, FP8_NO_FOLD, PV_FP16_ACC, False, False,
            )  # fmt: skip
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_scale, k_ptrs, vt_ptrs, ks_ptr, start_n + BLOCK_N, N,
                HEAD_DIM, BLOCK_N, PV_FP8, FP8_NO_FOLD, PV_FP16_ACC, False, EXP2_POLY,
            )  # fmt: skip
        if n_full % 2 == 1:
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_scale, k_ptrs, vt_ptrs, ks_ptr, (n_full - 1) * BLOCK_N, N,
                HEAD_DIM, BLOCK_N, PV_FP8, FP8_NO_FOLD, PV_FP16_ACC, False, False,
            )  # fmt: skip
    elif PIPELINE:
        # Software-pipelined by hand so that each tile's softmax runs while the tensor cores do the previous tile's
        # P·V. Triton keeps a wgmma in flight only if its result is consumed after the loop's first full wait in the
        # next iteration and it accumulates in FP32; the INT8 Q·Kᵀ (int32) always waits at once, so iteration j:
        # softmax of tile j (P·V of tile j-1 in flight), Q·Kᵀ of tile j+1 and its wait (which also retires that
        # P·V), fold P·V of tile j-1 into acc, issue P·V of tile j.
        if n_full > 0:
            qk = _tile_scores(q, k_ptrs, 0, HEAD_DIM)
            pv = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
            alpha_pv = tl.full([BLOCK_M], 1.0, dtype=tl.float32)  # acc's rescale before pv is added
            for start_n in range(0, (n_full - 1) * BLOCK_N, BLOCK_N):
                p, l_i, m_i, alpha = _tile_probs(
                    l_i, m_i, qk, q_scale, ks_ptr, start_n, N, BLOCK_N, PV_FP8, False, False
                )  # fmt: skip
                qk = _tile_scores(q, k_ptrs, start_n + BLOCK_N, HEAD_DIM)
                acc = acc * alpha_pv[:, None] + pv
                pv = _tile_pv(p, vt_ptrs, start_n, BLOCK_N, PV_FP8, FP8_NO_FOLD, PV_FP16_ACC)
                alpha_pv = alpha
            start_n = (n_full - 1) * BLOCK_N
            p, l_i, m_i, alpha = _tile_probs(l_i, m_i, qk, q_scale, ks_ptr, start_n, N, BLOCK_N, PV_FP8, False, False)
            acc = acc * alpha_pv[:, None] + pv
            acc = acc * alpha[:, None] + _tile_pv(p, vt_ptrs, start_n, BLOCK_N, PV_FP8, FP8_NO_FOLD, PV_FP16_ACC)
    else:
        for start_n in range(0, n_full * BLOCK_N, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_scale, k_ptrs, vt_ptrs, ks_ptr, start_n, N,
                HEAD_DIM, BLOCK_N, PV_FP8, FP8_NO_FOLD, PV_FP16_ACC, False, False,
            )  # fmt: skip
    if N % BLOCK_N != 0:  # the ragged last tile is the only one that pays for the key mask
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_scale, k_ptrs, vt_ptrs, ks_ptr, n_full * BLOCK_N, N,
            HEAD_DIM, BLOCK_N, PV_FP8, FP8_NO_FOLD, PV_FP16_ACC, True, False,
        )  # fmt: skip

    out = acc / l_i[:, None]  # with FP8, P's factor FP8_MAX is in both acc and l
    if PV_FP8:  # undoes V's scale, then adds v_offset (V's smoothing, corrected for V_q's mean rounding error)
        out = out * tl.load(VS + bh64 * HEAD_DIM + offs_d)[None, :] + tl.load(VO + bh64 * HEAD_DIM + offs_d)[None, :]
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    o_ptrs = Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_m[:, None] < M)
