"""Linear-layer dispatch: cuBLAS bf16 (reference), Triton fp16-accumulate, or fp8 e4m3 row-wise, per layer; and the
weights of quantized checkpoints (fp8: its own GEMM; nvfp4: dequantized on the GPU, then cuBLAS).

Modulation, time-embedding and pooled-text layers always stay exact (fp32): one row each, and their outputs scale
every residual update. Layers with fewer rows than `K6_GEMM_MIN_ROWS` stay bf16 too: below a few thousand rows the
quantization passes cost more than the faster GEMM saves (the audio stream's 218 tokens, text tokens).

Quantized checkpoints (`k6fast quantize`): their fused-block linear weights arrive as `QuantizedWeight`s and run the
checkpoint's GEMM (fp8 → `fp8_linear` on the stored e4m3 weight, no re-quantization; nvfp4 → dequantized on the
GPU, then cuBLAS bf16, see `_stored_gemm_runs`) whatever K6_GEMM says. The loss was taken when the checkpoint was
written: re-running an fp8 layer in bf16 would give the same lossy weights at bf16 speed with 2x the device bytes,
and requiring K6_GEMM to match would make every arm that runs the bf16 checkpoint fail on the quantized one.
K6_GEMM still governs the layers the checkpoint keeps in bf16. Where the fp8 GEMM does not run (fewer rows than
K6_GEMM_MIN_ROWS, CPU, fp32 activations, a GPU without FP8) the weight is dequantized and multiplied by F.linear:
correct everywhere.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._pytree import tree_map_only

from ..switches import Options
from .config import EXACT_LAYERS, fast_gemm_layer

__all__ = ["EXACT_LAYERS", "LinearDispatch", "QuantizedWeight", "bind_quantized"]


class QuantizedWeight(Tensor):
    """A linear weight [N, K] as a quantized checkpoint stores it (formats in `config.py` / k6fast/quantize.py).

    To every torch op it is a `dtype` tensor [N, K]: `__torch_dispatch__` dequantizes it first, so code written for
    plain weights (ExactBackend's F.linear, tests) stays correct. `LinearDispatch` reads the stored tensors instead:
    fp8 `qdata` e4m3 [N, K] + `scale` fp32 [N]; nvfp4 `qdata` uint8 [N, K/2] + `scale` e4m3 [N, K/16] + `scale_2`
    fp32 []. The stored tensors are views of the checkpoint's bytes (a device slot when streamed); nothing is copied.
    """

    fmt: str
    qdata: Tensor
    scale: Tensor
    scale_2: Tensor | None
    # Results of torch functions on a QuantizedWeight are plain tensors (the dispatch below returns them as such).
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, fmt: str, qdata: Tensor, scale: Tensor, scale_2: Tensor | None, dtype: torch.dtype):
        if fmt not in ("fp8", "nvfp4"):
            raise ValueError(f"QuantizedWeight: expected format fp8 or nvfp4, found {fmt!r}")
        k = qdata.shape[1] * (2 if fmt == "nvfp4" else 1)
        return Tensor._make_wrapper_subclass(cls, (qdata.shape[0], k), dtype=dtype, device=qdata.device)

    def __init__(self, fmt: str, qdata: Tensor, scale: Tensor, scale_2: Tensor | None, dtype: torch.dtype):
        expected = torch.float8_e4m3fn if fmt == "fp8" else torch.uint8
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
        from ..kernels.nvfp4 import dequantize_nvfp4

        return dequantize_nvfp4(self.qdata, self.scale, self.scale_2, dtype)

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
    posing as `dtype`; the scale tensors stay in the mapping too. The format follows from the stored dtype (e4m3 →
    fp8, uint8 → nvfp4); `open_checkpoint` has already checked it against the checkpoint's config. Returns `tensors`."""
    for scale_name in [name for name in tensors if name.endswith(".weight_scale")]:
        name = scale_name[: -len("_scale")]
        stored = tensors.get(name)
        if stored is None or isinstance(stored, QuantizedWeight):
            continue
        fmt = {torch.float8_e4m3fn: "fp8", torch.uint8: "nvfp4"}.get(stored.dtype)
        if fmt is None:
            raise ValueError(
                f"{name}: a weight with a weight_scale must be float8_e4m3fn or uint8, found {stored.dtype}"
            )
        tensors[name] = QuantizedWeight(fmt, stored, tensors[scale_name], tensors.get(f"{name}_scale_2"), dtype)
    return tensors


def _stored_gemm_runs(fmt: str, x: Tensor) -> bool:
    """Whether the quantized checkpoint's own GEMM runs for these activations (else: dequantize + F.linear).

    nvfp4 always takes the second path: on an H200, dequantizing the layer's weight on the GPU and running cuBLAS
    bf16 reaches 0.91-0.94x the speed of cuBLAS on a bf16 weight, the Triton dequantize-in-prologue GEMM
    (`kernels.nvfp4.nvfp4_linear`) 0.11x (measurements/sessions/2026-11-29_attention-pipeline/nvfp4.json). The
    checkpoint's saving is in the bytes streamed from disk and over PCIe, which the packed weight keeps either way."""
    if fmt != "fp8" or not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    from ..kernels.fp8_linear import fp8_native

    return fp8_native(x.device)


class LinearDispatch:
    def __init__(self, options: Options):
        if options.gemm == "auto":
            raise ValueError("K6_GEMM=auto must be resolved for a device first (k6fast.dit.arch.resolve_auto)")
        self.kind = options.gemm
        self.min_rows = options.gemm_min_rows
        self.outlier_channels = int(options.fp8_outlier_channels)
        # backend → calls: bf16 / fp16acc / fp8, and fp8-dequantized / nvfp4-dequantized for stored weights
        # multiplied by F.linear.
        self.counts: Counter[str] = Counter()

    def use_fast(self, rows: int, weight_shape: tuple[int, ...], name: str) -> bool:
        """The policy alone: which layers the fast GEMM takes (the caller also requires CUDA tensors)."""
        if self.kind == "bf16":
            return False
        # fp8 row-wise scaled_mm needs K and N multiples of 16.
        return rows >= self.min_rows and fast_gemm_layer(name, weight_shape)

    def __call__(
        self, x: Tensor, weight: Tensor, bias: Tensor | None, *, name: str, shared: dict | None = None
    ) -> Tensor:
        """x: [..., K]; weight: [N, K] (plain or QuantizedWeight); bias: [N] or None → [..., N] in x.dtype.
        shared: one dict passed to every layer that takes this same x (q/k/v projections), so x's fp8 quantization
        and outlier channels are computed once for all of them."""
        counting = not torch.compiler.is_compiling()  # Python state would become a compile guard
        rows = x.numel() // x.shape[-1]
        if isinstance(weight, QuantizedWeight):
            return self._stored(x, weight, bias, rows, counting, shared)
        if not (x.is_cuda and self.use_fast(rows, tuple(weight.shape), name)):
            if counting:
                self.counts["bf16"] += 1
            return F.linear(x, weight, bias)
        if counting:
            self.counts[self.kind] += 1
        if self.kind == "fp8":
            from ..kernels.fp8_linear import quantize_weight_fp8

            # Weights are quantized at use: streamed blocks arrive in reused slots, so a cache keyed by tensor would
            # go stale. The pass reads each weight once per call (estimated ≈ 0.4 ms per Pro block at H200
            # bandwidth, against ≈ 120 ms of compute; included in the fp8 block time recorded in
            # measurements/sessions/2026-11-29_kernels). A checkpoint from `k6fast quantize --format fp8` removes it.
            # With K6_FP8_OUTLIER_CHANNELS > 0 (the bf16 weight at hand), its rounding at this call's outlier channels
            # is corrected by extra GEMM columns (kernels/fp8_outliers.py).
            cols, xq = _fp8_input(x, self.outlier_channels, shared)
            wq, w_scale = quantize_weight_fp8(weight, residual_cols=cols)
            return _fp8(x, wq, w_scale, bias, xq)
        from ..kernels.fp16acc_linear import fp16acc_linear

        flat = x.reshape(-1, x.shape[-1]).contiguous()
        return fp16acc_linear(flat, weight, bias, out_dtype=x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    def _stored(
        self, x: Tensor, weight: QuantizedWeight, bias: Tensor | None, rows: int, counting: bool, shared: dict | None
    ) -> Tensor:
        fast = rows >= self.min_rows and _stored_gemm_runs(weight.fmt, x)
        if counting:
            self.counts[weight.fmt if fast else f"{weight.fmt}-dequantized"] += 1
        if not fast:
            return F.linear(x, weight.dequantized(x.dtype), bias)
        # A stored e4m3 weight has no bf16 columns to correct: plain row quantization.
        return _fp8(x, weight.qdata, weight.scale, bias, _fp8_input(x, 0, shared)[1])


def _fp8_input(x: Tensor, outlier_channels: int, shared: dict | None) -> tuple[Tensor | None, tuple[Tensor, Tensor]]:
    """(outlier columns or None, x's rows quantized to e4m3 with them): computed once per `shared` dict."""
    from ..kernels.fp8_linear import quantize_rows_fp8
    from ..kernels.fp8_outliers import outlier_columns

    key = ("fp8", outlier_channels)
    if shared is not None and key in shared:
        return shared[key]
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    cols = outlier_columns(flat, outlier_channels)
    prepared = cols, quantize_rows_fp8(flat, cols)
    if shared is not None:
        shared[key] = prepared
    return prepared


def _fp8(x: Tensor, wq: Tensor, w_scale: Tensor, bias: Tensor | None, xq: tuple[Tensor, Tensor]) -> Tensor:
    """x [..., K] through the row-wise fp8 GEMM with an e4m3 weight [N, K'] and its per-channel scale; xq: x
    quantized ([rows, K'] e4m3 and its row scales; K' > K with outlier columns)."""
    from ..kernels.fp8_linear import fp8_linear

    # Hopper's fast accumulation (fewer promotions of the wgmma accumulator to fp32): this layer, row quantization
    # included, runs at 1.64-1.73x cuBLAS bf16 instead of 1.58-1.64x at the W1 shapes, for 0.2-0.4 % relative L2
    # against the exact quantized product (measurements/sessions/2026-11-29_h200-followup/gemm.json), small beside
    # e4m3's own ~3.5 %. The arm is lossy anyway.
    out = fp8_linear(
        xq, wq, w_scale, bias=None if bias is None else bias.to(x.dtype), out_dtype=x.dtype, fast_accum=True
    )
    return out.reshape(*x.shape[:-1], wq.shape[0])
