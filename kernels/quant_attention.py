"""SageAttention-2-style quantized attention: INT8 Q·Kᵀ, FP8 (or FP16) P·V, online softmax in FP32.

Public API (layout BHND = [batch, heads, tokens, head_dim]; no mask; q and k/v token counts may differ):

- ``quant_attention(q, k, v, *, pv_fp8=None, sm_scale=None)``: approximates ``softmax(q kᵀ·sm_scale) v``.
  q: [B, H, M, D], k/v: [B, H, N, D], bf16 or fp16, D in {64, 128}, M, N >= 1. Returns [B, H, M, D] in q's dtype.
  Lossy: see "Accuracy" below (FP16 P·V about 1.3% relative L2, FP8 P·V up to about 4%).
- ``quant_attention_ref(...)``: the same quantization scheme step by step in PyTorch (FP32 maths); the kernel is
  checked against it tightly.
- ``attention_fp32(q, k, v, *, sm_scale=None)``: exact attention in FP32, chunked over query rows.
- ``quantize_qkv`` / ``quantize_qkv_ref`` and ``attention_quantized`` / ``attention_quantized_ref``: the two halves
  (quantization prologue, attention core) exposed so tests and benchmarks can check and time them apart.

The scheme (SageAttention 2, Zhang et al. 2024):
1. K smoothing: subtract the per-(b, h, channel) mean of K over tokens. Softmax is invariant to adding the same
   value to every score of a row, and q·mean(K) is such a value; removing it takes the large per-channel offsets
   of DiT keys out of the INT8 range, which is where most of K's quantization error would come from.
2. Q to INT8 per block of 128 query rows, K to INT8 per block of k_block (64 or 128, per GPU) key rows, scale =
   absmax / 127, rounding half away from zero. sm_scale·log2(e) is folded into Q's scale so the softmax runs on exp2.
3. S = int8 Q·Kᵀ accumulated in INT32 (exact), dequantized by q_scale·k_scale; online softmax in FP32 with the
   running row maximum updated every k_block keys (the kernel and the reference share this granularity because
   the FP8 rounding of P depends on the running maximum).
4. P·V: FP8 e4m3 on GPUs with FP8 tensor cores (sm_89 and newer): V smoothed (its per-(b, h, channel) mean
   removed and added back to O, exact because each row of P sums to 1 after normalisation, together with a
   correction for the mean rounding error of the quantized V, see ``QuantizedQKV.v_offset``), scaled per
   (b, h, channel) by absmax / 448; P (in [0, 1]) scaled by 448 (folded into exp2's argument); each key tile's
   FP8 product summed into the FP32 accumulator. Elsewhere P and V in FP16 (V unsmoothed: FP16 keeps 11 significant
   bits whatever the offset).

Accuracy (relative L2 vs exact FP32 attention, measured with the reference on diffuse attention over zero-mean random
V, the hardest case for a relative metric): INT8 Q·Kᵀ costs about 1.3% (cosine 0.9999); FP8 P and FP8 V each cost
about 2.6% (e4m3's 3-bit mantissa; no scale choice helps, the error is relative), about 3.6% in all (cosine 0.9993),
from 218 to 50,220 keys, with 64-key K scales; 128-key K scales (the sm_90 FP8 choice) measured the same on the
GPU (3.58-3.63 % vs 3.58-3.62 % at W1, measurements/sessions/2026-11-29_attention-sweep).
When V carries per-channel offsets, as DiT values do, the FP8 path's error falls below 1% of the output.

Implementations by architecture (see ``_select_implementation``):

| device                        | implementation              | P·V default                                 |
|-------------------------------|-----------------------------|---------------------------------------------|
| CUDA sm_90, head_dim 64, 128  | Triton prologue + the Gluon core (quant_attention_wgmma.py) | FP8 |
| CUDA sm_89 and newer          | Triton kernels              | FP8                                         |
| CUDA sm_80 .. sm_87           | Triton kernels              | FP16                                        |
| CUDA older than sm_80         | reference (logged once)     | FP16                                        |
| any, Triton interpreter on    | Triton kernels, interpreted | FP16 (FP8 refused: wrong in the interpreter) |
| CPU, interpreter off          | reference (logged once)     | FP16                                        |
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

__all__ = [
    "CANDIDATE_CONFIGS",
    "QuantAttentionConfig",
    "QuantizedQKV",
    "attention_fp32",
    "attention_quantized",
    "attention_quantized_ref",
    "quant_attention",
    "quant_attention_op",
    "quant_attention_ref",
    "quantize_qkv",
    "quantize_qkv_ref",
    "v_key_order",
    "v_token_order",
]

logger = logging.getLogger(__name__)

Q_BLOCK = 128  # query rows per Q scale
K_BLOCK = 64  # default key rows per K scale (QuantAttentionConfig.block_n, QuantizedQKV.k_block). The K scale block
# is also the kernel's key tile and its online-softmax update granularity, so quantization and kernel must agree.
K_BLOCKS = (64, 128)
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)

LOG2E = 1.4426950408889634
FP8_MAX = 448.0  # largest finite float8 e4m3fn
# Keeps 127 / absmax and 448 / absmax finite for all-zero blocks (e.g. K after smoothing when N == 1).
_ABSMAX_FLOOR = 1e-30
# The two K/V passes' launch shapes, from a sweep at W1 on an H200 (measurements/sessions/2026-11-29_attention-tree):
# key rows summed per program in the K-mean / V-absmax pass and rows per step (its four [rows, D] fp32 accumulators
# are 16 registers a thread at 16 rows, so many programs share an SM: 0.27 ms, against 0.51 ms at 64 rows and 0.30 ms
# at 32); key rows quantized per program (k_block-row blocks one after another) and its warps (0.48 ms, against
# 0.79 ms for 256 rows on 8 warps). The quantized tensors are bit-identical for any of these shapes; the statistics
# differ only in their fp32 summation order.
_STATS_CHUNK = 512
_STATS_ROWS = 16
_KV_QUANT_ROWS = 128
_KV_QUANT_WARPS = 4

# An int32 x with |x| < 2**22 plus the bits of 1.5 * 2**23 is the fp32 1.5 * 2**23 + x exactly. This replaces the
# int32 -> fp32 conversion (I2F runs at 16/clk/SM on sm_90, as slow as exp2) by an integer add. |Q·Kᵀ| <= 127² · 128
# = 2,064,512 < 2**22.
_MAGIC_I = tl.constexpr(0x4B400000)
_MAGIC_F = tl.constexpr(12582912.0)
_FP8_MAX = tl.constexpr(448.0)
_LOG2_FP8_MAX = tl.constexpr(8.807354922057604)  # log2(448)
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
    # An H200 at W1 (measurements/sessions/2026-11-29_attention-sweep). head_dim 128: FP8 P·V 55.2 ms with one
    # warpgroup and 128-key tiles vs 68.2 ms for the default; FP16 P·V is best with the default (72.8 ms; 92.3 ms
    # with the FP8 choice). head_dim 64 (64 heads): FP8 P·V 74.3 ms vs 89.8 ms for the default.
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
    # Overlap inside one program (see `pipeline`). On an H200 (head_dim 128, FP8 P·V) it pays where registers allow:
    # 64-key tiles 58.4 ms (128, 8, 3) and 61.8 ms (64, 4, 3) vs 68.2 / 63.5 ms without; with 128-key tiles the
    # second FP32 tile spills (123-199 ms). Splitting 64 rows over two warpgroups to halve the registers costs more
    # in row-max/sum exchanges than it saves (95-188 ms): not listed.
    QuantAttentionConfig(64, 4, 3, pipeline=True),
    QuantAttentionConfig(128, 8, 3, pipeline=True),
)


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
    v_scale: [B, H, D] fp32 absmax(V - mean(V)) / 448 when pv_fp8, else None.
    v_offset: [B, H, D] fp32 added to every output row when pv_fp8, else None: mean(V) - v_scale · mean(V_q).
      mean(V) undoes the smoothing; subtracting the mean of the dequantized V_q as well cancels the mean FP8
      rounding error of each channel. That error is the same for every query and does not average out over keys
      the way the attention output itself does: uncorrected it was the largest error term at 50k tokens (5.3% vs
      3.6% relative L2 on zero-mean random V).
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


# ---------------------------------------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------------------------------------


def _interpreted() -> bool:
    # triton.jit returns an InterpretedFunction when TRITON_INTERPRET=1 was set before Triton was imported.
    return isinstance(_quant_attention_kernel, InterpretedFunction)


def _has_fp8_tensor_cores(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _triton_runs_on(device: torch.device) -> bool:
    # Triton's INT8 tl.dot needs sm_80+; CPU tensors run only under the interpreter.
    return _interpreted() or (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0))


def _select_implementation(device: torch.device) -> str:
    """'triton' or 'reference' for tensors on ``device`` (see the table in the module docstring)."""
    if _triton_runs_on(device):
        return "triton"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        _log_once(f"quant_attention: sm_{major}{minor} has no INT8 tensor-core path in Triton; running the reference")
    else:
        _log_once(
            f"quant_attention: no Triton backend for {device.type!r} tensors (interpreter off); running the reference"
        )
    return "reference"


def _require_triton(device: torch.device) -> None:
    if not _triton_runs_on(device):
        raise ValueError(
            f"expected CUDA tensors on sm_80 or newer (or TRITON_INTERPRET=1) for the Triton kernels, found {device}; "
            "quant_attention falls back to the reference by itself"
        )


@functools.cache
def _log_once(message: str) -> None:
    logger.warning(message)


def _resolve_pv_fp8(pv_fp8: bool | None, device: torch.device) -> bool:
    """None picks FP8 where the Triton path has FP8 tensor cores; True is refused where it cannot run."""
    if _interpreted():
        if pv_fp8:
            raise ValueError("pv_fp8=True: the Triton interpreter rounds FP8 wrongly; expected pv_fp8 False or None")
        return False
    if pv_fp8 is None:
        return _has_fp8_tensor_cores(device)
    if pv_fp8 and device.type == "cuda" and not _has_fp8_tensor_cores(device):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"pv_fp8=True needs FP8 tensor cores (sm_89 or newer); found sm_{major}{minor}")
    return bool(pv_fp8)


def _on_device(device: torch.device) -> contextlib.AbstractContextManager:
    # Triton launches on the current CUDA device, which need not be the tensors'.
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _config_for(device: torch.device, head_dim: int, pv_fp8: bool) -> QuantAttentionConfig:
    if device.type != "cuda":
        return _DEFAULT_CONFIG
    return _CONFIGS.get(torch.cuda.get_device_capability(device), {}).get((head_dim, pv_fp8), _DEFAULT_CONFIG)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float | None) -> float:
    """Validates shapes/dtypes (see module docstring); returns the softmax scale."""
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
# Public entry points
# ---------------------------------------------------------------------------------------------------------------------


def quant_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, pv_fp8: bool | None = None, sm_scale: float | None = None
) -> torch.Tensor:
    """Quantized softmax(q kᵀ·sm_scale) v. q: [B, H, M, D], k, v: [B, H, N, D] bf16/fp16 -> [B, H, M, D] q.dtype."""
    _check_inputs(q, k, v, sm_scale)
    if _select_implementation(q.device) == "reference":
        return quant_attention_ref(q, k, v, pv_fp8=pv_fp8, sm_scale=sm_scale)
    pv_fp8 = _resolve_pv_fp8(pv_fp8, q.device)
    if pv_fp8 and _gluon_core_runs(q.device, q.shape[3]):
        from .quant_attention_wgmma import attention_quantized_wgmma  # imports this module: imported late

        qkv = quantize_qkv(q, k, v, pv_fp8=True, sm_scale=sm_scale, k_block=GLUON_K_BLOCK, v_key_perm=True)
        return attention_quantized_wgmma(qkv)
    cfg = _config_for(q.device, q.shape[3], pv_fp8)
    qkv = quantize_qkv(q, k, v, pv_fp8=pv_fp8, sm_scale=sm_scale, k_block=cfg.block_n)
    return attention_quantized(qkv, config=cfg)


# Where the Gluon core (kernels/quant_attention_wgmma.py, FP8 P·V) replaces the Triton one: GPU capability -> head
# dims. On an H200 at W1, with its tree row reductions, it is 1.20x faster than the Triton core at head_dim 128
# (46.96 vs 56.25 ms) and 1.10x at 64 (70.12 vs 77.21 ms, 64 heads; before the trees it was 1.09-1.18x slower
# there): measurements/sessions/2026-11-29_attention-tree.
_GLUON_CORE_HEAD_DIMS = {(9, 0): (64, 128)}
GLUON_K_BLOCK = 128


def _k_block_for(device: torch.device, head_dim: int, pv_fp8: bool) -> int:
    """The key tile (= keys per K scale) `quant_attention` quantizes with on `device`."""
    if pv_fp8 and _gluon_core_runs(device, head_dim):
        return GLUON_K_BLOCK
    return _config_for(device, head_dim, pv_fp8).block_n


def _gluon_core_runs(device: torch.device, head_dim: int) -> bool:
    if device.type != "cuda" or _interpreted():
        return False
    if head_dim not in _GLUON_CORE_HEAD_DIMS.get(torch.cuda.get_device_capability(device), ()):
        return False
    from .gluon_hopper import GLUON_AVAILABLE

    return GLUON_AVAILABLE


# For compiled callers (the DiT's compiled block): one opaque op. Traced inline, the Python decisions above (reference
# or kernel, FP8 P·V or not, input checks) break the graph, and a partial graph ending at such a break carries only
# the guards read before it: a later call on the exact path matched it and recompiled the attention frames
# (measured: 5-7 s in the second request's exact first step, measurements/sessions/2026-11-29_step-profile).
@torch.library.custom_op("k6fast::quant_attention", mutates_args=())
def quant_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`quant_attention(q, k, v)` with the defaults (FP8 P·V where the GPU has it, sm_scale 1/sqrt(D)); the output
    is contiguous [B, H, M, D], the layout the fake below promises the compiler."""
    return quant_attention(q, k, v).contiguous()


