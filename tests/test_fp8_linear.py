"""k6fast/kernels/fp8_linear.py: row-wise FP8 quantization, the FP8 linear, and the FP16-accumulate GEMM.

Three tiers: CPU tests of the references and of the public ops' CPU path; `interpret` tests of the Triton kernels
at tiny shapes (run in a subprocess with TRITON_INTERPRET=1, so the setting never leaks into this process); `gpu`
tests at the W1 shapes: M = 50220 tokens, (K, N) = (4096, 4096), (4096, 16384), (16384, 4096).
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import (
    W1_GEMM_SHAPES,
    W1_TOKENS,
    checked_rows,
    dit_like_gemm,
    interpreter_suite,
    needs_cuda,
    needs_interpreter,
)

from k6fast.kernels import fp8_linear as fp8_module
from k6fast.kernels.adaln import layernorm_modulate
from k6fast.kernels.fallback import log_reference_once
from k6fast.kernels.fp8_linear import (
    E4M3_MAX,
    fp8_linear,
    fp8_linear_ref,
    quantize_rows_fp8,
    quantize_rows_fp8_ref,
    quantize_rows_fp8_triton,
    quantize_weight_fp8,
)
from k6fast.kernels.fp8_outliers import outlier_columns
from k6fast.kernels.fp16acc_linear import (
    FP16ACC_CHUNKS,
    fp16acc_default_chunk,
    fp16acc_linear,
    fp16acc_linear_ref,
    fp16acc_linear_triton,
)
from k6fast.testing.bounds import assert_within_baseline_error, rel_l2

# DiT-like operands in bf16 (kernel_testing.dit_like_gemm).
dit_like = functools.partial(dit_like_gemm, dtype=torch.bfloat16)

# e4m3 keeps 3 mantissa bits: ≈2.5% RMS relative rounding error per operand, ≈3.5% for the product of two quantized
# operands over incoherent sums (CPU measurement on the DiT-like data below). 3% would be below that floor.
FP8_REL_L2_VS_BF16 = 0.045


# ---------------------------------------------------------------------------------------------------------------
# CPU: references and the public ops' CPU path
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 96), (218, 1792), (2, 3, 48), (5, 4096)])
def test_quantize_rows_ref_round_trip(shape):
    x = torch.randn(shape).bfloat16() * 3
    q, s = quantize_rows_fp8_ref(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and s.shape == (*shape[:-1], 1)
    amax = x.float().abs().amax(-1, keepdim=True)
    torch.testing.assert_close(s, amax / E4M3_MAX, rtol=0, atol=0)
    assert (q.float().abs().amax(-1, keepdim=True) == E4M3_MAX).all(), "each row's absmax maps to E4M3_MAX"
    # Round to nearest: within half an e4m3 step (2^-4 relative) of x, or of the subnormal spacing 2^-9 · scale.
    err = (q.float() * s - x.float()).abs()
    assert (err <= torch.maximum(x.float().abs() * 2.0**-4, s * 2.0**-10) * 1.0001).all()


def test_quantize_rows_zero_row_stays_finite():
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    x[1] = 1.0
    q, s = quantize_rows_fp8(x)
    assert torch.isfinite(s).all() and s[0, 0] > 0 and (q[0].float() == 0).all() and (q[1].float() == E4M3_MAX).all()


def test_quantize_weight_layout():
    w = torch.randn(48, 96).bfloat16()
    wq, s = quantize_weight_fp8(w)
    q_rows, s_rows = quantize_rows_fp8_ref(w)
    assert wq.shape == (48, 96) and wq.is_contiguous() and s.shape == (1, 48)
    assert torch.equal(wq.view(torch.uint8), q_rows.view(torch.uint8)) and torch.equal(s, s_rows.reshape(1, 48))


def test_fp8_linear_ref_is_the_dequantized_product():
    x, w, bias = dit_like(37, 256, 64)
    wq, ws = quantize_weight_fp8(w)
    xq, xs = quantize_rows_fp8_ref(x)
    expected = ((xq.float() * xs) @ (wq.float() * ws.reshape(-1, 1)).t() + bias.float()).bfloat16()
    assert torch.equal(fp8_linear_ref(x, wq, ws, bias), expected)
    assert torch.equal(fp8_linear_ref((xq, xs), wq, ws, bias), expected)


def test_fp8_quantization_error_on_dit_like_inputs():
    x, w, _ = dit_like(512, 4096, 256)
    wq, ws = quantize_weight_fp8(w)
    err = rel_l2(fp8_linear_ref(x, wq, ws, out_dtype=torch.float32), x.float() @ w.float().t())
    assert 0.01 < err <= FP8_REL_L2_VS_BF16, f"relative L2 vs the bf16 product {err:.4f}"


def test_extra_columns_repeat_or_correct_the_chosen_channels():
    x, w, _ = dit_like(64, 256, 32)
    cols = outlier_columns(x, 16)
    assert cols.dtype == torch.int32 and cols.shape == (128,) and (cols[16:] == -1).all()
    chosen = cols[:16].long()
    outliers = set(x.float().abs().amax(0).topk(256 // 512 + 1).indices.tolist())
    assert outliers <= set(chosen.tolist()), "the ×30 channel must be among the 16 chosen"
    xq, xs = quantize_rows_fp8_ref(x)
    xq_wide, xs_wide = quantize_rows_fp8_ref(x, cols)
    assert xq_wide.shape == (64, 256 + 128) and torch.equal(xs_wide, xs)
    assert torch.equal(xq_wide[:, :256].float(), xq.float())
    assert torch.equal(xq_wide[:, 256:272].float(), xq[:, chosen].float()), "activations: the same e4m3 values"
    assert (xq_wide[:, 272:].view(torch.uint8) == 0).all(), "padding columns are +0 (the kernel's bytes)"
    wq, ws = quantize_weight_fp8(w)
    wq_wide, _ = quantize_weight_fp8(w, residual_cols=cols)
    assert (wq_wide[:, 272:].float() == 0).all()
    plain = wq[:, chosen].float() * ws.reshape(-1, 1)
    corrected = plain + wq_wide[:, 256:272].float() * ws.reshape(-1, 1)
    target = w[:, chosen].float()
    # the residual column holds what rounding left, itself to e4m3's precision: ~2**-4 of the error remains
    assert (corrected - target).norm() < 0.1 * (plain - target).norm()


def test_outlier_columns_bring_dit_like_error_under_3_percent():
    """e4m3 on both operands costs ~3.5 % rel. L2 on DiT-like inputs; outlier columns bring it under 3 %."""
    x, w, bias = dit_like(1024, 4096, 256)
    exact = F.linear(x.float(), w.float(), bias.float())
    wq, ws = quantize_weight_fp8(w)
    plain = rel_l2(fp8_linear_ref(x, wq, ws, bias, out_dtype=torch.float32), exact)
    cols = outlier_columns(x, 16)
    wq16, ws16 = quantize_weight_fp8(w, residual_cols=cols)
    xq16 = quantize_rows_fp8_ref(x, cols)
    corrected = rel_l2(fp8_linear_ref(xq16, wq16, ws16, bias, out_dtype=torch.float32), exact)
    assert plain > 0.03 and corrected < 0.03, (plain, corrected)


def test_extra_columns_are_checked():
    x, _, _ = dit_like(4, 64, 16)
    with pytest.raises(ValueError, match="expected count in"):
        outlier_columns(x, 8)
    assert outlier_columns(x, 0) is None
    with pytest.raises(ValueError, match="extra_cols: expected int32 \\[128\\]"):
        quantize_rows_fp8(x, torch.arange(128))  # int64
    with pytest.raises(ValueError, match="extra_cols: expected int32 \\[128\\]"):
        quantize_rows_fp8(x, torch.arange(16, dtype=torch.int32))


def test_fp8_linear_on_cpu_runs_the_reference(caplog):
    log_reference_once.cache_clear()
    x, w, bias = dit_like(2 * 109, 96, 48)
    x = x.reshape(2, 109, 96)
    wq, ws = quantize_weight_fp8(w)
    with caplog.at_level(logging.INFO, logger=fp8_module.__name__):
        y = fp8_linear(x, wq, ws, bias)
        fp8_linear(x, wq, ws, bias)
    assert y.shape == (2, 109, 48) and torch.equal(y, fp8_linear_ref(x, wq, ws, bias))
    messages = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith("fp8_linear on cpu runs the PyTorch reference") for m in messages) == 1, messages


def test_fp8_linear_takes_the_fused_norm_output():
    x, w, _ = dit_like(218, 96, 32)
    scale, shift = torch.randn(2, 96).unbind(0)
    wq, ws = quantize_weight_fp8(w)
    fused = fp8_linear(layernorm_modulate(x, scale, shift, out_fp8=True), wq, ws)
    unfused = fp8_linear(layernorm_modulate(x, scale, shift), wq, ws)
    assert torch.equal(fused, unfused)


def test_fp16acc_ref_is_fp32_product_of_fp16_operands():
    x, w, bias = dit_like(37, 96, 48)
    expected = (x.half().float() @ w.half().float().t() + bias.float()).bfloat16()
    assert torch.equal(fp16acc_linear_ref(x, w, bias), expected)
    assert torch.equal(fp16acc_linear(x, w.half(), bias), expected)
    assert fp16acc_linear(x.reshape(1, 37, 96), w).shape == (1, 37, 48)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda x, wq, ws, b: fp8_linear(x[:, :40].contiguous(), wq[:, :40].contiguous(), ws),
            "multiples of 16, found K=40",
        ),
        (lambda x, wq, ws, b: fp8_linear(x, wq, ws.reshape(48, 1)), r"w_scale of shape \(1, 48\) or \(48,\)"),
        (lambda x, wq, ws, b: fp8_linear(x, wq, ws, b.float()), r"expected bias \(48,\) torch.bfloat16"),
        (lambda x, wq, ws, b: fp8_linear(x, wq, ws, b, torch.float32), "bias needs out_dtype bfloat16 or float16"),
        (lambda x, wq, ws, b: fp8_linear(x[:, :64].contiguous(), wq, ws), r"expected x \[..., 96\]"),
        (lambda x, wq, ws, b: fp8_linear((x, x.float()[:, :1]), wq, ws), "expected float8_e4m3fn operands"),
        (lambda x, wq, ws, b: fp16acc_linear(x, x, k_chunk=48), r"expected k_chunk one of \(32, .*\), found 48"),
        (lambda x, wq, ws, b: fp16acc_linear(x.float(), x), "expected bf16/fp16 x and w"),
        (lambda x, wq, ws, b: quantize_rows_fp8(x.t()), "expected a contiguous tensor"),
    ],
)
def test_errors_say_expected_and_found(call, message):
    x, w, bias = dit_like(8, 96, 48)
    wq, ws = quantize_weight_fp8(w)
    with pytest.raises(ValueError, match=message):
        call(x, wq, ws, bias)


def test_custom_ops_pass_opcheck():
    x, w, bias = dit_like(8, 96, 48)
    wq, ws = quantize_weight_fp8(w)
    xq, xs = quantize_rows_fp8(x)
    ops = torch.ops.k6fast
    torch.library.opcheck(ops.quantize_rows_fp8.default, (x, None, False))
    cols = outlier_columns(x, 16)
    torch.library.opcheck(ops.quantize_rows_fp8.default, (x, cols, False))
    torch.library.opcheck(ops.quantize_rows_fp8.default, (w, cols, True))
    # opcheck's schema test compares float8 inputs with an op PyTorch's CPU backend lacks for float8; the fake-tensor
    # and AOT-dispatch tests are the ones torch.compile depends on.
    torch.library.opcheck(
        ops.fp8_rowwise_mm.default,
        (xq, xs, wq, ws, bias, torch.bfloat16, False),
        test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"),
    )
    torch.library.opcheck(ops.fp16acc_linear.default, (x, w, bias, torch.bfloat16, 32))


def test_torch_compile_traces_without_graph_breaks():
    x, w, bias = dit_like(8, 96, 48)
    wq, ws = quantize_weight_fp8(w)

    def layer(x):
        return fp8_linear(x, wq, ws, bias) + fp16acc_linear(x, w, bias)

    torch.testing.assert_close(torch.compile(layer, backend="aot_eager", fullgraph=True)(x), layer(x), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# Interpreter: the Triton kernels at tiny shapes (fp8 rounding and bf16 dots are wrong in the interpreter; fp16
# dots and fp32 arithmetic are right, so the quantization scales and the fp16-accumulate GEMM are checked here).
# ---------------------------------------------------------------------------------------------------------------


def _assert_e4m3_close_interpreted(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within one e4m3 step, except where the reference is a power of two: the interpreter drops the exponent carry
    when rounding up crosses a power of two (1.97 becomes 1, not 2). The GPU tests compare every byte."""
    a, e = actual.float(), expected.float()
    mantissa, exponent = torch.frexp(torch.maximum(a.abs(), e.abs()))
    step = torch.ldexp(torch.ones_like(a), exponent - 4).clamp_min(2.0**-9)
    compared = torch.frexp(e)[0].abs() != 0.5
    assert compared.float().mean() > 0.5, "too few elements left to compare"
    assert ((a - e).abs() <= step)[compared].all()


