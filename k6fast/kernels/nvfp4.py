"""NVFP4 weights for the K6 DiT's linear layers: 4-bit E2M1 values, an E4M3 scale per 16 elements, an FP32 scale.

Format (NVIDIA's NVFP4 recipe, the layout TensorRT-ModelOpt checkpoints use):
- `packed`: uint8 [N, K/2]. Two E2M1 codes per byte along K: element 2i in the low nibble, 2i+1 in the high one
  (the order Triton's `dot_scaled` documents: "first element in lower bits"). A code is s·eem: sign, 2 exponent bits
  (bias 1), 1 mantissa bit, so the 8 magnitudes are 0, 0.5, 1, 1.5, 2, 3, 4, 6.
- `block_scales`: float8_e4m3fn [N, K/16], one per 16 consecutive elements of a row.
- `global_scale`: float32 [] = amax(|w|) / (E4M3_MAX · 6), so that every block scale fits e4m3 (≤ E4M3_MAX,
  `formats.E4M3_MAX`).
- w[n, k] ≈ e2m1(packed)[n, k] · block_scales[n, k // 16] · global_scale, where
  block_scales = e4m3(block_amax / (6 · global_scale)) and the codes round w / (block scale · global scale) to the
  nearest E2M1 value (ties to even, saturating at ±6).
Round trip: 4.5 bits per element instead of 16, lossy accordingly (tests/test_nvfp4.py's NVFP4_REL_L2 bounds the
error on Gaussian weights).

What it holds:
- `quantize_nvfp4(w)` / `dequantize_nvfp4(...)`: vectorised PyTorch, any device (quantization runs once, offline,
  in `k6fast quantize`); `*_ref` beside them restate the format element by element (nearest-value search, bit
  formula) and must agree bit for bit.
- `nvfp4_linear(x, packed, block_scales, global_scale, bias)`: y = x @ w.t() (+ bias), bf16/fp16 activations. On CUDA
  sm_80+ a Triton GEMM that decodes the weight tile in its prologue (packed bytes + scales → E2M1 via bit ops, times
  the block scale, exact in bf16/fp16) and runs a bf16/fp16 `tl.dot` with fp32 accumulation; the global scale is
  applied once to the accumulator. It exists to cut the bytes a streamed block moves (0.28× of bf16), not for
  speed: the decode costs ALU time a plain bf16 GEMM does not spend, and it is not claimed faster than cuBLAS.
  `nvfp4_linear_ref` is the fp32 product of the dequantized weight.

Check: `pytest tests/test_nvfp4.py` (CPU + interpreter; `-m gpu` on a GPU machine).
Benchmark: `python measurements/bench_nvfp4.py --out nvfp4.json`.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl
from torch import Tensor

from .fallback import cuda_at_least, kernel_runs
from .formats import E4M3_MAX
from .tiles import INTERPRETER_TILE, launch_gemm, store_tile, wrapped_tile

logger = logging.getLogger(__name__)

E2M1_MAX = 6.0
BLOCK = 16  # elements per block scale
# An all-zero weight gets global scale AMAX_FLOOR / 2688 instead of 0, so nothing divides by zero.
AMAX_FLOOR = 1e-12
# Magnitudes of the 8 non-negative codes; codes 8..15 are their negatives.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Rounding thresholds between consecutive magnitudes, with the side a tie goes to: a tie rounds to the even code
# (mantissa bit 0), i.e. 0.25 → 0, 0.75 → 1, 1.25 → 1, 1.75 → 2, 2.5 → 2, 3.5 → 4, 5 → 4.
_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# Dispatch: which implementation runs where.
#
#   op                  CPU         CUDA sm_80 .. sm_12x                         older CUDA
#   quantize/dequantize PyTorch     PyTorch                                      PyTorch
#   nvfp4_linear        reference   Triton dequantize-in-prologue GEMM           reference (logged once)
#
# The DiT runtime does not call nvfp4_linear: it dequantizes each layer's weight on the GPU and runs cuBLAS bf16,
# many times faster than this kernel on an H200 (measurements/sessions/2026-11-29_attention-pipeline/README.md).
#
# Blackwell (sm_100, sm_120) has NVFP4 tensor cores, and the installed stack exposes them: torch 2.14's
# `F.scaled_mm` takes `float4_e2m1fn_x2` operands with `ScalingType.BlockWise1x16` e4m3 scales (swizzled 32x4x4),
# and Triton's `tl.dot_scaled` takes `e2m1` operands. Neither is wired here: the torch path needs the activations
# quantized to NVFP4 as well (a second, lossier product than this weight-only format), the scale swizzle and the
# global scale's placement could not be checked on any GPU this project had (H200 only), and `dot_scaled`'s
# documentation (Triton 3.8 here; the GPU machine runs 3.6) describes e8m0 scales over 32-element groups (MXFP4),
# not e4m3 over 16. Blackwell therefore runs the Triton dequantize-in-prologue GEMM like Hopper and Ampere do.
# ---------------------------------------------------------------------------------------------------------------


def _use_nvfp4_kernel(device: torch.device) -> bool:
    """True where the Triton NVFP4 GEMM runs: CUDA sm_80 or newer (bf16 MMA); elsewhere logs the fallback once."""
    return kernel_runs(
        logger, "nvfp4_linear", device, cuda_at_least(device, (8, 0)), "Triton bf16/fp16 MMA needs sm_80 or newer"
    )


# ---------------------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------------------


def _check_weight_shape(op: str, n: int, k: int) -> None:
    # K: a multiple of 32 keeps every Triton K tile (32, 64 or 128 elements) whole in bytes and in scale blocks;
    # N: a multiple of 16 as for the other tensor-core GEMMs.
    if k % 32 or n % 16:
        raise ValueError(f"{op}: NVFP4 needs K a multiple of 32 and N a multiple of 16, found K={k}, N={n}")


def _check_quantized(op: str, packed: Tensor, block_scales: Tensor, global_scale: Tensor) -> tuple[int, int]:
    """Returns (N, K) after checking the three tensors of one NVFP4 weight against each other."""
    if packed.dtype != torch.uint8 or packed.ndim != 2:
        raise ValueError(f"{op}: expected packed uint8 [N, K/2], found {packed.dtype} {tuple(packed.shape)}")
    n, k = packed.shape[0], 2 * packed.shape[1]
    _check_weight_shape(op, n, k)
    if block_scales.dtype != torch.float8_e4m3fn or block_scales.shape != (n, k // BLOCK):
        raise ValueError(
            f"{op}: expected block_scales float8_e4m3fn [{n}, {k // BLOCK}], "
            f"found {block_scales.dtype} {tuple(block_scales.shape)}"
        )
    if global_scale.dtype != torch.float32 or global_scale.numel() != 1:
        raise ValueError(
            f"{op}: expected a float32 global_scale with one element, "
            f"found {global_scale.dtype} {tuple(global_scale.shape)}"
        )
    if not packed.is_contiguous() or not block_scales.is_contiguous():
        raise ValueError(f"{op}: expected contiguous packed and block_scales (row-major [N, ...])")
    return n, k


# ---------------------------------------------------------------------------------------------------------------
# Quantization (offline) and dequantization
# ---------------------------------------------------------------------------------------------------------------


def _scales(wf: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """wf: fp32 [N, K] → (block_scales e4m3 [N, K/16], global_scale fp32 [], divisor fp32 [N, K/16, 1]).

    Shared by `quantize_nvfp4` and its reference: the scale recipe is the format's definition; what the reference
    checks independently is the rounding. Divisions are tensor / tensor: PyTorch on CUDA turns `t / E4M3_MAX` into a
    multiplication by a rounded reciprocal, which would make CPU and GPU quantization differ."""
    n, k = wf.shape
    amax = wf.abs().amax().clamp_min(AMAX_FLOOR)
    global_scale = amax / torch.tensor(E4M3_MAX * E2M1_MAX, device=wf.device)
    block_amax = wf.view(n, k // BLOCK, BLOCK).abs().amax(-1)
    six = torch.tensor(E2M1_MAX, device=wf.device)
    # ≤ E4M3_MAX by construction (block_amax ≤ amax); the clamp guards the last ulp of the two roundings.
    block_scales = (block_amax / (six * global_scale)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    divisor = (block_scales.float() * global_scale).unsqueeze(-1)
    return block_scales, global_scale, divisor


def _scaled_blocks(wf: Tensor, divisor: Tensor) -> Tensor:
    """w / (block scale · global scale) as fp32 [N, K/16, 16]; a block whose scale rounded to 0 becomes 0."""
    n, k = wf.shape
    blocks = wf.view(n, k // BLOCK, BLOCK)
    return torch.where(divisor > 0, blocks / torch.where(divisor > 0, divisor, 1.0), 0.0)


def _pack(codes: Tensor) -> Tensor:
    """codes: uint8 [N, K] in 0..15 → uint8 [N, K/2], element 2i in the low nibble."""
    pairs = codes.view(codes.shape[0], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_codes(packed: Tensor) -> Tensor:
    """uint8 [N, K/2] → codes uint8 [N, K] (inverse of `_pack`): the E2M1 codes a packed weight holds."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).view(packed.shape[0], -1)


