"""k6fast/kernels/nvfp4.py: NVFP4 quantization, dequantization and the dequantize-in-prologue Triton GEMM.

Three tiers: CPU tests of the format (exact codes, packing, scales, round-trip error) and of the public ops' CPU path;
`interpret` tests of the Triton kernel at tiny shapes with fp32 dots (run in a subprocess with TRITON_INTERPRET=1, so
the setting never leaks into this process; bf16 dots are wrong in the interpreter); `gpu` tests at the W1 shapes:
M = 50220 tokens, (K, N) = (4096, 4096), (4096, 16384), (16384, 4096), and odd shapes.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from kernel_testing import (
    W1_GEMM_SHAPES,
    W1_TOKENS,
    checked_rows,
    dit_like_gemm,
    interpreter_suite,
    needs_cuda,
    needs_interpreter,
)

from k6fast.kernels import nvfp4 as nvfp4_module
from k6fast.kernels.fallback import log_reference_once
from k6fast.kernels.formats import E4M3_MAX
from k6fast.kernels.nvfp4 import (
    E2M1_VALUES,
    dequantize_nvfp4,
    dequantize_nvfp4_ref,
    e2m1_to_f32,
    e4m3_to_f32,
    nvfp4_linear,
    nvfp4_linear_ref,
    nvfp4_linear_triton,
    quantize_nvfp4,
    quantize_nvfp4_ref,
    unpack_codes,
)
from k6fast.testing.bounds import rel_l2

# DiT-like operands in bf16, with outlier weights (kernel_testing.dit_like_gemm).
dit_like = functools.partial(dit_like_gemm, dtype=torch.bfloat16, outlier_weights=True)

# E2M1 with e4m3 block scales: ≈ 9.5% relative L2 on Gaussian weights (CPU measurement below), the weight-only error
# that a product with incoherent activations inherits.
NVFP4_REL_L2 = 0.12


# ---------------------------------------------------------------------------------------------------------------
# CPU: the format
# ---------------------------------------------------------------------------------------------------------------


def _unit_scale_weight(values: list[float]) -> torch.Tensor:
    """w [16, 32] fp32 whose blocks (after the first) quantize with block scale · global scale = 1 exactly: the global
    amax 10.5 (block 0 of row 0) gives global scale 10.5 / 2688 = 2^-8, and every other block holds a 6.0, so its
    scale is e4m3(6 / (6 · 2^-8)) = 256. `values` fill row 1's second block after its 6.0."""
    w = torch.zeros(16, 32)
    w[0, 0] = 10.5
    w[1:, 16] = 6.0
    w[1:, 0] = 6.0
    w[1, 17 : 17 + len(values)] = torch.tensor(values)
    return w


# (value, E2M1 code): ties go to the even code (mantissa bit 0); past ±6 saturates.
HAND_PICKED = [
    (0.0, 0), (0.1, 0), (0.25, 0), (0.26, 1), (0.5, 1), (0.75, 2), (1.0, 2), (1.25, 2), (1.3, 3), (1.75, 4),
    (2.5, 4), (2.6, 5), (3.5, 6), (5.0, 6), (5.1, 7),
]  # fmt: skip
HAND_PICKED_NEG = [(-0.5, 9), (-1.5, 11), (-1.75, 12), (-3.0, 13), (-4.0, 14), (-6.0, 15), (-0.75, 10)]


@pytest.mark.parametrize("quantize", [quantize_nvfp4, quantize_nvfp4_ref])
@pytest.mark.parametrize("cases", [HAND_PICKED, HAND_PICKED_NEG])
def test_e2m1_codes_of_hand_picked_values(quantize, cases):
    packed, block_scales, global_scale = quantize(_unit_scale_weight([v for v, _ in cases]))
    assert global_scale.item() == 2.0**-8 and block_scales[1, 1].float().item() == 256.0
    codes = unpack_codes(packed)
    assert codes[1, 16].item() == 7, "6.0 is the largest code"
    assert codes[1, 17 : 17 + len(cases)].tolist() == [c for _, c in cases]


def test_packing_order_is_low_nibble_first():
    # Row 1: 6.0 (code 7) then 0.5 (code 1) → byte 0x17; then 1.5 (code 3), -2.0 (code 12) → byte 0xC3.
    w = _unit_scale_weight([0.5, 1.5, -2.0])
    packed, _, _ = quantize_nvfp4(w)
    assert packed.shape == (16, 16) and packed.dtype == torch.uint8
    assert packed[1, 8].item() == 0x17 and packed[1, 9].item() == 0xC3
    back = dequantize_nvfp4(packed, *quantize_nvfp4(w)[1:], dtype=torch.float32)
    assert back[1, 16:20].tolist() == [6.0, 0.5, 1.5, -2.0]