test_triton_kernels_under_interpreter = interpreter_suite(__file__)


@pytest.mark.interpret
@needs_interpreter
@pytest.mark.parametrize("shape", [(1, 96), (3, 1792), (2, 5, 48), (2, 20000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_kernel_interpreted(shape, dtype):
    # (2, 20000): rows longer than one block take the two-sweep path.
    x = (torch.randn(shape) * 3).to(dtype)
    x[..., 0, :] = 0.0  # an all-zero row
    q, s = quantize_rows_fp8_triton(x)
    q_ref, s_ref = quantize_rows_fp8_ref(x)
    assert torch.equal(s, s_ref), "absmax and IEEE division (div_rn) are exact"
    _assert_e4m3_close_interpreted(q, q_ref)


@pytest.mark.interpret
@needs_interpreter
@pytest.mark.parametrize("shape", [(3, 1792), (2, 20000)])
def test_quantize_rows_kernel_extra_columns_interpreted(shape):
    # The appended columns on both paths (one block, two sweeps); the residual columns need exact e4m3 rounding,
    # which the interpreter lacks: GPU test.
    x = torch.randn(shape) * 3
    cols = torch.cat([torch.randperm(shape[-1])[:16], torch.full((112,), -1)]).to(torch.int32)
    q, s = quantize_rows_fp8_triton(x, cols)
    q_ref, s_ref = quantize_rows_fp8_ref(x, cols)
    assert q.shape == (shape[0], shape[1] + 128) and torch.equal(s, s_ref)
    _assert_e4m3_close_interpreted(q, q_ref)


@pytest.mark.interpret
@needs_interpreter
@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 32), (37, 160, 48), (40, 80, 64), (8, 512, 32)])
@pytest.mark.parametrize("k_chunk", FP16ACC_CHUNKS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp16acc_kernel_interpreted(m, k, n, k_chunk, with_bias):
    # m not a multiple of the tile (wrapped rows); K = 80 a multiple of no chunk (masked tail); K = 512 a multiple of
    # every chunk (the unmasked path, with 2 or 4 chained MMAs per chunk at 128 and 256).
    x, w, bias = dit_like(m, k, n)
    bias = bias if with_bias else None
    y = fp16acc_linear_triton(x, w, bias, out_dtype=torch.float32, k_chunk=k_chunk)
    expected = fp16acc_linear_ref(x, w, bias, out_dtype=torch.float32)
    assert rel_l2(y, expected) <= 2e-3, "fp16 rounding inside the chunks only"
    y_bf16 = fp16acc_linear_triton(x, w.half(), bias, k_chunk=k_chunk)
    assert y_bf16.dtype == torch.bfloat16 and rel_l2(y_bf16, expected) <= 1e-2


@pytest.mark.interpret
@needs_interpreter
@pytest.mark.parametrize("k_chunk", FP16ACC_CHUNKS)
def test_fp16acc_accumulates_in_fp32_across_chunks_interpreted(k_chunk):
    # Each chunk sums to 64·k_chunk <= 16384 (exact in fp16); the total 65536 is past fp16's 65504, so it is exact only
    # if every chunk starts from zero in fp16 and is added in fp32.
    x = torch.full((16, 1024), 8.0, dtype=torch.bfloat16)
    w = torch.full((16, 1024), 8.0, dtype=torch.float16)
    y = fp16acc_linear_triton(x, w, out_dtype=torch.float32, k_chunk=k_chunk)
    assert (y == 65536.0).all()


def test_fp16acc_default_chunk():
    assert fp16acc_default_chunk(torch.device("cpu")) == 32


# ---------------------------------------------------------------------------------------------------------------
# GPU: W1 shapes
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("k", [4096, 16384, 20000])
def test_quantize_rows_gpu_matches_reference_bit_for_bit(k):
    x, _, _ = dit_like(W1_TOKENS if k != 20000 else 300, k, 16, device="cuda")
    q, s = quantize_rows_fp8(x)
    q_ref, s_ref = quantize_rows_fp8_ref(x)
    assert torch.equal(s, s_ref)
    mismatched = (q.view(torch.uint8) != q_ref.view(torch.uint8)).sum().item()
    assert mismatched == 0, f"{mismatched} of {q.numel()} e4m3 bytes differ (both sides round fp32 to nearest-even)"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("k", [4096, 20000])
def test_quantize_rows_extra_columns_gpu_match_reference_bit_for_bit(k):
    x, w, _ = dit_like(3000, k, 16, device="cuda")
    cols = outlier_columns(x, 32)
    for t, residual in ((x, False), (w, True)):
        q, s = quantize_rows_fp8(t, cols, residual)
        q_ref, s_ref = quantize_rows_fp8_ref(t, cols, residual)
        assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("k", "n"), W1_GEMM_SHAPES)
