"""SageAttention-2-style quantized attention: INT8 Q·Kᵀ, FP8 (or FP16) P·V, online softmax in FP32.

Public API (layout BHND = [batch, heads, tokens, head_dim]; no mask; q and k/v token counts may differ):

- ``quant_attention(q, k, v, *, pv_fp8=None, sm_scale=None)``: approximates ``softmax(q kᵀ·sm_scale) v``.
  q: [B, H, M, D], k/v: [B, H, N, D], bf16 or fp16, D in {64, 128}, M, N >= 1. Returns [B, H, M, D] in q's dtype.
  Lossy: see "Accuracy" below.
- ``quant_attention_ref(...)``: the same quantization scheme step by step in PyTorch (FP32 maths); the kernel is
  checked against it tightly.
- ``attention_fp32(q, k, v, *, sm_scale=None)``: exact attention in FP32, chunked over query rows
  (exact_attention.py).
- ``quantize_qkv`` / ``quantize_qkv_ref`` (quant_attention_prologue.py) and ``attention_quantized`` /
  ``attention_quantized_ref`` (quant_attention_core.py): the two halves (quantization prologue, attention core),
  re-exported here so tests and benchmarks can check and time them apart. This module is the dispatch: which
  implementation runs where, the public op and its reference.

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
   (b, h, channel) by absmax / FP8_MAX; P (in [0, 1]) scaled by FP8_MAX (folded into exp2's argument); each key tile's
   FP8 product summed into the FP32 accumulator. On GeForce (sm_89, sm_12x), where FP8 MMAs with an FP32
   accumulator run at half rate, V is scaled to ±2.25 instead and each 32 keys' product is summed in FP16 (the
   full-rate form; 32 · FP8_MAX · 2.25 < 65504, so it cannot overflow), then into FP32 (SageAttention2++).
   Elsewhere P and V in FP16 (V unsmoothed: FP16 keeps 11 significant bits whatever the offset).

Accuracy: the INT8 Q·Kᵀ costs little next to the FP8 rounding of P and of V (e4m3's 3-bit mantissa: no scale choice
helps, the error is relative), which makes FP8 P·V the lossier path; when V carries per-channel offsets, as DiT values
do, the smoothing removes most of its error. The error budget and the bounds the tests hold the reference and the
kernels to are in tests/test_quant_attention.py; the errors at W1 on an H200, with 64- and 128-key K scales, in
measurements/sessions/2026-11-29_attention-sweep/README.md.

Implementations by architecture (see ``_select_implementation``):

| device                       | implementation                                          | P·V default              |
|------------------------------|---------------------------------------------------------|--------------------------|
| CUDA sm_90, head_dim 64, 128 | Triton prologue + Gluon core (quant_attention_wgmma.py) | FP8                      |
| CUDA sm_89 and newer         | Triton kernels                                          | FP8 (FP16 acc: GeForce)  |
| CUDA sm_80 .. sm_87          | Triton kernels                                          | FP16                     |
| CUDA older than sm_80        | reference (logged once)                                 | FP16                     |
| any, Triton interpreter on   | Triton kernels, interpreted                             | FP16 (FP8 refused there) |
| CPU, interpreter off         | reference (logged once)                                 | FP16                     |

(The interpreter's FP8 conversions are wrong, hence FP8 P·V refused under it.)
"""

from __future__ import annotations

import logging

import torch

from .attention_constants import K_BLOCK, K_BLOCKS, LOG2E, Q_BLOCK, SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS
from .exact_attention import attention_fp32
from .fallback import kernel_runs
from .gluon_hopper import GLUON_AVAILABLE
from .quant_attention_core import (
    CANDIDATE_CONFIGS,
    QuantAttentionConfig,
    attention_quantized,
    attention_quantized_ref,
    config_for,
)
from .quant_attention_prologue import (
    QuantizedQKV,
    _check_inputs,
    _interpreted,
    _triton_runs_on,
    has_fp8_tensor_cores,
    quantize_qkv,
    quantize_qkv_ref,
    resolve_pv_fp8,
    v_key_order,
    v_token_order,
)
from .quant_attention_wgmma import attention_quantized_wgmma

__all__ = [
    "CANDIDATE_CONFIGS",
    "K_BLOCK",
    "K_BLOCKS",
    "LOG2E",
    "Q_BLOCK",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_DIMS",
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


def _select_implementation(device: torch.device) -> str:
    """'triton' or 'reference' for tensors on ``device`` (see the table in the module docstring)."""
    runs = _triton_runs_on(device)
    kernel_runs(logger, "quant_attention", device, runs, "no INT8 tensor-core path in Triton below sm_80")
    return "triton" if runs else "reference"


def quant_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, pv_fp8: bool | None = None, sm_scale: float | None = None
) -> torch.Tensor:
    """Quantized softmax(q kᵀ·sm_scale) v. q: [B, H, M, D], k, v: [B, H, N, D] bf16/fp16 -> [B, H, M, D] q.dtype."""
    _check_inputs(q, k, v, sm_scale)
    if _select_implementation(q.device) == "reference":
        return quant_attention_ref(q, k, v, pv_fp8=pv_fp8, sm_scale=sm_scale)
    pv_fp8 = resolve_pv_fp8(pv_fp8, q.device)
    if pv_fp8 and _gluon_core_runs(q.device, q.shape[3]):
        qkv = quantize_qkv(
            q, k, v, pv_fp8=True, sm_scale=sm_scale, k_block=GLUON_K_BLOCK, v_key_perm=True, pv_fp16_acc=False
        )
        return attention_quantized_wgmma(qkv)
    cfg = config_for(q.device, q.shape[3], pv_fp8)
    qkv = quantize_qkv(q, k, v, pv_fp8=pv_fp8, sm_scale=sm_scale, k_block=cfg.block_n)
    return attention_quantized(qkv, config=cfg)


# Where the Gluon core (quant_attention_wgmma.py, FP8 P·V) replaces the Triton one: GPU capability -> head
# dims. On an H200 at W1 it beats the Triton core at both head dims (at head_dim 64 since its tree row reductions):
# measurements/sessions/2026-11-29_attention-tree/README.md.
_GLUON_CORE_HEAD_DIMS = {(9, 0): (64, 128)}
GLUON_K_BLOCK = 128


def _k_block_for(device: torch.device, head_dim: int, pv_fp8: bool) -> int:
    """The key tile (= keys per K scale) `quant_attention` quantizes with on `device`."""
    if pv_fp8 and _gluon_core_runs(device, head_dim):
        return GLUON_K_BLOCK
    return config_for(device, head_dim, pv_fp8).block_n


def _gluon_core_runs(device: torch.device, head_dim: int) -> bool:
    if device.type != "cuda" or _interpreted():
        return False
    return GLUON_AVAILABLE and head_dim in _GLUON_CORE_HEAD_DIMS.get(torch.cuda.get_device_capability(device), ())


# For compiled callers (the DiT's compiled block): one opaque op. Traced inline, the Python decisions above (reference
# or kernel, FP8 P·V or not, input checks) break the graph, and a partial graph ending at such a break carries only
# the guards read before it: a later call on the exact path matched it and recompiled the attention frames, seconds
# in the second request's exact first step (measurements/sessions/2026-11-29_step-profile/README.md).
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
    fp8 = has_fp8_tensor_cores(q.device) if pv_fp8 is None else bool(pv_fp8)
    k_block = _k_block_for(q.device, q.shape[3], fp8) if k_block is None else k_block
    return attention_quantized_ref(quantize_qkv_ref(q, k, v, pv_fp8=fp8, sm_scale=sm_scale, k_block=k_block))