def _check_source(op: str, w: Tensor) -> None:
    if w.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{op}: expected a bfloat16, float16 or float32 weight, found {w.dtype}")
    if w.ndim != 2:
        raise ValueError(f"{op}: expected a weight [N, K], found shape {tuple(w.shape)}")
    _check_weight_shape(op, *w.shape)


def quantize_nvfp4(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """w: [N, K] bf16/fp16/fp32 (nn.Linear layout; K a multiple of 32, N of 16) →
    (packed uint8 [N, K/2], block_scales float8_e4m3fn [N, K/16], global_scale float32 []).

    Vectorised on w's device; the same bits on CPU and CUDA (exact comparisons, IEEE divisions)."""
    _check_source("quantize_nvfp4", w)
    wf = w.float().contiguous()
    block_scales, global_scale, divisor = _scales(wf)
    scaled = _scaled_blocks(wf, divisor)
    mag = scaled.abs()
    codes = torch.zeros(mag.shape, dtype=torch.uint8, device=w.device)
    for threshold, tie_up in _THRESHOLDS:
        codes += (mag >= threshold) if tie_up else (mag > threshold)
    codes |= (scaled < 0).to(torch.uint8) << 3
    return _pack(codes.view(w.shape)), block_scales, global_scale


def quantize_nvfp4_ref(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The same as `quantize_nvfp4` by nearest-value search: the code whose magnitude is closest to |w| / scale,
    the even code on a tie (|w| past 6 saturates to 6)."""
    _check_source("quantize_nvfp4_ref", w)
    wf = w.float().contiguous()
    block_scales, global_scale, divisor = _scales(wf)
    scaled = _scaled_blocks(wf, divisor)
    values = torch.tensor(E2M1_VALUES, device=w.device)
    distance = (scaled.abs().unsqueeze(-1) - values).abs()  # [N, K/16, 16, 8]
    nearest = distance == distance.amin(-1, keepdim=True)
    # Of two equidistant codes the even one (smaller index on the even side): prefer even indices, then the lowest.
    rank = torch.arange(8, device=w.device) + 8 * (torch.arange(8, device=w.device) % 2)
    mag_code = torch.where(nearest, rank, 64).argmin(-1).to(torch.uint8)
    codes = mag_code | ((scaled < 0).to(torch.uint8) << 3)
    return _pack(codes.view(w.shape)), block_scales, global_scale


DEQUANT_CHUNK = 1 << 22  # weight elements dequantized per step (≈ 55 MB of temporaries)


def dequantize_nvfp4(
    packed: Tensor, block_scales: Tensor, global_scale: Tensor, dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """(packed uint8 [N, K/2], block_scales e4m3 [N, K/16], global_scale fp32 []) → w [N, K] of `dtype`.

    Computed in fp32 (code value · block scale · global scale), rounded once to `dtype`. The runtime calls this for
    every layer of an nvfp4 checkpoint, so the fp32 intermediates (≈ 13 bytes per element) are made for
    `DEQUANT_CHUNK` elements at a time, not for a whole 16,384 x 4,096 weight (0.9 GB)."""
    n, k = _check_quantized("dequantize_nvfp4", packed, block_scales, global_scale)
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=packed.device)
    scale = block_scales.float() * global_scale.reshape(()).float()
    out = torch.empty((n, k), dtype=dtype, device=packed.device)
    rows = max(1, DEQUANT_CHUNK // max(k, 1))
    for i in range(0, n, rows):
        codes = unpack_codes(packed[i : i + rows]).flatten().int()
        values = torch.index_select(lut, 0, codes).view(-1, k // BLOCK, BLOCK)
        out[i : i + rows] = (values * scale[i : i + rows].unsqueeze(-1)).view(-1, k)
    return out


def dequantize_nvfp4_ref(
    packed: Tensor, block_scales: Tensor, global_scale: Tensor, dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """`dequantize_nvfp4` from the E2M1 bit formula: (-1)^s · (e == 0 ? m/2 : (1 + m/2) · 2^(e-1))."""
    n, k = _check_quantized("dequantize_nvfp4_ref", packed, block_scales, global_scale)
    codes = unpack_codes(packed).int()
    sign, exponent, mantissa = codes >> 3, (codes >> 1) & 3, codes & 1
    magnitude = torch.where(exponent == 0, mantissa * 0.5, (1.0 + mantissa * 0.5) * torch.exp2((exponent - 1).float()))
    values = torch.where(sign == 1, -magnitude, magnitude)
    scale = block_scales.float().repeat_interleave(BLOCK, dim=1) * global_scale.reshape(()).float()
    return (values * scale).to(dtype)


# ---------------------------------------------------------------------------------------------------------------
# NVFP4 linear: bf16/fp16 activations × NVFP4 weights
# ---------------------------------------------------------------------------------------------------------------


def nvfp4_linear_ref(
    x: Tensor, packed: Tensor, block_scales: Tensor, global_scale: Tensor, bias: Tensor | None = None
) -> Tensor:
    """fp32 product of x and the dequantized weight: x [..., K], bias [N] or None → [..., N] in x.dtype.
    fp32 matmuls follow PyTorch's TF32 setting (off by default)."""
    w = dequantize_nvfp4(packed, block_scales, global_scale, torch.float32)
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@triton.jit
def e2m1_to_f32(code):
    """int32 codes 0..15 → fp32 values. Magnitude m = code & 7 builds fp32 bits directly: m ≥ 2 is the normal
    number (1 + (m & 1)/2) · 2^((m >> 1) - 1), whose bits are (m << 22) + bits(0.5); m = 1 is 0.5, m = 0 is 0."""
    mag = code & 7
    bits = tl.where(mag >= 2, (mag << 22) + 0x3F000000, mag * 0x3F000000)
    value = bits.to(tl.float32, bitcast=True)
    return tl.where((code & 8) != 0, -value, value)


@triton.jit
def e4m3_to_f32(byte):
    """int32 e4m3 bit patterns 0..255 → fp32 (NaN patterns never occur in a block scale). Decoded with bit ops rather
    than an fp8 conversion: Triton lowers fp8e4nv casts natively only from sm_89, and the interpreter's fp8 handling
    is not exact. Normal: exponent bias 7 → 127, i.e. bits << 20 plus 120 << 23; subnormal: m · 2^-9."""
    mag = byte & 0x7F
    normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    subnormal = (mag & 7).to(tl.float32) * 0.001953125
    value = tl.where(mag >= 8, normal, subnormal)
    return tl.where((byte & 0x80) != 0, -value, value)


@triton.jit
def _nvfp4_linear_kernel(
    x_ptr,  # [M, K] bf16/fp16, row stride stride_xm, unit column stride
    q_ptr,  # [N, K/2] uint8, contiguous
    s_ptr,  # [N, K/16] uint8 (e4m3 bit patterns), contiguous
    g_ptr,  # [1] fp32 global scale
    bias_ptr,  # [N] any float dtype, or a dummy when HAS_BIAS is False
    y_ptr,  # [M, N] x's dtype, row stride stride_ym
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_FP32: tl.constexpr,  # fp32 operands (the interpreter, where bf16 dots are wrong); else x's dtype
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of 32
    GROUP_M: tl.constexpr,
):
    offs_m, offs_n, rm, rn = wrapped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    # The weight tile is addressed per element as [BLOCK_N, BLOCK_K]: element (n, k) sits in byte n·K/2 + k/2 (nibble
    # k % 2) and its scale in n·K/16 + k/16. Lanes that share a byte or a scale load the same address, which the
    # memory system serves once, and no shuffle is needed to interleave the two nibbles. K is the minor axis so that
    # neighbouring lanes read neighbouring bytes of one row (coalesced); the dot takes the tile transposed.
    q_ptrs = q_ptr + rn[:, None].to(tl.int64) * (K // 2) + (offs_k // 2)[None, :]
    s_ptrs = s_ptr + rn[:, None].to(tl.int64) * (K // 16) + (offs_k // 16)[None, :]
    nibble_shift = ((offs_k % 2) * 4)[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_ptrs)
            q = tl.load(q_ptrs)
            s = tl.load(s_ptrs)
        else:
            k_ok = offs_k < K - k * BLOCK_K
            a = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            q = tl.load(q_ptrs, mask=k_ok[None, :], other=0)
            s = tl.load(s_ptrs, mask=k_ok[None, :], other=0)
        codes = (q.to(tl.int32) >> nibble_shift) & 0xF
        # value · block scale has at most 2 + 4 significant bits and lies in [2^-10, 2688]: exact in bf16 and fp16,
        # so the only roundings are the dot's fp32 accumulation and the output cast.
        w = e2m1_to_f32(codes) * e4m3_to_f32(s.to(tl.int32))
        if DOT_FP32:
            acc += tl.dot(a.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w.to(a.dtype)))
        x_ptrs += BLOCK_K
        q_ptrs += BLOCK_K // 2
        s_ptrs += BLOCK_K // 16

    acc = acc * tl.load(g_ptr)
    store_tile(y_ptr, acc, bias_ptr, offs_m, offs_n, M, N, stride_ym, HAS_BIAS)


# Starting points for sm_80/sm_90: the decode runs on the tile's [BLOCK_K, BLOCK_N]
# weight elements once per M tile, so wide M tiles amortise it; configs that do not fit shared memory are skipped.
_NVFP4_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
]


def even_k(args: dict) -> bool:
    """triton.heuristics: the value of EVEN_K itself (not a dict) from the call's arguments and the config."""
    return args["K"] % args["BLOCK_K"] == 0


_nvfp4_linear_tuned = triton.autotune(configs=_NVFP4_CONFIGS, key=["M", "N", "K", "HAS_BIAS", "DOT_FP32"])(
    triton.heuristics({"EVEN_K": even_k})(_nvfp4_linear_kernel)
)
_INTERPRETER_TILE = {**INTERPRETER_TILE, "BLOCK_K": 64}  # the K tile is autotuned here too


def nvfp4_linear_triton(
    x: Tensor,
    packed: Tensor,
    block_scales: Tensor,
    global_scale: Tensor,
    bias: Tensor | None = None,
    *,
    dot_fp32: bool = False,
) -> Tensor:
    """The Triton kernel alone, on whatever device x is on (CUDA, or CPU under TRITON_INTERPRET=1). Shapes and
    dtypes as `nvfp4_linear`; `dot_fp32` multiplies fp32 operands (exact under the interpreter, slow on a GPU)."""
    k = x.shape[-1]
    n = packed.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    args = (
        x2, packed, block_scales.view(torch.uint8), global_scale.reshape(1), bias if bias is not None else y, y,
        m, n, k, x2.stride(0), y.stride(0),
    )  # fmt: skip
    flags = {"HAS_BIAS": bias is not None, "DOT_FP32": dot_fp32}
    # The autotuned kernel's heuristic sets EVEN_K for the K tile it picks; the interpreter's tile is fixed.
    tile = {**_INTERPRETER_TILE, "EVEN_K": k % _INTERPRETER_TILE["BLOCK_K"] == 0}
    launch_gemm(_nvfp4_linear_kernel, _nvfp4_linear_tuned, m, n, x.device, args, flags, tile)
    return y.reshape(*x.shape[:-1], n)


@torch.library.custom_op("k6fast::nvfp4_linear", mutates_args=())
def _nvfp4_linear_op(
    x: Tensor, packed: Tensor, block_scales: Tensor, global_scale: Tensor, bias: Tensor | None
) -> Tensor:
    """x [M, K] bf16/fp16 row-major, packed [N, K/2] uint8, block_scales [N, K/16] e4m3, global_scale [] fp32."""
    if _use_nvfp4_kernel(x.device):
        return nvfp4_linear_triton(x, packed, block_scales, global_scale, bias)
    return nvfp4_linear_ref(x, packed, block_scales, global_scale, bias)


@_nvfp4_linear_op.register_fake
def _(x: Tensor, packed: Tensor, block_scales: Tensor, global_scale: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty((x.shape[0], packed.shape[0]))


def nvfp4_linear(
    x: Tensor, packed: Tensor, block_scales: Tensor, global_scale: Tensor, bias: Tensor | None = None
) -> Tensor:
    """y = x @ w.t() (+ bias) with w stored as NVFP4 (see the module docstring). Lossy through the weight only:
    activations stay bf16/fp16.

    x: [..., K] bf16/fp16 with rows contiguous; packed: uint8 [N, K/2]; block_scales: float8_e4m3fn [N, K/16];
    global_scale: float32 [] (one element); bias: [N] float or None. K a multiple of 32, N of 16.
    Returns [..., N] in x.dtype. Triton on CUDA sm_80+ (Blackwell included, see the dispatch table); the fp32
    reference elsewhere (logged once)."""
    n, k = _check_quantized("nvfp4_linear", packed, block_scales, global_scale)
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"nvfp4_linear: expected bf16/fp16 activations, found {x.dtype}")
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(
            f"nvfp4_linear: expected x [..., {k}] to match the weight [N={n}, K={k}], found {tuple(x.shape)}"
        )
    if not x.is_contiguous():
        raise ValueError(f"nvfp4_linear: expected a contiguous x, found shape {tuple(x.shape)} stride {x.stride()}")
    if bias is not None and (bias.shape != (n,) or bias.dtype not in _FLOAT_DTYPES):
        raise ValueError(f"nvfp4_linear: expected a float bias ({n},), found {bias.dtype} {tuple(bias.shape)}")
    devices = {t.device for t in (x, packed, block_scales, global_scale, bias) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"nvfp4_linear: expected all operands on one device, found {sorted(map(str, devices))}")
    y = _nvfp4_linear_op(x.reshape(-1, k), packed, block_scales, global_scale.reshape(()), bias)
    return y.reshape(*x.shape[:-1], n)
