"""Linear-layer dispatch: cuBLAS bf16 (reference), Triton fp16-accumulate, fp8 e4m3 row-wise, or block-scaled MXFP8 /
NVFP4 (Blackwell), per layer; and the weights of quantized checkpoints (fp8, mxfp8: their own GEMMs; nvfp4: the
block-scaled NVFP4 GEMM with K6_GEMM=nvfp4 on Blackwell, else dequantized on the GPU, then cuBLAS).

Modulation, time-embedding and pooled-text layers always stay exact (fp32): one row each, and their outputs scale
every residual update. Layers with fewer rows than `K6_GEMM_MIN_ROWS` stay bf16 too: below a few thousand rows the
quantization passes cost more than the faster GEMM saves (the audio stream's 218 tokens, text tokens).

Quantized checkpoints (`k6fast quantize`): their fused-block linear weights arrive as `QuantizedWeight`s and run the
checkpoint's GEMM (fp8 → `fp8_linear` on the stored e4m3 weight, no re-quantization; mxfp8 → the block-scaled MXFP8
GEMM on sm_100/sm_12x; nvfp4 → dequantized on the GPU, then cuBLAS bf16, unless K6_GEMM=nvfp4 asks for the
block-scaled NVFP4 GEMM, which also rounds the activations to 4 bits; see `_stored_gemm_runs`) whatever else K6_GEMM
says. The loss was taken when the checkpoint was
written: re-running an fp8 layer in bf16 would give the same lossy weights at bf16 speed with 2x the device bytes,
and requiring K6_GEMM to match would make every arm that runs the bf16 checkpoint fail on the quantized one.
K6_GEMM still governs the layers the checkpoint keeps in bf16. Where the fp8 GEMM does not run (fewer rows than
K6_GEMM_MIN_ROWS, CPU, fp32 activations, a GPU without FP8 or block-scaled MMA) the weight is dequantized and
multiplied by F.linear: correct everywhere.

K6_GEMM=mxfp8 / nvfp4 on bf16 weights quantize weight and activations per call (k6fast/kernels/blockscaled.py, torchao's
quantization, with outlier columns as for fp8).
`arch.resolve_auto` turns them into bf16, with a warning, on GPUs without block-scaled tensor cores; K6_GEMM=fp8 on
GeForce sm_89/sm_12x runs the FP16-chunk FP8 GEMM (k6fast/kernels/fp8_fp16acc.py; `resolve_auto` turns it into
fp8-fp16acc) instead of `torch._scaled_mm`, whose FP32 accumulation runs at half rate there.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._pytree import tree_map_only

from ..kernels import blockscaled, fp8_fp16acc, fp8_linear, fp8_outliers, fp16acc_linear, nvfp4
from ..kernels.formats import E4M3_MAX
from ..switches import Options
from .config import EXACT_LAYERS, QUANT_FORMATS, fast_gemm_layer

# The FP16-chunk FP8 GEMM's operand range (fp8-fp16acc); E4M3_MAX is the range where FP32 accumulation runs.
FP16_CHUNK_QMAX = fp8_fp16acc.FP16_CHUNK_QMAX[fp8_fp16acc.DEFAULT_CHUNK]

__all__ = ["EXACT_LAYERS", "LinearDispatch", "QuantizedWeight", "bind_quantized"]


class QuantizedWeight(Tensor):
    """A linear weight [N, K] as a quantized checkpoint stores it (formats in `config.py` / k6fast/quantize.py).

    To every torch op it is a `dtype` tensor [N, K]: `__torch_dispatch__` dequantizes it first, so code written for
    plain weights (ExactBackend's F.linear, tests) stays correct. `LinearDispatch` reads the stored tensors instead:
    fp8 `qdata` e4m3 [N, K] + `scale` fp32 [N]; mxfp8 `qdata` e4m3 [N, K] + `scale` uint8 [N, K/32]; nvfp4 `qdata`
    uint8 [N, K/2] + `scale` e4m3 [N, K/16] + `scale_2` fp32 []. The stored tensors are views of the checkpoint's bytes
    (a device slot when streamed); nothing is copied.
    """

    fmt: str
    qdata: Tensor
    scale: Tensor
    scale_2: Tensor | None
    # Results of torch functions on a QuantizedWeight are plain tensors (the dispatch below returns them as such).
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, fmt: str, qdata: Tensor, scale: Tensor, scale_2: Tensor | None, dtype: torch.dtype):
        if fmt not in QUANT_FORMATS:
            raise ValueError(f"QuantizedWeight: expected a format in {QUANT_FORMATS}, found {fmt!r}")
        k = qdata.shape[1] * (2 if fmt == "nvfp4" else 1)
        return Tensor._make_wrapper_subclass(cls, (qdata.shape[0], k), dtype=dtype, device=qdata.device)

    def __init__(self, fmt: str, qdata: Tensor, scale: Tensor, scale_2: Tensor | None, dtype: torch.dtype):
        expected = torch.uint8 if fmt == "nvfp4" else torch.float8_e4m3fn
        if qdata.dtype != expected or qdata.ndim != 2 or (fmt == "nvfp4") != (scale_2 is not None):
            raise ValueError(
                f"QuantizedWeight {fmt}: expected a 2-D {expected} weight"
                f"{' with a global scale' if fmt == 'nvfp4' else ' and no second scale'}, "
                f"found {qdata.dtype} {tuple(qdata.shape)}, scale_2 {'given' if scale_2 is not None else 'missing'}"
            )
        self.fmt, self.qdata, self.scale, self.scale_2 = fmt, qdata, scale, scale_2

    def dequantized(self, dtype: torch.dtype | None = None) -> Tensor:
        """The weight [N, K] in `dtype` (default: the dtype it poses as), computed in fp32 and rounded once."""
        dtype = dtype or self.dtype
        if self.fmt == "fp8":
            return (self.qdata.float() * self.scale.reshape(-1, 1)).to(dtype)
        if self.fmt == "mxfp8":
            return blockscaled.dequantize_mxfp8(self.qdata, self.scale, dtype)
        return nvfp4.dequantize_nvfp4(self.qdata, self.scale, self.scale_2, dtype)

    def __repr__(self) -> str:  # the default repr would run ops on the wrapper
        return (
            f"QuantizedWeight({self.fmt}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"stored {self.qdata.dtype} {tuple(self.qdata.shape)}, device={self.device})"
        )

    # torch.compile: the wrapper flattens to its stored tensors, so compiled blocks take them as graph inputs.
    def __tensor_flatten__(self):
        return ["qdata", "scale"] + (["scale_2"] if self.scale_2 is not None else []), (self.fmt, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner: dict, ctx, outer_size, outer_stride) -> QuantizedWeight:
        fmt, dtype = ctx
        return QuantizedWeight(fmt, inner["qdata"], inner["scale"], inner.get("scale_2"), dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = tree_map_only(QuantizedWeight, lambda t: t.dequantized(), (args, kwargs or {}))
        return func(*args, **kwargs)


def bind_quantized(tensors: dict[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
    """Replace, in place, every `<layer>.weight` that has a `<layer>.weight_scale` beside it by a QuantizedWeight
    posing as `dtype`; the scale tensors stay in the mapping too. The format follows from the stored dtypes (uint8
    weight → nvfp4; e4m3 weight with fp32 scales → fp8, with uint8 scales → mxfp8); `open_checkpoint` has already
    checked them against the checkpoint's config. Returns `tensors`."""
    for scale_name in [name for name in tensors if name.endswith(".weight_scale")]:
        name = scale_name[: -len("_scale")]
        stored = tensors.get(name)
        if stored is None or isinstance(stored, QuantizedWeight):
            continue
        scale_dtype = tensors[scale_name].dtype
        fmt = {
            (torch.float8_e4m3fn, torch.float32): "fp8",
            (torch.float8_e4m3fn, torch.uint8): "mxfp8",
            (torch.uint8, torch.float8_e4m3fn): "nvfp4",
        }.get((stored.dtype, scale_dtype))
        if fmt is None:
            raise ValueError(
                f"{name}: a weight with a weight_scale must be (float8_e4m3fn, float32 scale), (float8_e4m3fn, uint8) "
                f"or (uint8, float8_e4m3fn), found ({stored.dtype}, {scale_dtype})"
            )
        tensors[name] = QuantizedWeight(fmt, stored, tensors[scale_name], tensors.get(f"{name}_scale_2"), dtype)
    return tensors


def _stored_gemm_runs(fmt: str, x: Tensor, kind: str) -> bool:
    """Whether the quantized checkpoint's own GEMM runs for these activations (else: dequantize + F.linear).

    fp8: the FP8 GEMM wherever FP8 tensor cores exist. mxfp8: the block-scaled GEMM on sm_100/sm_12x. nvfp4: the
    block-scaled NVFP4 GEMM there only with K6_GEMM=nvfp4, because it also rounds the activations to 4 bits, a loss
    the checkpoint alone does not imply; otherwise (and on every other GPU) the weight is dequantized and multiplied
    by cuBLAS bf16: on an H200 close to cuBLAS on a bf16 weight, where the Triton dequantize-in-prologue GEMM
    (`kernels.nvfp4.nvfp4_linear`) is many times slower (measurements/sessions/2026-11-29_attention-pipeline/README.md).
    The checkpoint's saving is in the bytes streamed from disk and over PCIe, which the packed weight keeps either
    way."""
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if fmt == "fp8":
        return fp8_linear.fp8_native(x.device)
    return blockscaled.blockscaled_native(x.device) and (fmt == "mxfp8" or kind == "nvfp4")


class LinearDispatch:
    def __init__(self, options: Options):
        if options.gemm in ("auto", "auto-lossy"):
            raise ValueError(
                f"K6_GEMM={options.gemm} must be resolved for a device first (k6fast.dit.arch.resolve_auto)"
            )
        self.kind = options.gemm
        self.min_rows = options.gemm_min_rows
        self.outlier_channels = int(options.fp8_outlier_channels)
        # backend → calls: bf16 / fp16acc / fp8 / fp8-fp16acc / mxfp8 / nvfp4, and <format>-dequantized for stored
        # weights multiplied by F.linear.
        self.counts: Counter[str] = Counter()

    def use_fast(self, rows: int, weight_shape: tuple[int, ...], name: str) -> bool:
        """The policy alone: which layers the fast GEMM takes (the caller also requires CUDA tensors)."""
        if self.kind == "bf16":
            return False
        # fp8 row-wise scaled_mm needs K and N multiples of 16; the block-scaled formats K a multiple of 32.
        if self.kind in ("mxfp8", "nvfp4") and weight_shape[-1] % 32:
            return False
        return rows >= self.min_rows and fast_gemm_layer(name, weight_shape)

    def __call__(
        self, x: Tensor, weight: Tensor, bias: Tensor | None, *, name: str, shared: dict | None = None
    ) -> Tensor:
        """x: [..., K]; weight: [N, K] (plain or QuantizedWeight); bias: [N] or None → [..., N] in x.dtype.
        shared: one dict passed to every layer that takes this same x (q/k/v projections), so x's quantization
        (and fp8 outlier channels) are computed once for all of them."""
        counting = not torch.compiler.is_compiling()  # Python state would become a compile guard
        rows = x.numel() // x.shape[-1]
        if isinstance(weight, QuantizedWeight):
            return self._stored(x, weight, bias, rows, counting, shared)
        kind = self.kind
        if kind in ("mxfp8", "nvfp4") and x.is_cuda:
            kind = kind if blockscaled.blockscaled_native(x.device) else "bf16"  # resolve_auto has said so once
        if kind == "bf16" or not (x.is_cuda and self.use_fast(rows, tuple(weight.shape), name)):
            if counting:
                self.counts["bf16"] += 1
            return F.linear(x, weight, bias)
        if kind in ("fp8", "fp8-fp16acc"):
            # Weights are quantized at use: streamed blocks arrive in reused slots, so a cache keyed by tensor would
            # go stale. The pass reads each weight once per call, small beside the block's compute (included in the
            # fp8 block time of measurements/sessions/2026-11-29_kernels/README.md). A checkpoint from
            # `k6fast quantize --format fp8` removes it.
            # With K6_FP8_OUTLIER_CHANNELS > 0 (the bf16 weight at hand), its rounding at this call's outlier channels
            # is corrected by extra GEMM columns (k6fast/kernels/fp8_outliers.py). fp8-fp16acc (what K6_GEMM=fp8
            # resolves to on GeForce, where FP32 accumulation runs at half rate) quantizes to the FP16-chunk GEMM's
            # range and runs it.
            chunks = kind == "fp8-fp16acc"
            qmax = FP16_CHUNK_QMAX if chunks else E4M3_MAX
            cols, xq = fp8_input(x, self.outlier_channels, shared, qmax)
            wq, w_scale = fp8_linear.quantize_weight_fp8(weight, residual_cols=cols, qmax=qmax)
            if counting:
                self.counts[kind] += 1
            return _fp8_fp16acc(x, wq, w_scale, bias, xq) if chunks else _fp8(x, wq, w_scale, bias, xq)
        if counting:
            self.counts[kind] += 1
        if kind in ("mxfp8", "nvfp4"):
            # Quantized at use, as the fp8 weights are; `k6fast quantize --format mxfp8|nvfp4` removes the pass. With
            # K6_FP8_OUTLIER_CHANNELS > 0, 2C extra columns put back both operands' rounding at this call's largest
            # input channels (k6fast/kernels/blockscaled.py; tests/test_blockscaled.py holds the errors with and
            # without).
            cols, xq = _blockscaled_input(x, kind, self.outlier_channels, shared)
            if cols is None:
                wq = blockscaled.quantize_weight(weight, kind)
            else:
                wq = blockscaled.weight_with_outliers(weight, kind, cols)
            return _blockscaled(x, kind, wq, bias, xq)
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        out = fp16acc_linear.fp16acc_linear(flat, weight, bias, out_dtype=x.dtype)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    def _stored(
        self, x: Tensor, weight: QuantizedWeight, bias: Tensor | None, rows: int, counting: bool, shared: dict | None
    ) -> Tensor:
        fast = rows >= self.min_rows and _stored_gemm_runs(weight.fmt, x, self.kind)
        if counting:
            self.counts[weight.fmt if fast else f"{weight.fmt}-dequantized"] += 1
        if not fast:
            return F.linear(x, weight.dequantized(x.dtype), bias)
        if weight.fmt in ("mxfp8", "nvfp4"):
            # No unquantized weight to take residual columns from: plain block quantization of x.
            xq = _blockscaled_input(x, weight.fmt, 0, shared)[1]
            return _blockscaled(x, weight.fmt, (weight.qdata, weight.scale, weight.scale_2), bias, xq)
        # A stored e4m3 weight (quantized to ±E4M3_MAX) has no bf16 columns to correct: plain row quantization, and
        # torch._scaled_mm even on GeForce (the FP16-chunk GEMM needs operands in its smaller range).
        return _fp8(x, weight.qdata, weight.scale, bias, fp8_input(x, 0, shared)[1])


def _blockscaled_input(x: Tensor, fmt: str, outlier_channels: int, shared: dict | None) -> tuple[Tensor | None, tuple]:
    """(outlier columns or None, x [rows, K] block-quantized in `fmt`, with the outlier columns' 2C extra columns):
    computed once per `shared` dict."""
    key = (fmt, outlier_channels)
    if shared is not None and key in shared:
        return shared[key]
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    cols = fp8_outliers.outlier_columns(flat, outlier_channels)
    if cols is None:
        prepared = None, blockscaled.quantize_activations(flat, fmt)
    else:
        cols = cols[:outlier_channels]
        prepared = cols, blockscaled.activations_with_outliers(flat, fmt, cols)
    if shared is not None:
        shared[key] = prepared
    return prepared


def _blockscaled(x: Tensor, fmt: str, w: tuple, bias: Tensor | None, xq: tuple) -> Tensor:
    """x [..., K] through the block-scaled GEMM: xq its quantization (`_blockscaled_input`), w the weight's
    (qdata, scale, scale_2) with the same K (outlier columns included)."""
    y = blockscaled.blockscaled_linear(fmt, xq, w, None if bias is None else bias.to(x.dtype), out_dtype=x.dtype)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def fp8_input(
    x: Tensor, outlier_channels: int, shared: dict | None, qmax: float = E4M3_MAX
) -> tuple[Tensor | None, tuple[Tensor, Tensor]]:
    """(outlier columns or None, x's rows quantized to e4m3 (±qmax) with them): computed once per `shared` dict."""
    key = ("fp8", outlier_channels, qmax)
    if shared is not None and key in shared:
        return shared[key]
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    cols = fp8_outliers.outlier_columns(flat, outlier_channels)
    prepared = cols, fp8_linear.quantize_rows_fp8(flat, cols, qmax=qmax)
    if shared is not None:
        shared[key] = prepared
    return prepared


def _fp8(x: Tensor, wq: Tensor, w_scale: Tensor, bias: Tensor | None, xq: tuple[Tensor, Tensor]) -> Tensor:
    """x [..., K] through the row-wise fp8 GEMM with an e4m3 weight [N, K'] and its per-channel scale; xq: x
    quantized ([rows, K'] e4m3 and its row scales; K' > K with outlier columns)."""
    # Hopper's fast accumulation (fewer promotions of the wgmma accumulator to fp32): faster at the W1 shapes, row
    # quantization included, for an error small beside e4m3's own rounding
    # (measurements/sessions/2026-11-29_h200-followup/README.md). The arm is lossy anyway.
    out = fp8_linear.fp8_linear(
        xq, wq, w_scale, bias=None if bias is None else bias.to(x.dtype), out_dtype=x.dtype, fast_accum=True
    )
    return out.reshape(*x.shape[:-1], wq.shape[0])


def _fp8_fp16acc(x: Tensor, wq: Tensor, w_scale: Tensor, bias: Tensor | None, xq: tuple[Tensor, Tensor]) -> Tensor:
    """As `_fp8`, through the FP16-chunk FP8 GEMM (operands quantized to its range)."""
    bias = None if bias is None else bias.to(x.dtype)
    out = fp8_fp16acc.fp8_fp16acc_linear(xq, wq, w_scale, bias=bias, out_dtype=x.dtype)
    return out.reshape(*x.shape[:-1], wq.shape[0])
