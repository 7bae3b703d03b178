"""The fp8 outlier-column choice (k6fast/kernels/fp8_outliers.py): the reference, the two Triton kernels (interpreter
and GPU, which must choose exactly the reference's channels), and the op under torch.compile."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import interpreter_suite, needs_cuda, needs_interpreter

from k6fast.kernels.fp8_outliers import (
    OUTLIER_WIDTH,
    ROW_STRIDE,
    outlier_columns,
    outlier_columns_ref,
    outlier_columns_triton,
)


def with_outliers(rows: int, k: int, channels: list[int], dtype=torch.bfloat16, device="cpu", seed=0):
    """N(0, 1) activations whose `channels` are ×30 on every row."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, k, generator=g, device=device)
    x[:, channels] *= 30.0
    return x.to(dtype)


def chosen(cols: torch.Tensor) -> list[int]:
    return cols[cols >= 0].tolist()


def test_ref_chooses_the_outlier_channels_in_order_then_pads():
    x = with_outliers(1000, 256, [200, 7, 31])
    cols = outlier_columns_ref(x, 16)
    assert cols.dtype == torch.int32 and cols.shape == (OUTLIER_WIDTH,)
    picked = chosen(cols)
    assert len(picked) == 16 and picked == sorted(picked), "16 channels in ascending order"
    assert {7, 31, 200} <= set(picked)
    assert (cols[16:] == -1).all()


def test_ref_samples_every_64th_row():
    x = torch.ones(200, 64)
    x[1, 40] = 100.0  # not a sampled row: ignored
    x[ROW_STRIDE, 50] = 2.0  # sampled
    assert chosen(outlier_columns_ref(x, 16)) == [*range(15), 50]


def test_ties_go_to_the_lower_channel():
    assert chosen(outlier_columns_ref(torch.ones(10, 96), 32)) == list(range(32))
    x = torch.ones(10, 96)
    x[:, 90] = 2.0
    assert chosen(outlier_columns_ref(x, 16)) == [*range(15), 90]


def test_fewer_channels_than_asked_and_no_rows():
    assert chosen(outlier_columns_ref(torch.randn(70, 20), 32)) == list(range(20))
    assert chosen(outlier_columns_ref(torch.empty(0, 48), 16)) == list(range(16))


def test_outlier_columns_checks_its_input():
    x = torch.randn(8, 64)
    with pytest.raises(ValueError, match=r"expected count in \(0, 16, 32, 64\), found 8"):
        outlier_columns(x, 8)
    with pytest.raises(ValueError, match="expected a contiguous tensor"):
        outlier_columns(x.t(), 16)
    assert outlier_columns(x, 0) is None
    assert torch.equal(outlier_columns(x, 16), outlier_columns_ref(x, 16))  # CPU: the reference


def test_op_passes_opcheck_and_compiles_without_graph_breaks():
    x = with_outliers(300, 128, [3])
    torch.library.opcheck(torch.ops.k6fast.outlier_columns.default, (x, 32))
    compiled = torch.compile(lambda t: outlier_columns(t, 32), backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), outlier_columns_ref(x, 32))


# Interpreter: the kernels on CPU tensors, exactly the reference's choice.


test_triton_kernels_under_interpreter = interpreter_suite(__file__)


@pytest.mark.interpret
@needs_interpreter
@pytest.mark.parametrize(
    ("rows", "k", "count"),
    [(1000, 256, 16), (300, 200, 32), (5, 96, 64), (2000, 1100, 32), (5000, 256, 32), (130, 20, 32)],
    ids=["pow2", "ragged-k", "one-sampled-row", "several-column-blocks", "row-splits", "k-below-count"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernels_choose_the_reference_channels_interpreted(rows, k, count, dtype):
    x = with_outliers(rows, k, [k // 3, k - 1], dtype=dtype)
    assert torch.equal(outlier_columns_triton(x, count), outlier_columns_ref(x, count))


@pytest.mark.interpret
@needs_interpreter
def test_kernels_break_ties_like_the_reference_interpreted():
    x = torch.ones(100, 300)
    x[:, 250] = 3.0
    assert torch.equal(outlier_columns_triton(x, 32), outlier_columns_ref(x, 32))
    assert torch.equal(outlier_columns_triton(torch.zeros(64, 80), 16), outlier_columns_ref(torch.zeros(64, 80), 16))


# GPU: W1 shapes.


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("k", [4096, 16384, 5120])
@pytest.mark.parametrize("count", [16, 32, 64])
def test_kernels_choose_the_reference_channels_gpu(k, count):
    x = with_outliers(50220, k, list(range(5, k, k // 30)), device="cuda")
    assert torch.equal(outlier_columns(x, count), outlier_columns_ref(x, count))
