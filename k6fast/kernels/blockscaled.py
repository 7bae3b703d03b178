"""Block-scaled MXFP8 and NVFP4 linear layers through `torch._scaled_mm`'s cuBLASLt path on Blackwell (sm_100, sm_120).

Formats (both operands quantized, blocks run along K):
- MXFP8 (OCP Microscaling v1.0): e4m3 elements and one e8m0 scale per 32 consecutive elements. An e8m0 scale is a
  power of two stored as its biased exponent byte b (scale = 2^(b - 127)); the recipe is cuBLAS's "RCEIL",
  b = 127 + ceil(log2(amax / E4M3_MAX)) (`formats.E4M3_MAX`), so no element saturates. Scales are kept as uint8
  bytes here (and in checkpoints).
- NVFP4: e2m1 elements packed two a byte (element 2i in the low nibble), one e4m3 scale per 16 elements and one fp32
  tensor scale amax / (E4M3_MAX · E2M1_MAX) (`nvfp4.E2M1_MAX`); the same format as nvfp4.py and
  `k6fast quantize --format nvfp4` checkpoints. Activations are quantized with a tensor scale of their own (dynamic,
  per call).

The quantization is torchao's (`torchao.prototype.mx_formats`: `to_mx` with `ScaleCalculationMode.RCEIL` for MXFP8,
`nvfp4_quantize` with a dynamic per-tensor scale for NVFP4 activations), and so is the swizzled scale layout that
cuBLAS's block-scaled GEMMs read (`to_blocked`: each 128-row x 4-column tile of scales stored as 32 x 16, rows
padded to 128 and columns to 4). torchao is an optional dependency (`pip install 'k6fast[blockscaled]'`; the dev extra
has it); the weights of an nvfp4 checkpoint come from nvfp4.py, whose recipe equals torchao's two-level one
(tests/test_blockscaled.py compares the two).

The GEMM is the call torchao 0.18 makes for these formats (torch >= 2.11): `torch._scaled_mm(xq, wq.t(), x_scales,
w_scales)` with swizzled e8m0 scales (MXFP8) or swizzled e4m3 scales on `float4_e2m1fn_x2` operands (NVFP4, the two
tensor scales multiplied into the output afterwards, as torchao does). Hopper (sm_90) has no block-scaled MMA, so the
GEMM itself needs an sm_100/sm_120 machine (`pytest -m gpu tests/test_blockscaled.py`); the CPU tests check the packed
tensors and scales against an independent fp32 emulation, the swizzle against cuBLAS's documented layout, and
`blockscaled_linear_ref` (what every other device runs) against the exact product.

Dispatch (`blockscaled_linear`):
  CUDA sm_100 / sm_103 / sm_12x   torch._scaled_mm block-scaled (cuBLASLt)
  anything else                   blockscaled_linear_ref: the fp32 product of the dequantized operands (logged once)

Accuracy on DiT-like inputs (x ~ N(0, 1) with K/512 channels x30, w ~ N(0, 0.02²); CPU, `blockscaled_linear_ref`):
block scales do not lower e4m3's relative rounding (3 mantissa bits whatever the scale), so an MXFP8 layer errs
about as a row-scaled FP8 one does, and e2m1's one mantissa bit makes NVFP4 several times lossier. Outlier columns
(`activations_with_outliers` / `weight_with_outliers`: 2C extra K columns, 64 more at K = 4096 for C = 32, that put
back both operands' rounding at the activations' C largest channels; they need the unquantized weight, so bf16
checkpoints only) lower both. tests/test_blockscaled.py holds the layer's relative L2 to its bounds with and without
them (LAYER_BOUND, OUTLIER_BOUND).

Benchmark: `python measurements/bench_gemm.py --out gemm.json` (rows `mxfp8`, `nvfp4` on sm_100/sm_120 only).
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from .fallback import kernel_runs
from .nvfp4 import E2M1_VALUES, quantize_nvfp4

logger = logging.getLogger(__name__)

FORMATS = ("mxfp8", "nvfp4")
MX_BLOCK = 32  # elements per e8m0 scale
NV_BLOCK = 16  # elements per e4m3 scale
E8M0_BIAS = 127
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def blockscaled_native(device: torch.device) -> bool:
    """True where block-scaled tensor cores exist: CUDA sm_100/sm_103 (datacenter Blackwell) and sm_12x (GeForce and
    workstation Blackwell, e.g. RTX 5090). Hopper (sm_90) and Ada (sm_89) have none."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] in (10, 12)