def test_scales_follow_the_nvfp4_recipe():
    _, w, _ = dit_like(1, 256, 64)
    packed, block_scales, global_scale = quantize_nvfp4(w)
    amax = w.float().abs().amax()
    assert global_scale.dtype == torch.float32 and global_scale.shape == ()
    assert global_scale == amax / torch.tensor(E4M3_MAX * 6.0)
    assert block_scales.shape == (64, 16) and block_scales.dtype == torch.float8_e4m3fn
    block_amax = w.float().view(64, 16, 16).abs().amax(-1)
    expected = (block_amax / (torch.tensor(6.0) * global_scale)).to(torch.float8_e4m3fn)
    assert torch.equal(block_scales.view(torch.uint8), expected.view(torch.uint8))
    assert block_scales.float().max() == E4M3_MAX, "the block holding the global amax gets the largest scale"
    # The largest weight comes back exactly up to the scale's fp32 rounding.
    back = dequantize_nvfp4(packed, block_scales, global_scale, torch.float32)
    torch.testing.assert_close(back.abs().max(), amax, rtol=1e-6, atol=0)


@pytest.mark.parametrize(("n", "k"), [(16, 32), (48, 96), (256, 4096)])
def test_quantize_matches_reference_bit_for_bit(n, k):
    _, w, _ = dit_like(1, k, n, seed=n)
    w = w.float()
    # Exact ties as well: values at the midpoints of a unit-scale block.
    ties = _unit_scale_weight([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -5.0])
    for weight in (w, w.bfloat16(), ties):
        a, b = quantize_nvfp4(weight), quantize_nvfp4_ref(weight)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1].view(torch.uint8), b[1].view(torch.uint8))
        assert torch.equal(a[2], b[2])


def test_dequantize_matches_bit_formula_for_every_code_and_scale():
    # Every byte (so every pair of codes) and every non-NaN e4m3 scale, subnormals included.
    scales = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # 254 patterns
    scales = torch.cat([scales, scales[:2]]).view(16, 16).view(torch.float8_e4m3fn)  # [N=16, K/16=16]
    packed = (torch.arange(128) + 128 * (torch.arange(16) % 2)[:, None]).to(torch.uint8)  # [16, K/2=128]
    g = torch.tensor(0.37, dtype=torch.float32)
    a = dequantize_nvfp4(packed, scales, g, torch.float32)
    b = dequantize_nvfp4_ref(packed, scales, g, torch.float32)
    assert torch.equal(a, b)
    assert sorted(set(unpack_codes(packed).flatten().tolist())) == list(range(16))
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))
    assert torch.equal(a[0, :2], lut[unpack_codes(packed)[0, :2].long()] * (scales[0, 0].float() * g))


@pytest.mark.parametrize(("n", "k"), [(64, 4096), (256, 1792), (48, 16384)])
def test_round_trip_error_on_dit_like_weights(n, k):
    _, w, _ = dit_like(1, k, n, seed=k)
    back = dequantize_nvfp4(*quantize_nvfp4(w), dtype=torch.float32)
    err = rel_l2(back, w.float())
    assert 0.05 < err <= NVFP4_REL_L2, f"relative L2 {err:.4f}"
    assert dequantize_nvfp4(*quantize_nvfp4(w)).dtype == torch.bfloat16


def test_zero_weights_and_blocks_stay_finite():
    packed, block_scales, global_scale = quantize_nvfp4(torch.zeros(16, 32))
    assert global_scale > 0 and (packed == 0).all() and (block_scales.float() == 0).all()
    w = torch.randn(16, 64)
    w[3, 16:32] = 0.0  # one all-zero block
    w[5, :16] = 1e-30  # a block whose scale underflows e4m3 to 0
    back = dequantize_nvfp4(*quantize_nvfp4(w), dtype=torch.float32)
    assert torch.isfinite(back).all() and (back[3, 16:32] == 0).all() and (back[5, :16] == 0).all()


# ---------------------------------------------------------------------------------------------------------------
# CPU: the linear's reference and its CPU path
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [64, 5 * 256, 1 << 22])
def test_dequantize_in_chunks_equals_whole(monkeypatch, chunk):
    # Chunks of 1 row (fewer elements than a row), 5 rows (the last one ragged) and all 48 rows of a K = 256 weight.
    _, w, _ = dit_like(8, 256, 48)
    q = quantize_nvfp4(w)
    expected = dequantize_nvfp4_ref(*q, dtype=torch.bfloat16)
    monkeypatch.setattr(nvfp4_module, "DEQUANT_CHUNK", chunk)
    assert torch.equal(dequantize_nvfp4(*q, dtype=torch.bfloat16), expected)