def test_fp8_linear_outlier_columns_gpu(k, n):
    x, w, bias = dit_like(W1_TOKENS, k, n, device="cuda")
    rows = checked_rows(W1_TOKENS, "cuda")
    cols = outlier_columns(x, 32)  # 32 outlier channels at K = 16384
    wq, ws = quantize_weight_fp8(w, residual_cols=cols)
    y = fp8_linear(quantize_rows_fp8(x, cols), wq, ws, bias, fast_accum=True)[rows]
    err = rel_l2(y, F.linear(x[rows].float(), w.float(), bias.float()))
    assert err <= 0.03, f"relative L2 vs the exact product {err:.4f}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("k", "n"), W1_GEMM_SHAPES)
def test_fp8_linear_gpu(k, n):
    x, w, bias = dit_like(W1_TOKENS, k, n, device="cuda")
    wq, ws = quantize_weight_fp8(w)
    rows = checked_rows(W1_TOKENS, "cuda")
    y = fp8_linear(x, wq, ws, bias)[rows]
    xq, xs = quantize_rows_fp8(x[rows])
    exact_quantized = fp8_linear_ref((xq, xs), wq, ws, bias, out_dtype=torch.float32)
    assert rel_l2(y, exact_quantized) <= 5e-3, "the GEMM must compute the quantized product (bf16 output rounding)"
    err = rel_l2(y, F.linear(x[rows], w, bias))
    assert err <= FP8_REL_L2_VS_BF16, f"relative L2 vs the bf16 product {err:.4f}"