def _use_scaled_mm(device: torch.device) -> bool:
    return kernel_runs(
        logger, "blockscaled_linear", device, blockscaled_native(device),
        "no block-scaled tensor cores (needs sm_100 or sm_120)", elsewhere="no block-scaled GEMM here",
    )  # fmt: skip


def _mx_formats():
    """torchao's MX/NVFP4 module, or an ImportError that says how to get it."""
    try:
        from torchao.prototype.mx_formats import mx_tensor, nvfp4_tensor, utils
    except ImportError as exc:
        raise ImportError(
            "block-scaled MXFP8/NVFP4 quantization needs torchao (pip install 'k6fast[blockscaled]'): " + str(exc)
        ) from exc
    return mx_tensor, nvfp4_tensor, utils


# ---------------------------------------------------------------------------------------------------------------
# Quantization (torchao) and scale layout
# ---------------------------------------------------------------------------------------------------------------


def _check_source(op: str, x: Tensor, block: int) -> None:
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{op}: expected a bfloat16, float16 or float32 tensor, found {x.dtype}")
    if x.ndim < 1 or x.shape[-1] % 32:
        raise ValueError(f"{op}: expected [..., K] with K a multiple of 32, found shape {tuple(x.shape)}")


def quantize_mxfp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x: [..., K] bf16/fp16/fp32, K a multiple of 32 → (xq [..., K] float8_e4m3fn, scale [..., K/32] uint8 e8m0 bytes)
    with x ≈ xq · 2^(scale - 127) per 32-element block (torchao `to_mx`, RCEIL scales)."""
    _check_source("quantize_mxfp8", x, MX_BLOCK)
    mx_tensor, _, _ = _mx_formats()
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    src = x if x.dtype != torch.float16 else x.float()  # to_mx takes bf16 or fp32
    scale, xq = mx_tensor.to_mx(src.contiguous(), torch.float8_e4m3fn, MX_BLOCK, ScaleCalculationMode.RCEIL)
    return xq, scale.view(torch.uint8).reshape(*x.shape[:-1], x.shape[-1] // MX_BLOCK)


def quantize_nvfp4_activations(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x: [M, K] bf16/fp16/fp32 → (packed uint8 [M, K/2], scales float8_e4m3fn [M, K/16], tensor scale fp32 []).

    torchao's two-level NVFP4 quantization with a per-call tensor scale amax(|x|) / (E4M3_MAX · E2M1_MAX)."""
    _check_source("quantize_nvfp4_activations", x, NV_BLOCK)
    _, nvfp4_tensor, _ = _mx_formats()
    x2 = x.reshape(-1, x.shape[-1])
    src = x2 if x2.dtype != torch.float16 else x2.float()
    tensor_scale = nvfp4_tensor.per_tensor_amax_to_scale(src.abs().amax().float().clamp_min(1e-12))
    scales, packed = nvfp4_tensor.nvfp4_quantize(src.contiguous(), NV_BLOCK, tensor_scale)
    return packed, scales.reshape(x2.shape[0], -1), tensor_scale.reshape(())


def quantize_weight(w: Tensor, fmt: str) -> tuple[Tensor, Tensor, Tensor | None]:
    """w: [N, K] (nn.Linear layout) → (qdata, scale, scale_2) as a `fmt` checkpoint stores them: mxfp8 (e4m3 [N, K],
    uint8 [N, K/32], None); nvfp4 (uint8 [N, K/2], e4m3 [N, K/16], fp32 []) from nvfp4.py."""
    if w.ndim != 2:
        raise ValueError(f"quantize_weight: expected a weight [N, K], found shape {tuple(w.shape)}")
    if fmt == "mxfp8":
        return (*quantize_mxfp8(w), None)
    if fmt == "nvfp4":
        return quantize_nvfp4(w)
    raise ValueError(f"quantize_weight: expected a format in {FORMATS}, found {fmt!r}")