def test_linear_ref_is_the_fp32_product_of_the_dequantized_weight():
    x, w, bias = dit_like(37, 256, 64)
    q = quantize_nvfp4(w)
    expected = (x.float() @ dequantize_nvfp4(*q, dtype=torch.float32).t() + bias.float()).bfloat16()
    assert torch.equal(nvfp4_linear_ref(x, *q, bias), expected)


def test_linear_error_against_the_bf16_product():
    x, w, bias = dit_like(512, 4096, 256)
    err = rel_l2(nvfp4_linear_ref(x.float(), *quantize_nvfp4(w), bias), F.linear(x.float(), w.float(), bias.float()))
    assert 0.02 < err <= NVFP4_REL_L2, f"relative L2 vs the bf16 product {err:.4f}"


def test_linear_on_cpu_runs_the_reference(caplog):
    log_reference_once.cache_clear()
    x, w, bias = dit_like(2 * 109, 96, 48)
    x = x.reshape(2, 109, 96)
    q = quantize_nvfp4(w)
    with caplog.at_level(logging.INFO, logger=nvfp4_module.__name__):
        y = nvfp4_linear(x, *q, bias)
        nvfp4_linear(x.half(), *q)
    assert y.shape == (2, 109, 48) and y.dtype == torch.bfloat16 and torch.equal(y, nvfp4_linear_ref(x, *q, bias))
    messages = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith("nvfp4_linear on cpu runs the PyTorch reference") for m in messages) == 1, messages


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda x, q, b: quantize_nvfp4(torch.randn(16, 48)), "K a multiple of 32 and N a multiple of 16, found K=48"),
        (lambda x, q, b: quantize_nvfp4(torch.randn(8, 32)), "found K=32, N=8"),
        (lambda x, q, b: quantize_nvfp4(torch.randn(2, 16, 32)), r"expected a weight \[N, K\]"),
        (lambda x, q, b: quantize_nvfp4(torch.ones(16, 32, dtype=torch.int32)), "expected a bfloat16, float16"),
        (lambda x, q, b: nvfp4_linear(x.float(), *q), "expected bf16/fp16 activations, found torch.float32"),
        (lambda x, q, b: nvfp4_linear(x[:, :64].contiguous(), *q), r"expected x \[..., 96\]"),
        (lambda x, q, b: nvfp4_linear(x.t().contiguous().t(), *q), "expected a contiguous x"),
        (lambda x, q, b: nvfp4_linear(x, q[0], q[1].float(), q[2]), r"block_scales float8_e4m3fn \[48, 6\]"),
        (lambda x, q, b: nvfp4_linear(x, q[0], q[1], q[2].reshape(1, 1).double()), "float32 global_scale"),
        (lambda x, q, b: nvfp4_linear(x, q[0].view(torch.int8), q[1], q[2]), r"packed uint8 \[N, K/2\]"),
        (lambda x, q, b: nvfp4_linear(x, *q, b[:16]), r"expected a float bias \(48,\)"),
    ],
)
def test_errors_say_expected_and_found(call, message):
    x, w, bias = dit_like(8, 96, 48)
    with pytest.raises(ValueError, match=message):
        call(x, quantize_nvfp4(w), bias)


def test_custom_op_passes_opcheck_and_compiles():
    x, w, bias = dit_like(8, 96, 48)
    q = quantize_nvfp4(w)
    # As for fp8: opcheck's schema test compares float8 inputs with an op PyTorch's CPU backend lacks for float8.
    torch.library.opcheck(
        torch.ops.k6fast.nvfp4_linear.default,
        (x, *q, bias),
        test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"),
    )
    compiled = torch.compile(lambda x: nvfp4_linear(x, *q, bias), backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), nvfp4_linear(x, *q, bias))


# ---------------------------------------------------------------------------------------------------------------
# Interpreter: the Triton kernel at tiny shapes against the fp32 reference (fp32 and fp16 dots are right there, bf16
# dots are not: bf16 activations are GPU-only)
# ---------------------------------------------------------------------------------------------------------------


test_triton_kernel_under_interpreter = interpreter_suite(__file__)