@quant_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return q.new_empty(q.shape)


def quant_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    pv_fp8: bool | None = None,
    sm_scale: float | None = None,
    k_block: int | None = None,
) -> torch.Tensor:
    """PyTorch reference of ``quant_attention``: the same scheme step by step in FP32. Same shapes and dtypes.
    k_block None: the one the kernel uses on q's device."""
    _check_inputs(q, k, v, sm_scale)
    fp8 = _has_fp8_tensor_cores(q.device) if pv_fp8 is None else bool(pv_fp8)
    k_block = _k_block_for(q.device, q.shape[3], fp8) if k_block is None else k_block
    return attention_quantized_ref(quantize_qkv_ref(q, k, v, pv_fp8=fp8, sm_scale=sm_scale, k_block=k_block))


def attention_fp32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: float | None = None) -> torch.Tensor:
    """Exact softmax(q kᵀ·sm_scale) v in FP32. q: [B, H, M, D], k, v: [B, H, N, D] any float dtype -> fp32 [B, H, M, D].

    Chunked over query rows so the score block stays near 2**28 elements (1 GiB).
    """
    if torch.get_float32_matmul_precision() != "highest":
        raise RuntimeError(
            "attention_fp32: expected torch.get_float32_matmul_precision() == 'highest' (TF32 off), "
            f"found {torch.get_float32_matmul_precision()!r}"
        )
    b, h, m, d = q.shape
    n = k.shape[2]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    kt = k.float().transpose(-1, -2)
    vf = v.float()
    out = torch.empty((b, h, m, d), dtype=torch.float32, device=q.device)
    chunk = max(1, (1 << 28) // (b * h * n))
    for i in range(0, m, chunk):
        s = torch.matmul(q[:, :, i : i + chunk].float(), kt).mul_(scale)
        out[:, :, i : i + chunk] = torch.matmul(torch.softmax(s, dim=-1), vf)
    return out


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
    (kernels/quant_attention_wgmma.py, `_to_a_operand`): position 16·i1 + 4q + 2·i0 + e holds key 16·i1 + 8·i0 + 2q + e
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
) -> QuantizedQKV:
    """Triton prologue: three passes (Q; K and V statistics; K and V quantization). Shapes as ``quant_attention``;
    k_block: keys per K scale, the key tile of the attention core that will read it; v_key_perm: store Vᵀ in
    ``v_key_order`` (for the Gluon core), at no extra cost."""
    scale = _check_inputs(q, k, v, sm_scale)
    _require_triton(q.device)
    pv_fp8 = _resolve_pv_fp8(bool(pv_fp8), q.device)  # refuses FP8 where it cannot run
    with _on_device(q.device):
        return _quantize_qkv(q, k, v, pv_fp8, scale, _check_k_block(k_block), bool(v_key_perm))