def swizzle_scales(scale: Tensor) -> Tensor:
    """scale: [R, C] (one row per operand row, one column per K block; any 1-byte dtype) → the flat layout cuBLAS's
    block-scaled GEMMs read (torchao `to_blocked`): R padded to 128 and C to 4 with zeros, each 128 x 4 tile stored as
    32 x 16 (row r of a tile at 16·(r % 32) + 4·(r // 32)). Returns [ceil(R/128)·128 · ceil(C/4)·4] of scale's dtype."""
    if scale.ndim != 2:
        raise ValueError(f"swizzle_scales: expected a 2-D scale [rows, K blocks], found shape {tuple(scale.shape)}")
    _, _, utils = _mx_formats()
    return utils.to_blocked(scale.view(torch.uint8)).view(scale.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Dequantization (the reference path and QuantizedWeight)
# ---------------------------------------------------------------------------------------------------------------


def dequantize_mxfp8(qdata: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """(qdata e4m3 [..., K], scale uint8 [..., K/32]) → [..., K] of `dtype`: qdata · 2^(scale - 127), in fp32."""
    k = qdata.shape[-1]
    if scale.shape != (*qdata.shape[:-1], k // MX_BLOCK) or scale.dtype != torch.uint8:
        raise ValueError(
            f"dequantize_mxfp8: expected uint8 scales {(*qdata.shape[:-1], k // MX_BLOCK)}, found {scale.dtype} "
            f"{tuple(scale.shape)}"
        )
    factor = torch.exp2(scale.float() - E8M0_BIAS).repeat_interleave(MX_BLOCK, dim=-1)
    return (qdata.float() * factor).to(dtype)


def dequantize_nvfp4_rows(packed: Tensor, scale: Tensor, scale_2: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """(packed uint8 [R, K/2], scale e4m3 [R, K/16], scale_2 fp32 []) → [R, K] of `dtype`, any R (activations too)."""
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=packed.device)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1).long()
    factor = scale.float().repeat_interleave(NV_BLOCK, dim=-1) * scale_2.float().reshape(())
    return (lut[codes] * factor).to(dtype)


# ---------------------------------------------------------------------------------------------------------------
# The GEMM
# ---------------------------------------------------------------------------------------------------------------

Operand = tuple[Tensor, Tensor, Tensor | None]  # (qdata, scale, scale_2) of one quantized operand


def dequantize(fmt: str, op: Operand) -> Tensor:
    """The values a quantized operand (qdata, scale, scale_2) of format `fmt` holds, fp32 [rows, K]: what
    `blockscaled_linear_ref` multiplies."""
    qdata, scale, scale_2 = op
    if fmt == "mxfp8":
        return dequantize_mxfp8(qdata, scale)
    return dequantize_nvfp4_rows(qdata, scale, scale_2)


def blockscaled_linear_ref(
    fmt: str, x: Operand, w: Operand, bias: Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """The exact product of the quantized operands in fp32: x = (qdata, scale, scale_2) [M, ...], w likewise [N, ...]
    (see `blockscaled_linear`) → [M, N] out_dtype. fp32 matmuls follow PyTorch's TF32 setting (off by default)."""
    y = dequantize(fmt, x) @ dequantize(fmt, w).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


@torch.library.custom_op("k6fast::blockscaled_mm", mutates_args=())
def _blockscaled_mm_op(
    fmt: str,
    xq: Tensor,
    x_scale: Tensor,
    x_scale_2: Tensor | None,
    wq: Tensor,
    w_scale: Tensor,
    w_scale_2: Tensor | None,
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    if not _use_scaled_mm(xq.device):
        return blockscaled_linear_ref(fmt, (xq, x_scale, x_scale_2), (wq, w_scale, w_scale_2), bias, out_dtype)
    # wq.t() is [K, N] column-major, the layout cuBLASLt's narrow-precision GEMMs take for the second operand.
    a_scale, b_scale = swizzle_scales(x_scale), swizzle_scales(w_scale)
    if fmt == "mxfp8":
        return torch._scaled_mm(
            xq,
            wq.t(),
            a_scale.view(torch.float8_e8m0fnu),
            b_scale.view(torch.float8_e8m0fnu),
            bias=bias,
            out_dtype=out_dtype,
        )
    y = torch._scaled_mm(
        xq.view(torch.float4_e2m1fn_x2),
        wq.view(torch.float4_e2m1fn_x2).t(),
        a_scale.view(torch.float8_e4m3fn),
        b_scale.view(torch.float8_e4m3fn),
        out_dtype=out_dtype,
    )
    # The two tensor scales, then the bias (cuBLAS would add the bias before the scales), as torchao does.
    y = y * (x_scale_2 * w_scale_2).to(out_dtype)
    return y if bias is None else y + bias.to(out_dtype)


@_blockscaled_mm_op.register_fake
def _(fmt, xq, x_scale, x_scale_2, wq, w_scale, w_scale_2, bias, out_dtype) -> Tensor:
    return xq.new_empty((xq.shape[0], wq.shape[0]), dtype=out_dtype)


def _check_operands(fmt: str, x: Operand, w: Operand, bias: Tensor | None, out_dtype: torch.dtype) -> tuple[int, int]:
    """Returns (N, K) after checking both operands of `fmt` against each other."""
    if fmt not in FORMATS:
        raise ValueError(f"blockscaled_linear: expected a format in {FORMATS}, found {fmt!r}")
    per_byte, block = (1, MX_BLOCK) if fmt == "mxfp8" else (2, NV_BLOCK)
    data_dtype = torch.float8_e4m3fn if fmt == "mxfp8" else torch.uint8
    scale_dtype = torch.uint8 if fmt == "mxfp8" else torch.float8_e4m3fn
    n, k = w[0].shape[0], w[0].shape[-1] * per_byte
    for name, (qdata, scale, scale_2), rows in (("x", x, x[0].shape[0]), ("w", w, n)):
        shape_ok = qdata.ndim == 2 and qdata.shape[1] * per_byte == k and scale.shape == (rows, k // block)
        two_level = fmt == "nvfp4"
        if qdata.dtype != data_dtype or scale.dtype != scale_dtype or not shape_ok or (scale_2 is None) == two_level:
            given = "None" if scale_2 is None else "a tensor"
            raise ValueError(
                f"blockscaled_linear {fmt}: expected {name} as ({data_dtype} [{rows}, {k // per_byte}], {scale_dtype} "
                f"[{rows}, {k // block}]{', fp32 []' if two_level else ', None'}), found ({qdata.dtype} "
                f"{tuple(qdata.shape)}, {scale.dtype} {tuple(scale.shape)}, {given})"
            )
    if k % 32 or n % 16:
        raise ValueError(f"blockscaled_linear: expected K a multiple of 32 and N of 16, found K={k}, N={n}")
    if bias is not None and (bias.shape != (n,) or bias.dtype not in _FLOAT_DTYPES):
        raise ValueError(f"blockscaled_linear: expected a float bias ({n},), found {bias.dtype} {tuple(bias.shape)}")
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"blockscaled_linear: expected out_dtype bfloat16 or float16, found {out_dtype}")
    return n, k


def quantize_activations(x: Tensor, fmt: str) -> Operand:
    """x: [M, K] → (qdata, scale, scale_2) in `fmt` (MXFP8 per 32, NVFP4 per 16 with a per-call tensor scale)."""
    if fmt == "mxfp8":
        return (*quantize_mxfp8(x), None)
    if fmt == "nvfp4":
        return quantize_nvfp4_activations(x)
    raise ValueError(f"quantize_activations: expected a format in {FORMATS}, found {fmt!r}")


# ---------------------------------------------------------------------------------------------------------------
# Outlier columns: the rounding at the activations' largest channels, corrected by 2C extra K columns
# ---------------------------------------------------------------------------------------------------------------


def _columns(fmt: str, op: Operand, cols: Tensor) -> Tensor:
    """The dequantized values of operand `op` at input channels `cols` (int [C], -1: a zero column) → fp32 [R, C],
    read from the packed data alone (no full dequantization)."""
    qdata, scale, scale_2 = op
    c = cols.clamp_min(0).long()
    if fmt == "mxfp8":
        values = qdata[:, c].float() * torch.exp2(scale[:, c // MX_BLOCK].float() - E8M0_BIAS)
    else:
        lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=qdata.device)
        codes = (qdata[:, c // 2] >> (4 * (c % 2)).to(torch.uint8)) & 0xF
        values = lut[codes.long()] * scale[:, c // NV_BLOCK].float() * scale_2.float()
    return torch.where(cols >= 0, values, 0.0)


def _picked(t: Tensor, cols: Tensor) -> Tensor:
    return torch.where(cols >= 0, t[:, cols.clamp_min(0).long()].float(), 0.0)


def quantize_part(t: Tensor, fmt: str, scale_2: Tensor | None) -> Operand:
    """Extra columns quantized in blocks of their own, with the operand's tensor scale (NVFP4)."""
    if fmt == "mxfp8":
        return (*quantize_mxfp8(t), None)
    _, nvfp4_tensor, _ = _mx_formats()
    scales, packed = nvfp4_tensor.nvfp4_quantize(t.contiguous(), NV_BLOCK, scale_2)
    return packed, scales, scale_2


def _appended(op: Operand, part: Operand) -> Operand:
    # Blocks never straddle the seam (K and 2C are multiples of the block), so this is the quantization of the
    # concatenated tensor.
    return torch.cat([op[0], part[0]], dim=1), torch.cat([op[1], part[1]], dim=1), op[2]


def _check_cols(cols: Tensor) -> None:
    if cols.ndim != 1 or cols.numel() not in (16, 32, 64) or cols.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"outlier columns: expected int [16, 32 or 64], found {cols.dtype} {tuple(cols.shape)}")


def activations_with_outliers(x: Tensor, fmt: str, cols: Tensor) -> Operand:
    """x [M, K] quantized with 2C appended columns: [x, x[:, cols], r] with r what the format's rounding left of x at
    those channels (cols: int [C], C in 16/32/64, -1 for none; `fp8_outliers.outlier_columns(x, C)[:C]`). Pairs with
    `weight_with_outliers`: the product gains w's rounding at `cols` (x · r_w) and x's (r_x · w) back."""
    _check_cols(cols)
    xq = quantize_activations(x, fmt)
    picked = _picked(x, cols)
    return _appended(xq, quantize_part(torch.cat([picked, picked - _columns(fmt, xq, cols)], dim=1), fmt, xq[2]))


def weight_with_outliers(w: Tensor, fmt: str, cols: Tensor) -> Operand:
    """w [N, K] (bf16/fp32, the unquantized weight) quantized with the 2C columns matching
    `activations_with_outliers`: [w, r_w at cols, w[:, cols]]."""
    _check_cols(cols)
    wq = quantize_weight(w, fmt)
    picked = _picked(w, cols)
    return _appended(wq, quantize_part(torch.cat([picked - _columns(fmt, wq, cols), picked], dim=1), fmt, wq[2]))


def blockscaled_linear(
    fmt: str,
    x: Tensor | Operand,
    w: Operand,
    bias: Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """y = x @ w.t() (+ bias) with both operands block-scaled in `fmt` ("mxfp8" or "nvfp4"). Lossy (module docstring).

    x: [..., K] bf16/fp16/fp32 activations, quantized here (`quantize_activations`), or an already quantized
    (qdata, scale, scale_2) of [M, ...]; w: (qdata, scale, scale_2) of the weight [N, K] from `quantize_weight` or a
    checkpoint (mxfp8: e4m3 [N, K], uint8 [N, K/32], None; nvfp4: uint8 [N, K/2], e4m3 [N, K/16], fp32 []);
    bias: [N] float or None. K a multiple of 32, N of 16. Returns [..., N] out_dtype (bf16 or fp16).
    torch._scaled_mm on sm_100/sm_12x, the fp32 reference elsewhere (logged once)."""
    lead = None
    if isinstance(x, Tensor):
        lead = x.shape[:-1]
        x = quantize_activations(x.reshape(-1, x.shape[-1]), fmt)
    n, _ = _check_operands(fmt, x, w, bias, out_dtype)
    devices = {t.device for t in (*x, *w, bias) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"blockscaled_linear: expected all operands on one device, found {sorted(map(str, devices))}")
    y = _blockscaled_mm_op(fmt, *x, *w, bias, out_dtype)
    return y if lead is None else y.reshape(*lead, n)