@triton.jit
def _decode_kernel(codes_ptr, bytes_ptr, e2m1_out, e4m3_out):
    i = tl.arange(0, 16)
    tl.store(e2m1_out + i, e2m1_to_f32(tl.load(codes_ptr + i)))
    j = tl.arange(0, 256)
    tl.store(e4m3_out + j, e4m3_to_f32(tl.load(bytes_ptr + j)))


@pytest.mark.interpret
@needs_interpreter
def test_bit_decoders_interpreted():
    codes = torch.arange(16, dtype=torch.int32)
    patterns = torch.arange(256, dtype=torch.int32)
    e2m1, e4m3 = torch.empty(16), torch.empty(256)
    _decode_kernel[(1,)](codes, patterns, e2m1, e4m3)
    assert e2m1.tolist() == list(E2M1_VALUES) + [-v for v in E2M1_VALUES]
    expected = patterns.to(torch.uint8).view(torch.float8_e4m3fn).float()
    finite = ~expected.isnan()  # 0x7F / 0xFF are NaN in e4m3fn and never stored as scales
    assert torch.equal(e4m3[finite], expected[finite])


@pytest.mark.interpret
@needs_interpreter
@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 16), (37, 96, 48), (40, 128, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_nvfp4_kernel_interpreted(m, k, n, with_bias):
    # m not a multiple of the 32-row tile (wrapped rows), K = 96 not a multiple of the 64-wide K tile (masked tail),
    # N = 48 not a multiple of the 32-wide N tile.
    x, w, bias = dit_like(m, k, n, seed=m)
    bias = bias if with_bias else None
    q = quantize_nvfp4(w)
    # fp32 activations holding bf16 values: the kernel's fp32 dot then differs from the reference by summation order.
    y = nvfp4_linear_triton(x.float(), *q, bias, dot_fp32=True)
    expected = nvfp4_linear_ref(x.float(), *q, bias)
    assert y.dtype == torch.float32 and rel_l2(y, expected) <= 1e-6
    # The production path (operands in x's dtype) with fp16 activations, whose dots the interpreter gets right:
    # fp16 output rounding only (x's bf16 values are exact in fp16 at these magnitudes).
    y16 = nvfp4_linear_triton(x.half(), *q, bias)
    assert y16.dtype == torch.float16 and rel_l2(y16, expected) <= 1e-3


# ---------------------------------------------------------------------------------------------------------------
# GPU: W1 shapes and odd shapes
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("k", "n"), W1_GEMM_SHAPES)
def test_nvfp4_linear_gpu(k, n):
    x, w, bias = dit_like(W1_TOKENS, k, n, device="cuda")
    q = quantize_nvfp4(w)
    rows = checked_rows(W1_TOKENS, "cuda")
    y = nvfp4_linear(x, *q, bias)[rows]
    exact = nvfp4_linear_ref(x[rows].float(), *q, bias)
    assert rel_l2(y, exact) <= 5e-3, "the GEMM must compute the quantized product (bf16 output rounding)"
    err = rel_l2(y, F.linear(x[rows], w, bias))
    assert err <= NVFP4_REL_L2, f"relative L2 vs the bf16 product {err:.4f}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("m", "k", "n"), [(1, 4096, 4096), (218, 2048, 7168), (333, 96, 48), (50, 7168, 2048)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nvfp4_linear_gpu_odd_shapes(m, k, n, dtype):
    x, w, bias = dit_like(m, k, n, device="cuda")
    q = quantize_nvfp4(w)
    y = nvfp4_linear(x.to(dtype), *q, bias)
    assert y.dtype == dtype and y.shape == (m, n)
    assert rel_l2(y, nvfp4_linear_ref(x.float(), *q, bias)) <= 5e-3


@pytest.mark.gpu
@needs_cuda
def test_quantize_on_gpu_matches_cpu_bit_for_bit():
    _, w, _ = dit_like(1, 16384, 512, device="cuda")
    a, b = quantize_nvfp4(w), quantize_nvfp4(w.cpu())
    assert torch.equal(a[0].cpu(), b[0]) and torch.equal(a[1].view(torch.uint8).cpu(), b[1].view(torch.uint8))
    assert torch.equal(a[2].cpu(), b[2])
    assert torch.equal(dequantize_nvfp4(*a).cpu(), dequantize_nvfp4(*b))


def test_even_k_heuristic_returns_the_flag_itself() -> None:
    # triton.heuristics wants the value; a dict here made Triton 3.6 fail at launch ("unhashable type: 'dict'").
    from k6fast.kernels import nvfp4

    assert nvfp4.even_k({"K": 4096, "BLOCK_K": 64}) is True
    assert nvfp4.even_k({"K": 96, "BLOCK_K": 64}) is False
