"""k6fast/kernels/adaln.py: layernorm_modulate, gated_residual and the two fused (gated_residual_modulate).

Three tiers: CPU tests of the references against diffusers' own functions and of the public ops' CPU path;
`interpret` tests of the Triton kernels at tiny shapes (run in a subprocess with TRITON_INTERPRET=1, so the setting
never leaks into this process); `gpu` tests at the W1 shapes (M = 50220 video tokens, D = 4096) and audio shapes.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import W1_TOKENS, interpreter_suite, needs_cuda, needs_interpreter

from k6fast.kernels import adaln
from k6fast.kernels.adaln import (
    gated_residual,
    gated_residual_,
    gated_residual_modulate,
    gated_residual_modulate_ref,
    gated_residual_modulate_triton,
    gated_residual_ref,
    gated_residual_triton,
    layernorm_modulate,
    layernorm_modulate_ref,
    layernorm_modulate_triton,
)
from k6fast.kernels.fallback import log_reference_once
from k6fast.kernels.fp8_linear import quantize_rows_fp8_ref, quantize_rows_fp8_triton
from k6fast.testing.bounds import assert_within_baseline_error

# (x shape, modulation shape): one row, D not a power of two, the 218 audio tokens, a batch with one vector per sample.
CASES = [
    ((1, 96), (96,)),
    ((218, 1792), (1, 1792)),
    ((2, 7, 96), (2, 96)),
    ((1, 218, 2048), (1, 2048)),
]


def _modulation(batch: int, d: int, device: str = "cpu", seed: int = 0):
    """(shift, scale, gate) as K6 makes them: chunks of one fp32 modulation output [B, 3·D] (strided views)."""
    g = torch.Generator(device=device).manual_seed(seed)
    params = torch.randn(batch, 3 * d, generator=g, device=device) * 0.5
    return params.chunk(3, dim=-1)


def _inputs(x_shape, mod_shape, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    d = x_shape[-1]
    # Activations with a non-zero mean and a few outlier channels, like a DiT residual stream.
    x = torch.randn(x_shape, generator=g, device=device) * 2.0 + 0.5
    x[..., : max(1, d // 64)] *= 20.0
    out = torch.randn(x_shape, generator=g, device=device)
    shift, scale, gate = _modulation(mod_shape[0] if len(mod_shape) == 2 else 1, d, device=device, seed=seed + 1)
    if len(mod_shape) == 1:
        shift, scale, gate = shift[0], scale[0], gate[0]
    return x.to(dtype), out.to(dtype), scale, shift, gate


def _diffusers_block_math():
    from diffusers.models.transformers.transformer_kandinsky6 import apply_gate_sum, apply_scale_shift

    return apply_scale_shift, apply_gate_sum


# ---------------------------------------------------------------------------------------------------------------
# CPU: references are diffusers' math, public ops run the reference on CPU tensors
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("x_shape", "mod_shape"), CASES)
def test_layernorm_modulate_ref_is_diffusers(x_shape, mod_shape):
    apply_scale_shift, _ = _diffusers_block_math()
    x, _, scale, shift, _ = _inputs(x_shape, mod_shape)
    norm = torch.nn.LayerNorm(x_shape[-1], elementwise_affine=False)
    assert torch.equal(layernorm_modulate_ref(x, scale, shift), apply_scale_shift(norm(x.float()), x, scale, shift))


@pytest.mark.parametrize(("x_shape", "mod_shape"), CASES)
def test_gated_residual_ref_is_diffusers(x_shape, mod_shape):
    _, apply_gate_sum = _diffusers_block_math()
    x, out, _, _, gate = _inputs(x_shape, mod_shape)
    assert torch.equal(gated_residual_ref(x, out, gate), apply_gate_sum(x, out, gate))


def test_bf16_modulation_vectors_match_diffusers():
    apply_scale_shift, apply_gate_sum = _diffusers_block_math()
    x, out, scale, shift, gate = _inputs((2, 5, 96), (2, 96))
    scale, shift, gate = scale.bfloat16(), shift.bfloat16(), gate.bfloat16()
    normed = F.layer_norm(x.float(), (96,))
    assert torch.equal(layernorm_modulate_ref(x, scale, shift), apply_scale_shift(normed, x, scale, shift))
    assert torch.equal(gated_residual_ref(x, out, gate), apply_gate_sum(x, out, gate))


def test_out_fp8_reference_quantizes_the_bf16_result():
    x, _, scale, shift, _ = _inputs((218, 1792), (1, 1792))
    y = layernorm_modulate_ref(x, scale, shift)
    q, s = layernorm_modulate_ref(x, scale, shift, out_fp8=True)
    q_expected, s_expected = quantize_rows_fp8_ref(y)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (218, 1)
    assert torch.equal(q.view(torch.uint8), q_expected.view(torch.uint8)) and torch.equal(s, s_expected)


@pytest.mark.parametrize(("x_shape", "mod_shape"), CASES)
def test_public_ops_on_cpu_equal_the_references(x_shape, mod_shape, caplog):
    log_reference_once.cache_clear()
    x, out, scale, shift, gate = _inputs(x_shape, mod_shape)
    with caplog.at_level(logging.INFO, logger=adaln.__name__):
        assert torch.equal(layernorm_modulate(x, scale, shift), layernorm_modulate_ref(x, scale, shift))
        assert torch.equal(layernorm_modulate(x, scale, shift), layernorm_modulate_ref(x, scale, shift))
        q, s = layernorm_modulate(x, scale, shift, out_fp8=True)
        q_ref, s_ref = layernorm_modulate_ref(x, scale, shift, out_fp8=True)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
        assert torch.equal(gated_residual(x, out, gate), gated_residual_ref(x, out, gate))
        x_new, h = gated_residual_modulate(x, out, gate, scale, shift)
        assert torch.equal(x_new, gated_residual_ref(x, out, gate))
        assert torch.equal(h, layernorm_modulate_ref(x_new, scale, shift))
    fallbacks = [r.getMessage() for r in caplog.records if "runs the PyTorch reference" in r.getMessage()]
    assert len([m for m in fallbacks if m.startswith("layernorm_modulate on cpu")]) == 1, fallbacks


def test_gated_residual_inplace_writes_into_x():
    x, out, _, _, gate = _inputs((2, 7, 96), (2, 96))
    expected = gated_residual_ref(x, out, gate)
    returned = gated_residual_(x, out, gate)
    assert returned is x and torch.equal(x, expected)


def test_empty_rows():
    x = torch.empty(0, 96, dtype=torch.bfloat16)
    scale = torch.zeros(96)
    assert layernorm_modulate(x, scale, scale).shape == (0, 96)
    assert gated_residual(x, x, scale).shape == (0, 96)
    assert [t.shape for t in gated_residual_modulate(x, x, scale, scale, scale)] == [(0, 96), (0, 96)]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda x, s: layernorm_modulate(x, s[:, :95], s[:, :95]), r"expected scale of shape \(96,\), \(1, 96\)"),
        (lambda x, s: layernorm_modulate(x[0], s.expand(3, 96), s.expand(3, 96)), r"found \(3, 96\)"),
        (lambda x, s: layernorm_modulate(x.transpose(0, 1), s, s), "expected a contiguous x"),
        (lambda x, s: layernorm_modulate(x.int(), s, s), "expected x bfloat16, float16 or float32, found torch.int32"),
        (lambda x, s: gated_residual(x, x[:1], s), r"expected out \(2, 5, 96\)"),
        (lambda x, s: gated_residual(x, x, s.long()), "expected gate float32, bfloat16 or float16"),
        (lambda x, s: layernorm_modulate(x[0, 0], s[0], s[0]), "at least 2 dims"),
        (lambda x, s: gated_residual_modulate(x, x, s, s, s[:, :95]), r"expected shift of shape \(96,\)"),
        (lambda x, s: gated_residual_modulate(x, x.transpose(0, 1), s, s, s), "expected a contiguous out"),
    ],
)
def test_errors_say_expected_and_found(call, message):
    x = torch.randn(2, 5, 96).bfloat16()
    s = torch.randn(1, 96)
    with pytest.raises(ValueError, match=message):
        call(x, s)


def test_custom_ops_pass_opcheck():
    x, out, scale, shift, gate = _inputs((2, 5, 96), (2, 96))
    ops = torch.ops.k6fast
    torch.library.opcheck(ops.layernorm_modulate.default, (x, scale, shift, 1e-5))
    torch.library.opcheck(ops.layernorm_modulate_fp8.default, (x, scale, shift, 1e-5))
    torch.library.opcheck(ops.gated_residual.default, (x, out, gate))
    torch.library.opcheck(ops.gated_residual_.default, (x.clone(), out, gate))
    torch.library.opcheck(ops.gated_residual_modulate.default, (x, out, gate, scale, shift, 1e-5))


def test_torch_compile_traces_without_graph_breaks():
    x, out, scale, shift, gate = _inputs((2, 5, 96), (2, 96))

    def block(x, out, scale, shift, gate):
        y = layernorm_modulate(x, scale, shift)
        q, s = layernorm_modulate(x, scale, shift, out_fp8=True)
        x_new, h = gated_residual_modulate(x, out, gate, scale, shift)
        return gated_residual(x, out + y, gate), q.float() * s, x_new, h

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    for got, expected in zip(compiled(x, out, scale, shift, gate), block(x, out, scale, shift, gate), strict=True):
        assert torch.equal(got, expected)


# ---------------------------------------------------------------------------------------------------------------
# Interpreter: the Triton kernels at tiny shapes. The interpreter does not round fp32 → bf16 to nearest, so bf16
# outputs are checked to one unit in the last place (fp32 outputs tightly). Its fp32 → e4m3 conversion drops the
# carry when rounding up crosses a power of two (1.97 becomes 1, not 2), so e4m3 elements whose reference is a power
# of two are left to the GPU tests, which compare every byte.
# ---------------------------------------------------------------------------------------------------------------


def _assert_within_one_ulp(actual, expected, mantissa_bits: int, min_spacing: float, atol: float = 0.0):
    a, e = actual.float(), expected.float()
    _, exponent = torch.frexp(torch.maximum(a.abs(), e.abs()))
    ulp = torch.ldexp(torch.ones_like(a), exponent - 1 - mantissa_bits).clamp_min(min_spacing)
    excess = (a - e).abs() - ulp - atol
    assert excess.max() <= 0, f"{(excess > 0).sum().item()} of {a.numel()} elements differ by more than one ulp"


def _assert_bf16_close(actual, expected, atol: float = 0.0):
    _assert_within_one_ulp(actual, expected, mantissa_bits=7, min_spacing=2.0**-133, atol=atol)


def _assert_e4m3_close_interpreted(actual: torch.Tensor, expected: torch.Tensor) -> None:
    a, e = actual.float(), expected.float()
    mantissa, _ = torch.frexp(e)
    away_from_carry = mantissa.abs() != 0.5
    assert away_from_carry.float().mean() > 0.5, "too few elements left to compare"
    _assert_within_one_ulp(a[away_from_carry], e[away_from_carry], mantissa_bits=3, min_spacing=2.0**-9)


test_triton_kernels_under_interpreter = interpreter_suite(__file__)


@pytest.mark.interpret
@needs_interpreter
@pytest.mark.parametrize(("x_shape", "mod_shape"), CASES)
def test_layernorm_modulate_kernel_interpreted(x_shape, mod_shape):
    x, _, scale, shift, _ = _inputs(x_shape, mod_shape)
    # atol: the kernel's fp32 LayerNorm differs from PyTorch's by fp32 rounding, visible next to zero.
    _assert_bf16_close(layernorm_modulate_triton(x, scale, shift), layernorm_modulate_ref(x, scale, shift), atol=1e-5)
    xf = x.float()
    torch.testing.assert_close(
        layernorm_modulate_triton(xf, scale, shift), layernorm_modulate_ref(xf, scale, shift), rtol=1e-5, atol=1e-5
    )


@pytest.mark.interpret
@needs_interpreter
@pytest.mark.parametrize(("x_shape", "mod_shape"), CASES)
def test_layernorm_modulate_fp8_kernel_interpreted(x_shape, mod_shape):
    # fp32 activations: no bf16 rounding in between, so the per-row scales must agree to fp32 precision.
    x, _, scale, shift, _ = _inputs(x_shape, mod_shape, dtype=torch.float32)
    q, s = layernorm_modulate_triton(x, scale, shift, out_fp8=True)
    q_ref, s_ref = layernorm_modulate_ref(x, scale, shift, out_fp8=True)
    assert q.shape == x.shape and s.shape == (*x.shape[:-1], 1)
    torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=0)
    _assert_e4m3_close_interpreted(q, q_ref)


@pytest.mark.interpret
@needs_interpreter
@pytest.mark.parametrize(("x_shape", "mod_shape"), CASES)
def test_gated_residual_kernel_interpreted(x_shape, mod_shape):
    x, out, _, _, gate = _inputs(x_shape, mod_shape)
    expected = gated_residual_ref(x, out, gate)
    _assert_bf16_close(gated_residual_triton(x, out, gate), expected)
    x_inplace = x.clone()
    assert gated_residual_triton(x_inplace, out, gate, inplace=True) is x_inplace
    _assert_bf16_close(x_inplace, expected)
    xf, outf = x.float(), out.float()
    torch.testing.assert_close(gated_residual_triton(xf, outf, gate), gated_residual_ref(xf, outf, gate))


@pytest.mark.interpret
@needs_interpreter
@pytest.mark.parametrize(("x_shape", "mod_shape"), CASES[:3])  # the fourth adds interpreter time, not a path
def test_gated_residual_modulate_kernel_interpreted(x_shape, mod_shape):
    x, out, scale, shift, gate = _inputs(x_shape, mod_shape)
    x_new, h = gated_residual_modulate_triton(x, out, gate, scale, shift)
    # The two kernels in sequence, exactly; they are checked against the references above.
    assert torch.equal(x_new, gated_residual_triton(x, out, gate))
    assert torch.equal(h, layernorm_modulate_triton(x_new, scale, shift))
    expected_x, _ = gated_residual_modulate_ref(x, out, gate, scale, shift)
    _assert_bf16_close(x_new, expected_x)
    _assert_bf16_close(h, layernorm_modulate_ref(x_new, scale, shift), atol=1e-5)


@pytest.mark.interpret
@needs_interpreter
def test_mixed_modulation_shapes_interpreted():
    # One vector shared by all samples beside per-sample ones: each must still read its own sample's row. fp32, so
    # the fused kernel's fp32 path is checked too.
    x, out, scale, shift, gate = _inputs((2, 7, 96), (2, 96), dtype=torch.float32)
    x_new, h = gated_residual_modulate_triton(x, out, gate[:1], scale, shift[0])
    expected_x, expected_h = gated_residual_modulate_ref(x, out, gate[:1], scale, shift[0])
    torch.testing.assert_close(x_new, expected_x)
    torch.testing.assert_close(h, expected_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        layernorm_modulate_triton(x, scale[:1], shift),
        layernorm_modulate_ref(x, scale[:1], shift),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.interpret
@needs_interpreter
def test_fused_fp8_matches_norm_then_quantize_interpreted():
    x, _, scale, shift, _ = _inputs((3, 96), (96,), dtype=torch.float32)
    q, s = layernorm_modulate_triton(x, scale, shift, out_fp8=True)
    q2, s2 = quantize_rows_fp8_triton(layernorm_modulate_triton(x, scale, shift))
    assert torch.equal(s, s2) and torch.equal(q.view(torch.uint8), q2.view(torch.uint8))


# ---------------------------------------------------------------------------------------------------------------
# GPU: W1 shapes, judged by the flash-attention rule against fp32 math
# ---------------------------------------------------------------------------------------------------------------

W1_DIM = 4096
GPU_CASES = [((1, W1_TOKENS, W1_DIM), (1, W1_DIM)), ((1, 218, 2048), (1, 2048)), ((1, 96), (96,)), *CASES[1:3]]


def _layernorm_modulate_fp32(x, scale, shift):
    """The fp32 result before the final rounding: what both the kernel and diffusers' math approximate."""
    normed = F.layer_norm(x.float(), (x.shape[-1],), eps=1e-5)
    if x.ndim > 2 and scale.ndim == 2:
        shape = (scale.shape[0],) + (1,) * (x.ndim - 2) + (scale.shape[-1],)
        scale, shift = scale.reshape(shape), shift.reshape(shape)
    return normed * (scale.float() + 1.0) + shift.float()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("x_shape", "mod_shape"), GPU_CASES)
