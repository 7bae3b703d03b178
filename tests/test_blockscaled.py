"""k6fast/kernels/blockscaled.py: MXFP8 / NVFP4 operands (torchao's quantization) and the block-scaled linear.

On the CPU: the packed tensors and scales against an independent fp32 emulation of each format written here from the
format's definition, the swizzled scale layout against the index formula of cuBLAS's documentation, the product
against the emulated one and against the exact product on DiT-like inputs, odd shapes and bad input. The GEMM call
itself (`torch._scaled_mm` on sm_100/sm_120) is the `gpu` test at the end; it has not run on such a GPU here.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_testing import dit_like_gemm as dit_like  # fp32 on the CPU

from k6fast.kernels import blockscaled as bs
from k6fast.kernels.fallback import log_reference_once
from k6fast.kernels.formats import E4M3_MAX
from k6fast.testing.bounds import rel_l2


@pytest.fixture(autouse=True)
def _torchao():
    pytest.importorskip("torchao")  # the quantization is torchao's (the dev extra installs it)


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# Layer-output error bounds on DiT-like inputs (rel. L2 vs the exact fp32 product, K = 4096 / 16384). Plain: measured
# 3.7 % and 12.9 % (block scales cannot lower e4m3's or e2m1's relative rounding, see the module docstring); with 32
# outlier columns (what K6_GEMM=mxfp8|nvfp4 runs on bf16 weights): 2.2 % and 10.0 %, within the 3 % / 12 % asked.
LAYER_BOUND = {"mxfp8": 0.039, "nvfp4": 0.135}
OUTLIER_BOUND = {"mxfp8": 0.03, "nvfp4": 0.12}


# ---------------------------------------------------------------------------------------------------------------
# Independent emulations of the two formats (from their definitions, not from torchao's code)
# ---------------------------------------------------------------------------------------------------------------


def emulate_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] → (elements as fp32 [R, K], biased e8m0 exponents int [R, K/32]): the block's scale is the smallest
    power of two 2^e with amax / 2^e <= E4M3_MAX (cuBLAS's RCEIL), found from the exact binary exponent (frexp)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    descale = blocks.abs().amax(-1) / E4M3_MAX
    mantissa, exponent = torch.frexp(descale)  # descale = m · 2^E, m in [0.5, 1): ceil(log2) = E - (m == 0.5)
    e = torch.where(descale > 0, exponent - (mantissa == 0.5).int(), torch.full_like(exponent, -127)).clamp(-127, 127)
    scaled = blocks * torch.exp2(-e.float()).unsqueeze(-1)
    elements = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * torch.exp2(e.float()).unsqueeze(-1)
    return elements.reshape(x.shape), e + 127


def nearest_e2m1(v: torch.Tensor) -> torch.Tensor:
    """fp32 → the nearest E2M1 value (ties to the even code), saturating at ±6."""
    distance = (v.abs().unsqueeze(-1) - E2M1).abs()
    best = distance.amin(-1, keepdim=True)
    even_first = torch.tensor([0, 8, 1, 9, 2, 10, 3, 11])  # rank: even codes win ties
    code = torch.where(distance == best, even_first, 99).argmin(-1)
    return torch.sign(v) * E2M1[code]


def emulate_nvfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """x [R, K] → (dequantized elements fp32 [R, K], e4m3 block scales as fp32 [R, K/16], tensor scale)."""
    tensor_scale = x.abs().max().item() / (E4M3_MAX * 6.0)
    blocks = x.float().reshape(x.shape[0], -1, 16)
    block_scale = (blocks.abs().amax(-1) / 6.0 / tensor_scale).clamp(2.0**-6, E4M3_MAX).to(torch.float8_e4m3fn).float()
    divisor = (block_scale * tensor_scale).unsqueeze(-1)
    elements = nearest_e2m1(blocks / divisor) * divisor
    return elements.reshape(x.shape), block_scale, tensor_scale


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    lut = torch.cat([E2M1, -E2M1])
    return lut[torch.stack((packed & 0xF, packed >> 4), -1).reshape(packed.shape[0], -1).long()]


# ---------------------------------------------------------------------------------------------------------------
# The packed tensors and scales
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 32), (37, 96), (5, 4096), (64, 16384)])
def test_mxfp8_operands_equal_the_emulation(shape):
    x, _, _ = dit_like(*shape, n=16)
    xq, scale = bs.quantize_mxfp8(x)
    elements, biased = emulate_mxfp8(x)
    assert xq.dtype == torch.float8_e4m3fn and xq.shape == x.shape
    assert scale.dtype == torch.uint8 and scale.shape == (shape[0], shape[1] // 32)
    assert torch.equal(scale.long(), biased.long())
    assert torch.equal(bs.dequantize_mxfp8(xq, scale), elements)
    assert xq.float().abs().max() <= E4M3_MAX


def test_mxfp8_zero_and_bf16_blocks():
    x = torch.zeros(3, 64)
    x[1, 32:] = torch.linspace(-3, 5, 32)
    xq, scale = bs.quantize_mxfp8(x.bfloat16())
    assert torch.equal(bs.dequantize_mxfp8(xq, scale)[0], torch.zeros(64))  # an all-zero block stays zero
    assert torch.equal(bs.dequantize_mxfp8(xq, scale), emulate_mxfp8(x.bfloat16().float())[0])


@pytest.mark.parametrize("shape", [(1, 32), (37, 96), (5, 4096)])
def test_nvfp4_activations_equal_the_emulation(shape):
    x, _, _ = dit_like(*shape, n=16)
    packed, scale, tensor_scale = bs.quantize_nvfp4_activations(x)
    elements, block_scale, ts = emulate_nvfp4(x)
    assert packed.dtype == torch.uint8 and packed.shape == (shape[0], shape[1] // 2)
    assert scale.dtype == torch.float8_e4m3fn and scale.shape == (shape[0], shape[1] // 16)
    assert math.isclose(tensor_scale.item(), ts, rel_tol=1e-6)
    assert torch.equal(scale.float(), block_scale)
    ours = bs.dequantize_nvfp4_rows(packed, scale, tensor_scale)
    codes_equal = (ours == elements).float().mean().item()
    # torchao multiplies by a reciprocal of the scale where the definition divides: a value within an ulp of a
    # rounding threshold may land on the other side.
    assert codes_equal >= 0.999, f"{1 - codes_equal:.2%} of the elements differ"
    assert rel_l2(ours, elements) <= 1e-3


def test_nvfp4_weights_match_torchao_two_level_recipe():
    # Weights come from k6fast/kernels/nvfp4.py (the nvfp4 checkpoint format); torchao's two-level NVFP4 with the same
    # tensor scale must give the same scales and (but for threshold ties) the same codes.
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

    _, w, _ = dit_like(16, 4096, 256)
    packed, scale, scale_2 = bs.quantize_weight(w, "nvfp4")
    ts = per_tensor_amax_to_scale(w.abs().max())
    ao_scale, ao_packed = nvfp4_quantize(w, 16, ts)
    assert torch.equal(scale.view(torch.uint8), ao_scale.view(torch.uint8)) and torch.allclose(scale_2, ts)
    assert (unpack_e2m1(packed) == unpack_e2m1(ao_packed)).float().mean() >= 0.999


@pytest.mark.parametrize(("rows", "cols"), [(1, 1), (37, 3), (128, 4), (300, 9), (256, 128)])
def test_swizzle_is_the_layout_cublas_documents(rows, cols):
    # cuBLAS "1D block scaling factors layout": 128 x 4 tiles, tile (i, j) at (i · ceil(C/4) + j) · 512, and within
    # a tile the scale of row r, column c at 16 · (r % 32) + 4 · (r // 32) + c. Padding is zero.
    scale = torch.randint(1, 255, (rows, cols), dtype=torch.uint8)
    out = bs.swizzle_scales(scale)
    col_tiles = -(-cols // 4)
    assert out.shape == (-(-rows // 128) * 128 * col_tiles * 4,) and out.dtype == torch.uint8
    expected = torch.zeros_like(out)
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    offset = ((r // 128) * col_tiles + c // 4) * 512 + 16 * (r % 32) + 4 * ((r % 128) // 32) + c % 4
    expected[offset.flatten()] = scale.flatten()
    assert torch.equal(out, expected)
    e4m3 = bs.swizzle_scales(scale.view(torch.float8_e4m3fn))
    assert e4m3.dtype == torch.float8_e4m3fn and torch.equal(e4m3.view(torch.uint8), expected)


# ---------------------------------------------------------------------------------------------------------------
# The product
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", bs.FORMATS)
@pytest.mark.parametrize(("m", "k", "n"), [(1, 32, 16), (37, 160, 48), (256, 4096, 64)])
def test_product_equals_the_emulated_block_scaled_product(fmt, m, k, n):
    x, w, bias = dit_like(m, k, n)
    wq = bs.quantize_weight(w, fmt)
    emulate = emulate_mxfp8 if fmt == "mxfp8" else emulate_nvfp4
    emulated = emulate(x)[0] @ emulate(w)[0].t() + bias
    ref = bs.blockscaled_linear_ref(fmt, bs.quantize_activations(x, fmt), wq, bias, out_dtype=torch.float32)
    # nvfp4: the odd element on the other side of a threshold (see above) moves the product by a few 1e-4.
    assert rel_l2(ref, emulated) <= (1e-6 if fmt == "mxfp8" else 2e-3)
    xb = x.bfloat16()
    y = bs.blockscaled_linear(fmt, xb.reshape(1, m, k), wq, bias)  # quantizes x itself, any leading dims
    assert y.shape == (1, m, n) and y.dtype == torch.bfloat16
    ref_b = bs.blockscaled_linear_ref(fmt, bs.quantize_activations(xb, fmt), wq, bias, out_dtype=torch.float32)
    assert rel_l2(y[0], ref_b) <= 5e-3  # the output's bf16 rounding


@pytest.mark.parametrize("fmt", bs.FORMATS)
@pytest.mark.parametrize(("k", "n"), [(4096, 256), (16384, 64)])
def test_layer_error_on_dit_like_inputs(fmt, k, n):
    x, w, _ = dit_like(512, k, n)
    y = bs.blockscaled_linear(fmt, x.bfloat16(), bs.quantize_weight(w, fmt)).float()
    assert rel_l2(y, x @ w.t()) <= LAYER_BOUND[fmt]


@pytest.mark.parametrize("fmt", bs.FORMATS)
@pytest.mark.parametrize(("k", "n"), [(4096, 256), (16384, 64)])
def test_outlier_columns_bring_the_layer_error_within_the_bounds(fmt, k, n):
    from k6fast.kernels.fp8_outliers import outlier_columns

    x, w, _ = dit_like(512, k, n)
    xb = x.bfloat16()
    cols = outlier_columns(xb, 32)[:32]
    xq, wq = bs.activations_with_outliers(xb, fmt, cols), bs.weight_with_outliers(w.bfloat16(), fmt, cols)
    per_byte = 1 if fmt == "mxfp8" else 2
    assert xq[0].shape == (512, (k + 64) // per_byte) and wq[0].shape == (n, (k + 64) // per_byte)
    y = bs.blockscaled_linear(fmt, xq, wq).float()
    assert rel_l2(y, x @ w.t()) <= OUTLIER_BOUND[fmt]


@pytest.mark.parametrize("fmt", bs.FORMATS)
def test_outlier_columns_are_the_quantized_extended_tensors(fmt):
    x, w, _ = dit_like(37, 128, 48)
    cols = torch.tensor([5, 77, 100] + [-1] * 13, dtype=torch.int32)  # 16 columns, -1: zero columns
    xd = bs.dequantize(fmt, bs.quantize_activations(x, fmt))
    wd = bs.dequantize(fmt, bs.quantize_weight(w, fmt))
    picked = lambda t: torch.where(cols >= 0, t[:, cols.clamp_min(0).long()], 0.0)  # noqa: E731
    x_ext = torch.cat([x, picked(x), picked(x) - picked(xd)], dim=1)
    w_ext = torch.cat([w, picked(w) - picked(wd), picked(w)], dim=1)
    got_x, got_w = bs.activations_with_outliers(x, fmt, cols), bs.weight_with_outliers(w, fmt, cols)
    assert torch.equal(bs.dequantize(fmt, got_x), bs.dequantize(fmt, bs.quantize_activations(x_ext, fmt)))
    assert torch.equal(got_w[0][:, : w.shape[1] // (1 if fmt == "mxfp8" else 2)], bs.quantize_weight(w, fmt)[0])
    # The extra columns: the residual of the weight's rounding at cols, then the weight there; zeros for -1.
    extra = bs.dequantize(fmt, got_w)[:, 128:]
    assert torch.allclose(extra, bs.dequantize(fmt, bs.quantize_part(w_ext[:, 128:], fmt, got_w[2])))
    assert torch.equal(extra[:, 3:16], torch.zeros(48, 13)) and torch.equal(extra[:, 19:], torch.zeros(48, 13))
    with pytest.raises(ValueError, match="expected int"):
        bs.activations_with_outliers(x, fmt, cols[:10])


def test_bad_input_is_refused():
    x, w, _ = dit_like(8, 96, 32)
    wq = bs.quantize_weight(w, "mxfp8")
    with pytest.raises(ValueError, match="K a multiple of 32"):
        bs.quantize_mxfp8(torch.randn(4, 100))
    with pytest.raises(ValueError, match="expected a format in"):
        bs.blockscaled_linear("mxfp6", x, wq)
    with pytest.raises(ValueError, match=r"blockscaled_linear nvfp4: expected x as \(torch.uint8"):
        bs.blockscaled_linear("nvfp4", x, wq)  # an mxfp8 weight handed to the nvfp4 GEMM
    with pytest.raises(ValueError, match="expected out_dtype"):
        bs.blockscaled_linear("mxfp8", x, wq, out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"expected a float bias \(32,\)"):
        bs.blockscaled_linear("mxfp8", x, wq, torch.zeros(31))
    with pytest.raises(ValueError, match="expected a weight"):
        bs.quantize_weight(w[0], "mxfp8")


def test_cpu_runs_the_reference_and_says_so(caplog):
    x, w, _ = dit_like(4, 64, 16)
    with caplog.at_level("INFO", logger="k6fast.kernels.blockscaled"):
        log_reference_once.cache_clear()
        bs.blockscaled_linear("mxfp8", x, bs.quantize_weight(w, "mxfp8"))
    assert "runs the PyTorch reference: CPU tensors" in caplog.text
    assert not bs.blockscaled_native(torch.device("cpu"))


# ---------------------------------------------------------------------------------------------------------------
# GPU: the block-scaled GEMM itself on sm_100 / sm_120; on other GPUs the same call takes the reference, as the arm
# says it does there (torchao must be installed on the GPU machine: measurements/acceptance_lease.sh lists the wheels)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", bs.FORMATS)
@pytest.mark.parametrize(("m", "k", "n"), [(50220, 4096, 4096), (50220, 16384, 4096), (37, 160, 48)])
def test_scaled_mm_matches_the_reference_gpu(fmt, m, k, n):
    x, w, bias = (t.cuda() for t in dit_like(m, k, n))
    wq = bs.quantize_weight(w, fmt)
    xq = bs.quantize_activations(x.bfloat16(), fmt)
    y = bs.blockscaled_linear(fmt, xq, wq, bias.bfloat16())
    ref = bs.blockscaled_linear_ref(fmt, xq, wq, bias.bfloat16(), out_dtype=torch.float32)
    assert rel_l2(y, ref) <= 5e-3  # cuBLASLt: fp32 accumulation in another order; elsewhere the reference; bf16 out
    assert rel_l2(y.float(), x @ w.t() + bias) <= LAYER_BOUND[fmt]


@pytest.mark.parametrize("fmt", bs.FORMATS)
def test_custom_op_schema_and_fake(fmt):
    x, w, bias = dit_like(8, 64, 16)
    xq, wq = bs.quantize_activations(x, fmt), bs.quantize_weight(w, fmt)
    # opcheck's schema test compares float8 inputs with an op PyTorch's CPU backend lacks for float8 (as for fp8_linear)
    torch.library.opcheck(
        torch.ops.k6fast.blockscaled_mm.default,
        (fmt, *xq, *wq, bias.bfloat16(), torch.bfloat16),
        test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"),
    )
