"""k6fast/kernels/fp8_fp16acc.py: the GeForce FP8 GEMM that accumulates each K chunk in FP16 and sums them in FP32.

What the CPU can check: the emulation of the FP16 chunk accumulation against the FP32-accumulate product of the same
e4m3 operands (`fp8_linear_ref`), the overflow bound that fixes the quantization range, and the Triton kernel under
the interpreter (which sums each chunk's e4m3 products exactly and rounds the chunk to FP16 once: at the default
32-wide chunk that equals the emulation bit for bit, so indexing, masks, scales and the chunk rounding are checked;
the hardware's rounding inside one MMA is not). The FP16-accumulate instruction itself is checked in the SASS
(tests/test_sass_geforce.py); the rounding on a GeForce card by the `gpu` test below (skipped elsewhere).
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import dit_like_gemm as dit_like  # fp32 on the CPU
from kernel_testing import interpreter_suite, needs_cuda, needs_interpreter

from k6fast.kernels.formats import E4M3_MAX
from k6fast.kernels.fp8_fp16acc import (
    DEFAULT_CHUNK,
    FP16_CHUNK_QMAX,
    FP16_MAX,
    MMA_K,
    fp8_fp16acc_linear,
    fp8_fp16acc_linear_ref,
    fp8_fp16acc_linear_triton,
)
from k6fast.kernels.fp8_linear import fp8_linear_ref, quantize_rows_fp8, quantize_weight_fp8
from k6fast.testing.bounds import rel_l2


def quantized(x: torch.Tensor, w: torch.Tensor, chunk: int = DEFAULT_CHUNK):
    qmax = FP16_CHUNK_QMAX[chunk]
    return quantize_rows_fp8(x, qmax=qmax), *quantize_weight_fp8(w, qmax=qmax)


@pytest.mark.parametrize("chunk", sorted(FP16_CHUNK_QMAX))
def test_qmax_bounds_every_chunk_sum_below_fp16_max(chunk):
    qmax = FP16_CHUNK_QMAX[chunk]
    assert qmax * qmax * chunk <= FP16_MAX
    assert torch.tensor(qmax).to(torch.float8_e4m3fn).float().item() == qmax  # an e4m3 value: saturation lands on it
    # The worst case: every product at qmax² — the emulation's FP16 accumulator stays finite, and E4M3_MAX would not.
    ones = torch.ones(4, 2 * chunk)
    (xq, xs), wq, ws = quantized(ones, ones, chunk)
    assert xq.float().max() == qmax
    y = fp8_fp16acc_linear_ref(xq, xs, wq, ws, out_dtype=torch.float32, chunk=chunk)
    assert torch.isfinite(y).all() and torch.allclose(y, torch.full_like(y, 2.0 * chunk))
    big = torch.full((4, chunk), E4M3_MAX).to(torch.float8_e4m3fn)
    one = torch.ones(4, 1)
    assert torch.isinf(fp8_fp16acc_linear_ref(big, one, big, one.t(), out_dtype=torch.float32, chunk=chunk)).all()


@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 32), (37, 160, 48), (256, 4096, 64), (64, 16384, 32)])
def test_fp16_chunks_cost_little_against_fp32_accumulation(m, k, n):
    x, w, bias = dit_like(m, k, n)
    (xq, xs), wq, ws = quantized(x, w)
    fp32_acc = fp8_linear_ref((xq, xs), wq, ws, bias, out_dtype=torch.float32)
    chunks = fp8_fp16acc_linear((xq, xs), wq, ws, bias, out_dtype=torch.float32)  # CPU: the emulation
    # FP16 keeps 11 significant bits; the chunk sums' rounding is ~0.1 % of the output, far below e4m3's ~3.5 %.
    assert rel_l2(chunks, fp32_acc) <= 2e-3
    if m * n >= 4096:  # enough outputs for a stable figure
        exact = x @ w.t() + bias
        assert rel_l2(chunks, exact) <= 0.045  # the e4m3 operands' own loss, as the full-range fp8 GEMM has it


def test_reduced_range_keeps_e4m3_precision():
    x, w, _ = dit_like(256, 4096, 64)
    exact = x @ w.t()
    full = fp8_linear_ref(quantize_rows_fp8(x), *quantize_weight_fp8(w), out_dtype=torch.float32)
    (xq, xs), wq, ws = quantized(x, w)
    reduced = fp8_linear_ref((xq, xs), wq, ws, out_dtype=torch.float32)
    assert abs(rel_l2(reduced, exact) - rel_l2(full, exact)) <= 2e-3


def test_bad_input_is_refused():
    x, w, _ = dit_like(8, 64, 32)
    (xq, xs), wq, ws = quantized(x, w)
    with pytest.raises(ValueError, match="expected chunk one of"):
        fp8_fp16acc_linear((xq, xs), wq, ws, chunk=48)
    with pytest.raises(ValueError, match=r"must lie within ±44"):
        fp8_fp16acc_linear(quantize_rows_fp8(x), wq, ws)  # quantized to ±E4M3_MAX: may overflow FP16
    with pytest.raises(ValueError, match="expected e4m3"):
        fp8_fp16acc_linear((xq.float(), xs), wq, ws)
    with pytest.raises(ValueError, match="expected xq"):
        fp8_fp16acc_linear((xq[:, :32], xs), wq, ws)


# ---------------------------------------------------------------------------------------------------------------
# Interpreter
# ---------------------------------------------------------------------------------------------------------------


test_triton_kernel_under_interpreter = interpreter_suite(__file__)


@pytest.mark.interpret
@needs_interpreter
@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 32), (37, 160, 48), (40, 96, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_interpreted(m, k, n, with_bias):
    # m not a multiple of the tile (wrapped rows); K = 160 and 96 not multiples of 64 (masked tails at chunk 64).
    x, w, bias = dit_like(m, k, n)
    bias = bias if with_bias else None
    for chunk in (32, 64):
        (xq, xs), wq, ws = quantized(x, w, chunk)
        y = fp8_fp16acc_linear_triton(xq, xs, wq, ws, bias, out_dtype=torch.float32, chunk=chunk)
        emulated = fp8_fp16acc_linear_ref(xq, xs, wq, ws, bias, out_dtype=torch.float32, chunk=chunk)
        # The interpreter's dot sums each chunk exactly and rounds it to FP16 once: at 32-wide chunks (one MMA) that is
        # the emulation bit for bit; at 64 the emulation rounds after each of the two MMAs, the interpreter once.
        if chunk == MMA_K:
            assert torch.equal(y, emulated)
        else:
            assert rel_l2(y, emulated) <= 1e-3
        assert rel_l2(y, fp8_linear_ref((xq, xs), wq, ws, bias, out_dtype=torch.float32)) <= 2e-3


# ---------------------------------------------------------------------------------------------------------------
# GPU (sm_89 and newer; the rounding checked is the GeForce one only on a GeForce card)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("k", "n"), [(4096, 4096), (16384, 4096)])
def test_fp8_fp16acc_gpu(k, n):
    x, w, bias = dit_like(4096, k, n)
    x, w, bias = x.cuda().bfloat16(), w.cuda().bfloat16(), bias.cuda()
    (xq, xs), wq, ws = quantized(x, w)
    y = fp8_fp16acc_linear((xq, xs), wq, ws, bias, out_dtype=torch.float32)
    emulated = fp8_fp16acc_linear_ref(xq, xs, wq, ws, bias, out_dtype=torch.float32)
    if torch.cuda.get_device_capability() < (8, 9):  # no FP8 tensor cores: the reference runs, and says so once
        assert torch.equal(y, emulated)
        return
    fp32_acc = fp8_linear_ref((xq, xs), wq, ws, bias, out_dtype=torch.float32)
    assert torch.isfinite(y).all()
    assert rel_l2(y, fp32_acc) <= 2e-3 and rel_l2(y, emulated) <= 2e-3


def test_custom_op_schema_and_fake():
    x, w, bias = dit_like(8, 64, 16)
    (xq, xs), wq, ws = quantized(x, w)
    # opcheck's schema test compares float8 inputs with an op PyTorch's CPU backend lacks for float8 (as for fp8_linear)
    torch.library.opcheck(
        torch.ops.k6fast.fp8_fp16acc_mm.default,
        (xq, xs, wq, ws, bias, torch.bfloat16, 32),
        test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"),
    )
