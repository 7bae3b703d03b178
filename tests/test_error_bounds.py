"""k6fast.testing.bounds: flash-attention's rule, err(result) <= 2 * err(bf16 baseline) + atol, as the kernel tests
apply it."""

from __future__ import annotations

import math

import pytest
import torch

from k6fast.testing.bounds import BASELINE_FACTOR, METRICS, assert_within_baseline_error, max_abs, rel_l2

EXACT = torch.tensor([1.0, -2.0, 4.0, 0.5], dtype=torch.float64)


def _off_by(delta: float) -> torch.Tensor:
    """EXACT with its third element moved by delta: max_abs = |delta|, rel_l2 = |delta| / |EXACT|."""
    moved = EXACT.clone()
    moved[2] += delta
    return moved


def test_metrics() -> None:
    assert max_abs(_off_by(-0.25), EXACT) == 0.25
    assert rel_l2(_off_by(0.25), EXACT) == pytest.approx(0.25 / math.sqrt(1 + 4 + 16 + 0.25), rel=1e-15)
    assert {"rel_l2": rel_l2, "max_abs": max_abs} == METRICS and BASELINE_FACTOR == 2.0


def test_a_result_at_the_limit_passes_and_just_past_it_fails() -> None:
    baseline = _off_by(0.125)
    # The limit is 2 * 0.125 + 0.0625 = 0.3125 in max_abs: exactly there passes, a hair more does not.
    errors = assert_within_baseline_error(_off_by(0.3125), baseline, EXACT, metric="max_abs", atol=0.0625)
    assert errors == (0.3125, 0.125)
    with pytest.raises(AssertionError, match=r"kernel: max_abs 3\.1\d*e-01 .* exceeds 2 x the baseline's 1\.250e-01"):
        assert_within_baseline_error(_off_by(0.3126), baseline, EXACT, metric="max_abs", atol=0.0625, what="kernel")


def test_the_floor_keeps_an_exact_baseline_from_demanding_exactness() -> None:
    assert_within_baseline_error(_off_by(1e-7), EXACT, EXACT, metric="rel_l2", atol=1e-6)
    with pytest.raises(AssertionError):
        assert_within_baseline_error(_off_by(1e-7), EXACT, EXACT, metric="rel_l2", atol=0.0)


def test_nan_fails_and_a_metric_of_the_callers_own_is_named() -> None:
    with pytest.raises(AssertionError, match="nan"):
        assert_within_baseline_error(_off_by(math.nan), _off_by(0.5), EXACT, metric="max_abs", atol=1.0)

    def max_px(a: torch.Tensor, b: torch.Tensor) -> float:
        return 255 * max_abs(a, b)

    with pytest.raises(AssertionError, match="max_px 2.55"):
        assert_within_baseline_error(_off_by(0.01), EXACT, EXACT, metric=max_px, atol=0.5)
    assert_within_baseline_error(_off_by(0.01), _off_by(0.005), EXACT, metric=max_px, atol=0.5)
