"""The quantization prologue of k6fast's quantized attention (quant_attention.py): Q, K and V to the INT8 /
FP8 (or FP16) operands of the attention cores, with their scales, in three Triton passes.

- ``quantize_qkv(q, k, v, *, pv_fp8, sm_scale, k_block, v_key_perm, pv_fp16_acc)``: Q to INT8 per 128 query rows;
  K smoothed (its per-(b, h, channel) mean removed) and to INT8 per k_block key rows; V transposed, and with FP8 P·V
  smoothed, scaled per channel to ±FP8_MAX (or to ±2.25 for the FP16-accumulate P·V, ``pv_fp16_acc_on``) and to e4m3
  (steps 1, 2 and 4 of the scheme in quant_attention.py). Returns a ``QuantizedQKV``.
- ``quantize_qkv_ref``: the same in PyTorch, bit for bit (IEEE division and ties-away rounding as the kernels do).
- The input checks and the device rules (which devices run the Triton kernels, where FP8 P·V may run) that the
  cores and the dispatch share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .attention_constants import (
    FP8_MAX,
    K_BLOCK,
    K_BLOCKS,
    LOG2E,
    Q_BLOCK,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    V_FP16_ACC_MAX,
    on_device,
)
from .fallback import cuda_at_least, device_label, is_geforce

# Keeps 127 / absmax and FP8_MAX / absmax finite for all-zero blocks (e.g. K after smoothing when N == 1).
_ABSMAX_FLOOR = 1e-30
# The two K/V passes' launch shapes, the fastest of a sweep at W1 on an H200
# (measurements/sessions/2026-11-29_attention-tree/README.md, "Prologue"): key rows summed per program in the K-mean /
# V-absmax pass and rows per step (its four [rows, D] fp32 accumulators are 16 registers a thread at 16 rows, so many
# programs share an SM); key rows quantized per program (k_block-row blocks one after another) and its warps. The
# quantized tensors are bit-identical for any of these shapes; the statistics differ only in their fp32 summation
# order.
STATS_CHUNK = 512
STATS_ROWS = 16
KV_QUANT_ROWS = 128
KV_QUANT_WARPS = 4


@dataclass(frozen=True)
class QuantizedQKV:
    """Output of the quantization prologue; padded token counts are multiples of the scale blocks, padding zero.

    q8: [B, H, M_pad, D] int8, M_pad = ceil(M / Q_BLOCK) · Q_BLOCK.
    q_scale: [B, H, M_pad / Q_BLOCK] fp32, absmax / 127 · sm_scale · log2(e).
    k8: [B, H, N_pad, D] int8 of the smoothed K, N_pad = ceil(N / k_block) · k_block.
    k_scale: [B, H, N_pad / k_block] fp32, absmax / 127.
    vt: [B, H, D, N_pad] V transposed (tokens contiguous, so V is K-major as the B operand of P·V, which sm_90's
      FP8 wgmma requires): float8_e4m3fn V_q = (V - mean(V)) / v_scale when pv_fp8, else fp16 (V as is). Keys in
      token order, or in ``v_key_order`` when v_key_perm (only the Gluon core reads that).
    v_scale: [B, H, D] fp32 absmax(V - mean(V)) / v_qmax when pv_fp8, else None; v_qmax is FP8_MAX (e4m3's largest),
      or V_FP16_ACC_MAX (2.25) when pv_fp16_acc.
    v_offset: [B, H, D] fp32 added to every output row when pv_fp8, else None: mean(V) - v_scale · mean(V_q).
      mean(V) undoes the smoothing; subtracting the mean of the dequantized V_q as well cancels the mean FP8
      rounding error of each channel. That error is the same for every query and does not average out over keys
      the way the attention output itself does: uncorrected it was the largest error term at 50k tokens on zero-mean
      random V (the reference on the CPU; not in a record).
    """

    q8: torch.Tensor
    q_scale: torch.Tensor
    k8: torch.Tensor
    k_scale: torch.Tensor
    vt: torch.Tensor
    v_scale: torch.Tensor | None
    v_offset: torch.Tensor | None
    num_q: int
    num_kv: int
    out_dtype: torch.dtype
    pv_fp8: bool
    k_block: int = K_BLOCK  # keys per K scale: the attention core must use it as its key tile (block_n)
    v_key_perm: bool = False  # vt's keys in the Gluon core's order within each 32-key block (see v_key_order)
    # V_q within ±V_FP16_ACC_MAX, so that the Triton core may sum P·V in FP16 per 32 keys (pv_fp8 only; GeForce)
    pv_fp16_acc: bool = False


# ---------------------------------------------------------------------------------------------------------------------
# Where the Triton kernels run, and the input checks
# ---------------------------------------------------------------------------------------------------------------------


def _interpreted() -> bool:
    # triton.jit returns an InterpretedFunction when TRITON_INTERPRET=1 was set before Triton was imported.
    return isinstance(_quantize_q_kernel, InterpretedFunction)


def has_fp8_tensor_cores(device: torch.device) -> bool:
    """Whether `device` has FP8 tensor cores (sm_89 or newer): where FP8 P·V may run."""
    return cuda_at_least(device, (8, 9))


def _triton_runs_on(device: torch.device) -> bool:
    # Triton's INT8 tl.dot needs sm_80+; CPU tensors run only under the interpreter.
    return _interpreted() or cuda_at_least(device, (8, 0))


def _require_triton(device: torch.device) -> None:
    if not _triton_runs_on(device):
        raise ValueError(
            f"expected CUDA tensors on sm_80 or newer (or TRITON_INTERPRET=1) for the Triton kernels, found {device}; "
            "quant_attention falls back to the reference by itself"
        )


def resolve_pv_fp8(pv_fp8: bool | None, device: torch.device) -> bool:
    """None picks FP8 where the Triton path has FP8 tensor cores; True is refused where it cannot run."""
    if _interpreted():
        if pv_fp8:
            raise ValueError("pv_fp8=True: the Triton interpreter rounds FP8 wrongly; expected pv_fp8 False or None")
        return False
    if pv_fp8 is None:
        return has_fp8_tensor_cores(device)
    if pv_fp8 and device.type == "cuda" and not has_fp8_tensor_cores(device):
        raise ValueError(f"pv_fp8=True needs FP8 tensor cores (sm_89 or newer); found {device_label(device)}")
    return bool(pv_fp8)


def pv_fp16_acc_on(capability: tuple[int, int]) -> bool:
    """Whether FP8 P·V sums in FP16 per 32 keys on a GeForce GPU of this compute capability: GeForce Ada (sm_89) and
    Blackwell (sm_12x), whose FP8 MMA runs at half rate with an FP32 accumulator and at full rate with an FP16 one.
    Not sm_90 (its Gluon core runs there, and FP32 accumulation is full rate) nor sm_100."""
    return tuple(capability) == (8, 9) or capability[0] == 12


def _pv_fp16_acc_default(device: torch.device) -> bool:
    # GeForce only: the lossier FP16 accumulation pays only where FP32-accumulate FP8 MMA runs at half rate, not on a
    # datacenter card of the same capability (L40S, sm_89).
    return is_geforce(device) and pv_fp16_acc_on(torch.cuda.get_device_capability(device))


def resolve_pv_fp16_acc(pv_fp16_acc: bool | None, pv_fp8: bool, device: torch.device) -> bool:
    """None picks the device's default (with FP8 P·V only); True needs FP8 P·V."""
    if pv_fp16_acc is None:
        return pv_fp8 and _pv_fp16_acc_default(device)
    if pv_fp16_acc and not pv_fp8:
        raise ValueError("pv_fp16_acc=True: expected pv_fp8=True (the FP16 accumulation is of the FP8 P·V)")
    return bool(pv_fp16_acc)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float | None) -> float:
    """Validates shapes/dtypes (see quant_attention.py); returns the softmax scale."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4-D BHND [batch, heads, tokens, head_dim], found {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name}: expected dtype bfloat16 or float16, found {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v: expected one dtype, found {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v: expected one device, found {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k, v: expected equal shapes, found {tuple(k.shape)} and {tuple(v.shape)}")
    b, h, m, d = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (b, h, d):
        raise ValueError(f"k: expected [{b}, {h}, N, {d}] to match q {tuple(q.shape)}, found {tuple(k.shape)}")
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim: expected one of {SUPPORTED_HEAD_DIMS}, found {d}")
    if m < 1 or k.shape[2] < 1 or b < 1 or h < 1:
        raise ValueError(f"expected >= 1 batch, head, query and key; found q {tuple(q.shape)}, k {tuple(k.shape)}")
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    if not (math.isfinite(scale) and scale > 0.0):
        raise ValueError(f"sm_scale: expected a finite positive number, found {sm_scale}")
    return scale


# ---------------------------------------------------------------------------------------------------------------------
# Quantization prologue
# ---------------------------------------------------------------------------------------------------------------------


def _padded(n: int, block: int) -> int:
    return triton.cdiv(n, block) * block


def _check_k_block(k_block: int) -> int:
    if k_block not in K_BLOCKS:
        raise ValueError(f"k_block: expected one of {K_BLOCKS}, found {k_block}")
    return k_block


def v_key_order(vt: torch.Tensor) -> torch.Tensor:
    """[..., N_pad] -> the same with the keys of each 32-key block reordered for the Gluon core's FP8 A operand
    (quant_attention_wgmma.py, `_to_a_operand`): position 16·i1 + 4q + 2·i0 + e holds key 16·i1 + 8·i0 + 2q + e
    (i1, i0, e < 2, q < 4). P·V sums over keys, so P and V permuted alike give the same product."""
    *lead, n_pad = vt.shape
    return vt.reshape(-1, n_pad // 32, 2, 2, 4, 2).permute(0, 1, 2, 4, 3, 5).reshape(*lead, n_pad)


def v_token_order(vt: torch.Tensor) -> torch.Tensor:
    """The inverse of ``v_key_order``."""
    *lead, n_pad = vt.shape
    return vt.reshape(-1, n_pad // 32, 2, 4, 2, 2).permute(0, 1, 2, 4, 3, 5).reshape(*lead, n_pad)


def quantize_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    pv_fp8: bool,
    sm_scale: float | None = None,
    k_block: int = K_BLOCK,
    v_key_perm: bool = False,
    pv_fp16_acc: bool | None = None,
) -> QuantizedQKV:
    """Triton prologue: three passes (Q; K and V statistics; K and V quantization). Shapes as ``quant_attention``;
    k_block: keys per K scale, the key tile of the attention core that will read it; v_key_perm: store Vᵀ in
    ``v_key_order`` (for the Gluon core), at no extra cost; pv_fp16_acc: V_q to ±V_FP16_ACC_MAX for the core's
    FP16-accumulate P·V (None: where ``_pv_fp16_acc_default`` says, with FP8 P·V)."""
    scale = _check_inputs(q, k, v, sm_scale)
    _require_triton(q.device)
    pv_fp8 = resolve_pv_fp8(bool(pv_fp8), q.device)  # refuses FP8 where it cannot run
    fp16_acc = resolve_pv_fp16_acc(pv_fp16_acc, pv_fp8, q.device)
    with on_device(q.device):
        return _quantize_qkv(q, k, v, pv_fp8, scale, _check_k_block(k_block), bool(v_key_perm), fp16_acc)


def _quantize_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pv_fp8: bool, scale: float, k_block: int, v_key_perm: bool,
    pv_fp16_acc: bool,
) -> QuantizedQKV:  # fmt: skip
    b, h, m, d = q.shape
    n = k.shape[2]
    m_pad, n_pad = _padded(m, Q_BLOCK), _padded(n, k_block)
    dev = q.device
    v_qmax = V_FP16_ACC_MAX if pv_fp16_acc else FP8_MAX

    q8 = torch.empty((b, h, m_pad, d), dtype=torch.int8, device=dev)
    q_scale = torch.empty((b, h, m_pad // Q_BLOCK), dtype=torch.float32, device=dev)
    _quantize_q_kernel[(m_pad // Q_BLOCK, b * h)](
        q, q8, q_scale, *q.stride(), h, m, m_pad, scale * LOG2E / 127.0,
        HEAD_DIM=d, BLOCK=Q_BLOCK, num_warps=8,
    )  # fmt: skip

    n_chunks = triton.cdiv(n, STATS_CHUNK)
    stats = torch.empty((b, h, n_chunks, 4, d), dtype=torch.float32, device=dev)  # per chunk: ΣK, ΣV, max V, min V
    _kv_stats_kernel[(n_chunks, b * h)](
        k, v, stats, *k.stride(), *v.stride(), h, n, n_chunks,
        HEAD_DIM=d, BLOCK=STATS_ROWS, CHUNK=STATS_CHUNK, PV_FP8=pv_fp8, num_warps=4,
    )  # fmt: skip
    # The second stage of the reductions is over n_chunks (99 at 50,220 tokens) values: negligible, left to torch.
    k_mean = (stats[:, :, :, 0].sum(dim=2) / n).contiguous()
    v_mean = v_absmax = None
    if pv_fp8:
        v_mean = (stats[:, :, :, 1].sum(dim=2) / n).contiguous()
        v_absmax = torch.maximum(stats[:, :, :, 2].amax(dim=2) - v_mean, v_mean - stats[:, :, :, 3].amin(dim=2))
        v_absmax = v_absmax.clamp_min(_ABSMAX_FLOOR).contiguous()

    k8 = torch.empty((b, h, n_pad, d), dtype=torch.int8, device=dev)
    k_scale = torch.empty((b, h, n_pad // k_block), dtype=torch.float32, device=dev)
    vt = torch.empty((b, h, d, n_pad), dtype=torch.float8_e4m3fn if pv_fp8 else torch.float16, device=dev)
    sub_blocks = KV_QUANT_ROWS // k_block
    n_programs = triton.cdiv(n_pad, k_block * sub_blocks)
    vq_sum = torch.empty((b, h, n_programs, d), dtype=torch.float32, device=dev) if pv_fp8 else k_mean
    _kv_quantize_kernel[(n_programs, b * h)](
        k, v, k_mean, k_mean if v_mean is None else v_mean, k_mean if v_absmax is None else v_absmax,
        k8, k_scale, vt, vq_sum, n_programs,
        *k.stride(), *v.stride(), h, n, n_pad,
        HEAD_DIM=d, BLOCK=k_block, SUB=sub_blocks, PV_FP8=pv_fp8, V_PERM=v_key_perm,
        V_QMAX=v_qmax, num_warps=KV_QUANT_WARPS,
    )  # fmt: skip
    v_scale = v_offset = None
    if pv_fp8:
        v_scale = v_absmax / v_qmax
        v_offset = (v_mean - v_scale * (vq_sum.sum(dim=2) / n)).contiguous()
    return QuantizedQKV(
        q8, q_scale, k8, k_scale, vt, v_scale, v_offset, m, n, q.dtype, pv_fp8, k_block, v_key_perm, pv_fp16_acc
    )


def _div_rn_ref(num: torch.Tensor | float, den: torch.Tensor | float) -> torch.Tensor:
    """IEEE fp32 division, as ``tl.math.div_rn``: torch turns division of or by a Python scalar into a multiply by a
    rounded reciprocal, which moves INT8 rounding decisions."""
    num_t = num if isinstance(num, torch.Tensor) else torch.full_like(den, num)
    den_t = den if isinstance(den, torch.Tensor) else torch.full_like(num, den)
    return torch.div(num_t, den_t)


def _round_half_away_ref(x: torch.Tensor) -> torch.Tensor:
    """Mirror of ``_round_to_int8``: fp32 in [-127.5, 127.5] -> int8, ties away from zero."""
    r = x + torch.where(x >= 0, 0.5, -0.5)
    return torch.trunc(r.clamp(-127.0, 127.0)).to(torch.int8)


def quantize_qkv_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    pv_fp8: bool,
    sm_scale: float | None = None,
    k_block: int = K_BLOCK,
    v_key_perm: bool = False,
    pv_fp16_acc: bool | None = None,
) -> QuantizedQKV:
    """PyTorch reference of ``quantize_qkv``: same outputs, same layouts and padding."""
    scale = _check_inputs(q, k, v, sm_scale)
    _check_k_block(k_block)
    pv_fp16_acc = resolve_pv_fp16_acc(pv_fp16_acc, pv_fp8, q.device)
    v_qmax = V_FP16_ACC_MAX if pv_fp16_acc else FP8_MAX
    b, h, m, d = q.shape
    n = k.shape[2]
    m_pad, n_pad = _padded(m, Q_BLOCK), _padded(n, k_block)

    qf = torch.nn.functional.pad(q.float(), (0, 0, 0, m_pad - m)).view(b, h, m_pad // Q_BLOCK, Q_BLOCK, d)
    q_absmax = qf.abs().amax(dim=(-2, -1)).clamp_min(_ABSMAX_FLOOR)
    q8 = _round_half_away_ref(qf * _div_rn_ref(127.0, q_absmax)[..., None, None]).view(b, h, m_pad, d)
    q_scale = q_absmax * torch.tensor(scale * LOG2E / 127.0, dtype=torch.float32)

    kf = k.float()
    ks = torch.nn.functional.pad(kf - kf.sum(dim=2, keepdim=True) / n, (0, 0, 0, n_pad - n))
    ks = ks.view(b, h, n_pad // k_block, k_block, d)
    k_absmax = ks.abs().amax(dim=(-2, -1)).clamp_min(_ABSMAX_FLOOR)
    k8 = _round_half_away_ref(ks * _div_rn_ref(127.0, k_absmax)[..., None, None]).view(b, h, n_pad, d)
    k_scale = _div_rn_ref(k_absmax, 127.0)

    vf = v.float()
    if pv_fp8:
        v_mean = vf.sum(dim=2) / n
        v_absmax = torch.maximum(vf.amax(dim=2) - v_mean, v_mean - vf.amin(dim=2)).clamp_min(_ABSMAX_FLOOR)
        v_q = ((vf - v_mean[:, :, None, :]) * _div_rn_ref(v_qmax, v_absmax)[:, :, None, :]).clamp(-v_qmax, v_qmax)
        v_q = torch.nn.functional.pad(v_q, (0, 0, 0, n_pad - n)).to(torch.float8_e4m3fn)
        v_scale = v_absmax / v_qmax
        v_offset = v_mean - v_scale * (v_q.float().sum(dim=2) / n)
    else:
        v_q = torch.nn.functional.pad(vf, (0, 0, 0, n_pad - n)).to(torch.float16)
        v_scale = v_offset = None
    vt = v_q.transpose(-1, -2).contiguous()
    if v_key_perm:
        vt = v_key_order(vt)
    return QuantizedQKV(
        q8, q_scale, k8, k_scale, vt, v_scale, v_offset, m, n, q.dtype, pv_fp8, k_block, v_key_perm, pv_fp16_acc
    )


# ---------------------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------------------


@triton.jit
def _round_to_int8(x):
    # Ties away from zero; the conversion truncates toward zero, hence the ±0.5. Callers keep |x| <= 127 (+ulps).
    r = x + tl.where(x >= 0, 0.5, -0.5)
    return tl.minimum(tl.maximum(r, -127.0), 127.0).to(tl.int8)


@triton.jit
def _quantize_q_kernel(
    Q, Q8, QS,  # q: [B, H, M, D] any strides; q8: [B, H, M_PAD, D] int8; qs: [B, H, M_PAD / BLOCK] fp32
    stride_b, stride_h, stride_n, stride_d,
    H, M, M_PAD, scale_mult,  # scale_mult = sm_scale · log2(e) / 127
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = pid * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    src = Q + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
    x = tl.load(src + rows[:, None] * stride_n + offs_d[None, :] * stride_d, mask=rows[:, None] < M, other=0.0)
    x = x.to(tl.float32)
    absmax = tl.maximum(tl.max(tl.abs(x)), 1e-30)
    q8 = _round_to_int8(x * tl.math.div_rn(127.0, absmax))  # IEEE division: `/` is div.full.f32 on NVIDIA
    tl.store(Q8 + bh.to(tl.int64) * M_PAD * HEAD_DIM + rows[:, None] * HEAD_DIM + offs_d[None, :], q8)
    tl.store(QS + bh * (M_PAD // BLOCK) + pid, absmax * scale_mult)


@triton.jit
def _kv_stats_kernel(
    K, V, STATS,  # k, v: [B, H, N, D] any strides; stats: [B, H, N_CHUNKS, 4, D] fp32: ΣK, ΣV, max V, min V per chunk
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    H, N, N_CHUNKS,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr, PV_FP8: tl.constexpr,
):  # fmt: skip
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    k_sum = tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32)
    v_sum = tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32)
    v_max = tl.full([BLOCK, HEAD_DIM], float("-inf"), dtype=tl.float32)
    v_min = tl.full([BLOCK, HEAD_DIM], float("inf"), dtype=tl.float32)
    for r in range(0, CHUNK, BLOCK):
        rows = chunk * CHUNK + r + tl.arange(0, BLOCK)
        valid = rows[:, None] < N  # padding loads 0: adds nothing to the sums (the means divide by N)
        k = tl.load(k_base + rows[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=valid, other=0.0)
        k_sum += k.to(tl.float32)
        if PV_FP8:
            v = tl.load(v_base + rows[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=valid, other=0.0)
            v = v.to(tl.float32)
            v_sum += v
            v_max = tl.maximum(v_max, tl.where(valid, v, float("-inf")))
            v_min = tl.minimum(v_min, tl.where(valid, v, float("inf")))
    out = STATS + (bh.to(tl.int64) * N_CHUNKS + chunk) * 4 * HEAD_DIM + offs_d
    tl.store(out, tl.sum(k_sum, 0))
    if PV_FP8:  # every chunk holds at least one valid row, so max and min are finite
        tl.store(out + HEAD_DIM, tl.sum(v_sum, 0))
        tl.store(out + 2 * HEAD_DIM, tl.max(v_max, 0))
        tl.store(out + 3 * HEAD_DIM, tl.min(v_min, 0))


@triton.jit
def _kv_quantize_kernel(
    K, V, KMEAN, VMEAN, VMAX,  # k, v: [B, H, N, D] any strides; means, absmax(V - mean): [B, H, D] fp32
    K8, KS, VT,  # k8: [B, H, N_PAD, D] int8; ks: [B, H, N_PAD / BLOCK] fp32; vt: [B, H, D, N_PAD] fp8 or fp16
    VQSUM, N_PROGRAMS,  # vqsum: [B, H, N_PROGRAMS, D] fp32, this program's column sums of V_q (PV_FP8 only)
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    H, N, N_PAD,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr, PV_FP8: tl.constexpr, V_PERM: tl.constexpr,
    V_QMAX: tl.constexpr,  # |V_q| bound: FP8_MAX, or V_FP16_ACC_MAX for the FP16-accumulate P·V
):  # fmt: skip
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    bh64 = bh.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    k_mean = tl.load(KMEAN + bh64 * HEAD_DIM + offs_d)
    if PV_FP8:  # VMEAN and VMAX are read only here
        v_mean = tl.load(VMEAN + bh64 * HEAD_DIM + offs_d)
        v_inv = tl.math.div_rn(V_QMAX, tl.load(VMAX + bh64 * HEAD_DIM + offs_d))
    vq_sum = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for i in tl.static_range(SUB):
        blk = pid * SUB + i
        rows = blk * BLOCK + tl.arange(0, BLOCK)
        valid = rows[:, None] < N
        in_pad = rows[:, None] < N_PAD  # rows in [N, N_PAD) are written as zeros
        k = tl.load(k_base + rows[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=valid, other=0.0)
        x = tl.where(valid, k.to(tl.float32) - k_mean[None, :], 0.0)  # padding must not raise the absmax
        absmax = tl.maximum(tl.max(tl.abs(x)), 1e-30)
        k8 = _round_to_int8(x * tl.math.div_rn(127.0, absmax))
        tl.store(K8 + bh64 * N_PAD * HEAD_DIM + rows[:, None] * HEAD_DIM + offs_d[None, :], k8, mask=in_pad)
        tl.store(KS + bh64 * (N_PAD // BLOCK) + blk, tl.math.div_rn(absmax, 127.0), mask=blk * BLOCK < N_PAD)
        v_rows, v_valid = rows, valid
        if V_PERM:  # v_key_order: output key 16·i1 + 4q + 2·i0 + e of each 32-key block is key 16·i1 + 8·i0 + 2q + e
            # (gathering rows keeps the transposed store contiguous; scattering it was slower at W1 on an H200)
            v_rows = (rows & -32) | (rows & 17) | ((rows >> 1) & 6) | ((rows << 2) & 8)
            v_valid = v_rows[:, None] < N
        v = tl.load(v_base + v_rows[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=v_valid, other=0.0)
        if PV_FP8:
            vs = tl.where(v_valid, (v.to(tl.float32) - v_mean[None, :]) * v_inv[None, :], 0.0)
            vq = tl.minimum(tl.maximum(vs, -V_QMAX), V_QMAX).to(tl.float8e4nv)
            vq_sum += tl.sum(vq.to(tl.float32), 0)  # padding rows are 0
        else:
            vq = v.to(tl.float16)
        tl.store(VT + bh64 * HEAD_DIM * N_PAD + offs_d[None, :] * N_PAD + rows[:, None], vq, mask=in_pad)
    if PV_FP8:
        tl.store(VQSUM + (bh64 * N_PROGRAMS + pid) * HEAD_DIM + offs_d, vq_sum)