def test_layernorm_modulate_gpu(x_shape, mod_shape):
    x, _, scale, shift, _ = _inputs(x_shape, mod_shape, device="cuda")
    y = layernorm_modulate(x, scale, shift)
    exact = _layernorm_modulate_fp32(x, scale, shift)
    assert_within_baseline_error(y, layernorm_modulate_ref(x, scale, shift), exact, metric="max_abs", atol=1e-5)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("x_shape", "mod_shape"), GPU_CASES)
def test_gated_residual_gpu(x_shape, mod_shape):
    x, out, _, _, gate = _inputs(x_shape, mod_shape, device="cuda")
    g = gate.reshape(gate.shape[0], *([1] * (x.ndim - 2)), -1) if x.ndim > 2 and gate.ndim == 2 else gate
    exact = x.float() + g.float() * out.float()
    y = gated_residual(x, out, gate)
    assert_within_baseline_error(y, gated_residual_ref(x, out, gate), exact, metric="max_abs", atol=1e-5)
    x_inplace = x.clone()
    gated_residual_(x_inplace, out, gate)
    assert torch.equal(x_inplace, y), "the in-place kernel must write what the out-of-place one returns"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("x_shape", "mod_shape"), GPU_CASES)
def test_layernorm_modulate_fp8_gpu(x_shape, mod_shape):
    x, _, scale, shift, _ = _inputs(x_shape, mod_shape, device="cuda")
    q, s = layernorm_modulate(x, scale, shift, out_fp8=True)
    q_ref, s_ref = layernorm_modulate_ref(x, scale, shift, out_fp8=True)
    # The kernel's LayerNorm may differ from PyTorch's by an fp32 rounding, which flips a few bf16 roundings, which
    # move a row's absmax by one bf16 ulp (2^-8 relative) or an element by one e4m3 step.
    torch.testing.assert_close(s, s_ref, rtol=2.0**-7, atol=0)
    deq, deq_ref = q.float() * s, q_ref.float() * s_ref
    rel = ((deq - deq_ref).norm() / deq_ref.norm()).item()
    assert rel <= 1e-2, f"dequantized relative L2 vs reference {rel:.2e}"
    # Fused and unfused paths feed the GEMM the same operands.
    q2, s2 = quantize_rows_fp8_triton(layernorm_modulate(x, scale, shift))
    mismatched = (q.view(torch.uint8) != q2.view(torch.uint8)).float().mean().item()
    scales_mismatched = (s != s2).float().mean().item()
    assert mismatched <= 1e-4 and scales_mismatched <= 1e-4, (
        f"fused vs unfused: {mismatched:.2e} of bytes and {scales_mismatched:.2e} of scales differ"
    )


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("x_shape", "mod_shape"), GPU_CASES)
def test_gated_residual_modulate_gpu(x_shape, mod_shape):
    x, out, scale, shift, gate = _inputs(x_shape, mod_shape, device="cuda")
    x_new, h = gated_residual_modulate(x, out, gate, scale, shift)
    # Bit-identical to the two kernels in sequence (tested against fp32 math above): the same residual expression,
    # and the norm's tile, warps and so reduction order.
    x_pair = gated_residual(x, out, gate)
    assert torch.equal(x_new, x_pair), "x_new differs from gated_residual"
    assert torch.equal(h, layernorm_modulate(x_pair, scale, shift)), "h differs from layernorm_modulate of x_new"