def _quantize_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pv_fp8: bool, scale: float, k_block: int, v_key_perm: bool
) -> QuantizedQKV:
    b, h, m, d = q.shape
    n = k.shape[2]
    m_pad, n_pad = _padded(m, Q_BLOCK), _padded(n, k_block)
    dev = q.device

    q8 = torch.empty((b, h, m_pad, d), dtype=torch.int8, device=dev)
    q_scale = torch.empty((b, h, m_pad // Q_BLOCK), dtype=torch.float32, device=dev)
    _quantize_q_kernel[(m_pad // Q_BLOCK, b * h)](
        q, q8, q_scale, *q.stride(), h, m, m_pad, scale * LOG2E / 127.0,
        HEAD_DIM=d, BLOCK=Q_BLOCK, num_warps=8,
    )  # fmt: skip

    n_chunks = triton.cdiv(n, _STATS_CHUNK)
    stats = torch.empty((b, h, n_chunks, 4, d), dtype=torch.float32, device=dev)  # per chunk: ΣK, ΣV, max V, min V
    _kv_stats_kernel[(n_chunks, b * h)](
        k, v, stats, *k.stride(), *v.stride(), h, n, n_chunks,
        HEAD_DIM=d, BLOCK=_STATS_ROWS, CHUNK=_STATS_CHUNK, PV_FP8=pv_fp8, num_warps=4,
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
    sub_blocks = _KV_QUANT_ROWS // k_block
    n_programs = triton.cdiv(n_pad, k_block * sub_blocks)
    vq_sum = torch.empty((b, h, n_programs, d), dtype=torch.float32, device=dev) if pv_fp8 else k_mean
    _kv_quantize_kernel[(n_programs, b * h)](
        k, v, k_mean, k_mean if v_mean is None else v_mean, k_mean if v_absmax is None else v_absmax,
        k8, k_scale, vt, vq_sum, n_programs,
        *k.stride(), *v.stride(), h, n, n_pad,
        HEAD_DIM=d, BLOCK=k_block, SUB=sub_blocks, PV_FP8=pv_fp8, V_PERM=v_key_perm, num_warps=_KV_QUANT_WARPS,
    )  # fmt: skip
    v_scale = v_offset = None
    if pv_fp8:
        v_scale = v_absmax / FP8_MAX
        v_offset = (v_mean - v_scale * (vq_sum.sum(dim=2) / n)).contiguous()
    return QuantizedQKV(q8, q_scale, k8, k_scale, vt, v_scale, v_offset, m, n, q.dtype, pv_fp8, k_block, v_key_perm)


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
) -> QuantizedQKV:
    """PyTorch reference of ``quantize_qkv``: same outputs, same layouts and padding."""
    scale = _check_inputs(q, k, v, sm_scale)
    _check_k_block(k_block)
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
        v_q = ((vf - v_mean[:, :, None, :]) * _div_rn_ref(FP8_MAX, v_absmax)[:, :, None, :]).clamp(-FP8_MAX, FP8_MAX)
        v_q = torch.nn.functional.pad(v_q, (0, 0, 0, n_pad - n)).to(torch.float8_e4m3fn)
        v_scale = v_absmax / FP8_MAX
        v_offset = v_mean - v_scale * (v_q.float().sum(dim=2) / n)
    else:
        v_q = torch.nn.functional.pad(vf, (0, 0, 0, n_pad - n)).to(torch.float16)
        v_scale = v_offset = None
    vt = v_q.transpose(-1, -2).contiguous()
    if v_key_perm:
        vt = v_key_order(vt)
    return QuantizedQKV(q8, q_scale, k8, k_scale, vt, v_scale, v_offset, m, n, q.dtype, pv_fp8, k_block, v_key_perm)


# ---------------------------------------------------------------------------------------------------------------------
# Attention core
# ---------------------------------------------------------------------------------------------------------------------


def attention_quantized(qkv: QuantizedQKV, *, config: QuantAttentionConfig | None = None) -> torch.Tensor:
    """Triton attention core on a ``QuantizedQKV`` -> [B, H, M, D] in qkv.out_dtype. ``config`` None: the table's,
    with its key tile set to qkv.k_block; a config given must have block_n == qkv.k_block."""
    if config is None:
        config = dataclasses.replace(_config_for(qkv.q8.device, qkv.q8.shape[3], qkv.pv_fp8), block_n=qkv.k_block)
    if config.block_n != qkv.k_block:
        raise ValueError(
            f"config.block_n: expected {qkv.k_block}, the k_block qkv was quantized with, found {config.block_n}"
        )
    if qkv.v_key_perm:
        raise ValueError("attention_quantized: expected vt in token order (v_key_perm=False), the Gluon core's is not")
    _require_triton(qkv.q8.device)
    cfg = config
    if qkv.pv_fp8 and _interpreted():
        raise ValueError("pv_fp8=True: the Triton interpreter rounds FP8 wrongly; expected a pv_fp8=False QuantizedQKV")
    with _on_device(qkv.q8.device):
        return _launch_attention(qkv, cfg)


def _launch_attention(qkv: QuantizedQKV, cfg: QuantAttentionConfig) -> torch.Tensor:
    b, h, m_pad, d = qkv.q8.shape
    n_pad = qkv.k8.shape[2]
    out = torch.empty((b, h, qkv.num_q, d), dtype=qkv.out_dtype, device=qkv.q8.device)
    _quant_attention_kernel[(m_pad // cfg.block_m, b * h)](
        qkv.q8, qkv.q_scale, qkv.k8, qkv.k_scale, qkv.vt,
        qkv.v_scale if qkv.pv_fp8 else qkv.k_scale, qkv.v_offset if qkv.pv_fp8 else qkv.k_scale, out,
        *out.stride(), h, qkv.num_q, qkv.num_kv, m_pad, n_pad,
        HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, Q_BLK=Q_BLOCK,
        PV_FP8=qkv.pv_fp8, FP8_NO_FOLD=_fp8_no_fold(qkv.q8.device), UNROLL=cfg.unroll, EXP2_POLY=cfg.exp2_poly,
        PIPELINE=cfg.pipeline, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg}),
    )  # fmt: skip
    return out


def _fp8_no_fold(device: torch.device) -> bool:
    # See the FP8 branch of _attend_tile: everywhere but sm_90 an explicit max_num_imprecise_acc keeps acc + P·V apart.
    return not (device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0))


def _p_to_fp8_ref(p448: torch.Tensor) -> torch.Tensor:
    """P·448 (fp32) -> e4m3 values as fp32, saturating like cvt.rn.satfinite. A seam the interpreter test replaces."""
    return p448.clamp_max(FP8_MAX).to(torch.float8_e4m3fn).float()


def attention_quantized_ref(qkv: QuantizedQKV) -> torch.Tensor:
    """PyTorch reference of ``attention_quantized``: the kernel's online softmax, qkv.k_block keys per update, in
    FP32.

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
        p_q = _p_to_fp8_ref(p * FP8_MAX) if qkv.pv_fp8 else p.to(torch.float16).float()
        acc = acc * alpha[:, :, None] + torch.matmul(p_q, v[:, cols])
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
        v_inv = tl.math.div_rn(_FP8_MAX, tl.load(VMAX + bh64 * HEAD_DIM + offs_d))
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
            # (gathering rows keeps the transposed store contiguous; scattering it cost 0.6 ms at W1 on an H200)
            v_rows = (rows & -32) | (rows & 17) | ((rows >> 1) & 6) | ((rows << 2) & 8)
            v_valid = v_rows[:, None] < N
        v = tl.load(v_base + v_rows[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=v_valid, other=0.0)
        if PV_FP8:
            vs = tl.where(v_valid, (v.to(tl.float32) - v_mean[None, :]) * v_inv[None, :], 0.0)
            vq = tl.minimum(tl.maximum(vs, -_FP8_MAX), _FP8_MAX).to(tl.float8e4nv)
            vq_sum += tl.sum(vq.to(tl.float32), 0)  # padding rows are 0
        else:
            vq = v.to(tl.float16)
        tl.store(VT + bh64 * HEAD_DIM * N_PAD + offs_d[None, :] * N_PAD + rows[:, None], vq, mask=in_pad)
    if PV_FP8:
        tl.store(VQSUM + (bh64 * N_PROGRAMS + pid) * HEAD_DIM + offs_d, vq_sum)


@triton.jit
def _exp2_poly(x):
    # 2**x for x <= 0 on the FMA/ALU pipes. x = j + f with j = round(x), f in [-0.5, 0.5]: adding 1.5·2**23 rounds
    # x to an integer held in t's low mantissa bits; 2**j is then added straight into the exponent bits of 2**f.
    # Below -64 the result (2**-64) is zero to FP8 and FP16 P anyway; the clamp keeps the exponent arithmetic valid.
    x = tl.maximum(x, -64.0)
    t = x + _MAGIC_F
    f = x - (t - _MAGIC_F)
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
    MASK: tl.constexpr, POLY: tl.constexpr,
):  # fmt: skip
    # One BLOCK_N-key tile: S = q8·k8ᵀ (int32, exact), online-softmax update, acc += P·V.
    qk = _tile_scores(q, k_ptrs, start_n, HEAD_DIM)
    p, l_i, m_new, alpha = _tile_probs(l_i, m_i, qk, q_scale, ks_ptr, start_n, N, BLOCK_N, PV_FP8, MASK, POLY)
    acc = acc * alpha[:, None]
    if PV_FP8:
        acc = acc + _tile_pv(p, vt_ptrs, start_n, BLOCK_N, PV_FP8, FP8_NO_FOLD)
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
    f = (qk + _MAGIC_I).to(tl.float32, bitcast=True)  # = 1.5·2**23 + qk exactly; monotonic in qk
    if MASK:
        valid = (start_n + tl.arange(0, BLOCK_N))[None, :] < N
        f = tl.where(valid, f, 0.0)  # below every valid f, so the row max ignores it; no inf, so no inf·0 NaN
    # sc > 0, so max(qk·sc) = (max f - 1.5·2**23)·sc and every score costs a single FMA: qk·sc - m = f·sc - bias.
    m_new = tl.maximum(m_i, (tl.max(f, 1) - _MAGIC_F) * sc)
    alpha = tl.exp2(m_i - m_new)
    bias = m_new + _MAGIC_F * sc
    if PV_FP8:
        bias -= _LOG2_FP8_MAX  # P comes out already scaled to e4m3's range [0, 448]; l carries the same factor
    x = f * sc - bias[:, None]
    p = _exp2_poly(x) if POLY else tl.exp2(x)
    if MASK:
        p = tl.where(valid, p, 0.0)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, l_i, m_new, alpha


@triton.jit
def _tile_pv(p, vt_ptrs, start_n, BLOCK_N: tl.constexpr, PV_FP8: tl.constexpr, FP8_NO_FOLD: tl.constexpr):
    # One tile's P·V from zero, in FP32 (the caller adds it to the accumulator).
    vt = tl.load(vt_ptrs + start_n)  # [D, BLOCK_N], tokens contiguous: tl.trans makes a K-major B operand
    if PV_FP8:
        # FP8 MMAs keep only ~14 significant bits when they add into their accumulator (DeepSeek-V3 report on
        # sm_90; SageAttention 2 saw the same on sm_89), a loss that grows with the number of keys summed there.
        # Each tile's P·V therefore starts from zero and is added to acc in FP32 (SageAttention 2's two-level
        # accumulation). On sm_90 that is a plain add: tl.dot(..., acc, max_num_imprecise_acc=BLOCK_N) would read
        # the wgmma accumulator mid-pipeline and ptxas then serializes every wgmma of the kernel (warning C7514,
        # seen compiling for sm_90a with Triton 3.8), and Triton's default for FP8 there (2**30) already stops its
        # combine pass from folding `acc + dot` back into the dot. Elsewhere the default is 0 and the fold happens,
        # so a nonzero value is passed; outside sm_90's wgmma lowering it has no other effect.
        # The conversion saturates (cvt.rn.satfinite), which caps P·448 rounded a hair above 448.
        if FP8_NO_FOLD:
            pv = tl.dot(p.to(tl.float8e4nv), tl.trans(vt), max_num_imprecise_acc=BLOCK_N)
        else:
            pv = tl.dot(p.to(tl.float8e4nv), tl.trans(vt))
    else:
        pv = tl.dot(p.to(tl.float16), tl.trans(vt))
    return pv


@triton.jit
def _quant_attention_kernel(
    Q8, QS, K8, KS, VT, VS, VO, Out,  # see QuantizedQKV (VO: v_offset); out: [B, H, M, D] q.dtype; VS, VO: PV_FP8 only
    stride_ob, stride_oh, stride_om, stride_od,
    H, M, N, M_PAD, N_PAD,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, Q_BLK: tl.constexpr,
    PV_FP8: tl.constexpr, FP8_NO_FOLD: tl.constexpr, UNROLL: tl.constexpr, EXP2_POLY: tl.constexpr,
    PIPELINE: tl.constexpr,
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
                HEAD_DIM, BLOCK_N, PV_FP8, FP8_NO_FOLD, False, False,
            )  # fmt: skip
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_scale, k_ptrs, vt_ptrs, ks_ptr, start_n + BLOCK_N, N,
                HEAD_DIM, BLOCK_N, PV_FP8, FP8_NO_FOLD, False, EXP2_POLY,
            )  # fmt: skip
        if n_full % 2 == 1:
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_scale, k_ptrs, vt_ptrs, ks_ptr, (n_full - 1) * BLOCK_N, N,
                HEAD_DIM, BLOCK_N, PV_FP8, FP8_NO_FOLD, False, False,
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
                pv = _tile_pv(p, vt_ptrs, start_n, BLOCK_N, PV_FP8, FP8_NO_FOLD)
                alpha_pv = alpha
            start_n = (n_full - 1) * BLOCK_N
            p, l_i, m_i, alpha = _tile_probs(l_i, m_i, qk, q_scale, ks_ptr, start_n, N, BLOCK_N, PV_FP8, False, False)
            acc = acc * alpha_pv[:, None] + pv
            acc = acc * alpha[:, None] + _tile_pv(p, vt_ptrs, start_n, BLOCK_N, PV_FP8, FP8_NO_FOLD)
    else:
        for start_n in range(0, n_full * BLOCK_N, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_scale, k_ptrs, vt_ptrs, ks_ptr, start_n, N,
                HEAD_DIM, BLOCK_N, PV_FP8, FP8_NO_FOLD, False, False,
            )  # fmt: skip
    if N % BLOCK_N != 0:  # the ragged last tile is the only one that pays for the key mask
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_scale, k_ptrs, vt_ptrs, ks_ptr, n_full * BLOCK_N, N,
            HEAD_DIM, BLOCK_N, PV_FP8, FP8_NO_FOLD, True, False,
        )  # fmt: skip

    out = acc / l_i[:, None]  # with FP8, P's factor 448 is in both acc and l
    if PV_FP8:  # undoes V's scale, then adds v_offset (V's smoothing, corrected for V_q's mean rounding error)
        out = out * tl.load(VS + bh64 * HEAD_DIM + offs_d)[None, :] + tl.load(VO + bh64 * HEAD_DIM + offs_d)[None, :]
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    o_ptrs = Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_m[:, None] < M)