@pytest.mark.gpu
@needs_cuda
def test_fp8_linear_from_fused_norm_gpu():
    x, w, _ = dit_like(W1_TOKENS, 4096, 4096, device="cuda")
    scale, shift = (torch.randn(2, 4096, device="cuda") * 0.5).unbind(0)
    wq, ws = quantize_weight_fp8(w)
    fused = fp8_linear(layernorm_modulate(x, scale, shift, out_fp8=True), wq, ws)
    unfused = fp8_linear(layernorm_modulate(x, scale, shift), wq, ws)
    assert rel_l2(fused, unfused) <= 1e-3


@pytest.mark.gpu
@needs_cuda
# The default chunk (64) at every shape, the others at one: each (shape, chunk) pair costs an autotuning run.
@pytest.mark.parametrize(
    ("k", "n", "k_chunk"), [(k, n, 64) for k, n in W1_GEMM_SHAPES] + [(4096, 4096, 32), (4096, 4096, 128)]
)
def test_fp16acc_linear_gpu(k, n, k_chunk):
    x, w, bias = dit_like(W1_TOKENS, k, n, device="cuda")
    rows = checked_rows(W1_TOKENS, "cuda")
    y = fp16acc_linear(x, w.half(), bias, k_chunk=k_chunk)[rows]
    exact = fp16acc_linear_ref(x[rows], w, bias, out_dtype=torch.float32)
    # Flash-attention rule against cuBLAS bf16, with an allowance for the fp16 chunk sums (≈3e-4 relative L2 in a CPU
    # emulation).
    cublas = F.linear(x[rows], w, bias)
    assert_within_baseline_error(y, cublas, exact, metric="rel_l2", atol=1e-3, what=f"fp16acc k_chunk {k_chunk}")


@pytest.mark.gpu
@needs_cuda
def test_fp16acc_accumulates_in_fp32_across_chunks_gpu():
    x = torch.full((256, 1024), 8.0, dtype=torch.bfloat16, device="cuda")
    w = torch.full((128, 1024), 8.0, dtype=torch.float16, device="cuda")
    assert (fp16acc_linear(x, w, out_dtype=torch.float32) == 65536.0).all()
