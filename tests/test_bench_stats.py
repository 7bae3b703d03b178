"""The bench's arithmetic: mirrored visit order, medians and spread, speedups, the no-difference rule."""

from __future__ import annotations

import numpy as np
import pytest

from k6fast.bench.session import visit_order
from k6fast.bench.stats import Summary, compare, median, percentile


def arms_of(order):
    return "".join(arm for arm, _, _ in order)


def test_two_arms_are_visited_mirrored() -> None:
    assert visit_order(["A", "B"]) == [("A", 0, 0), ("B", 1, 0), ("B", 2, 0), ("A", 3, 0)]


def test_three_arms_are_visited_mirrored() -> None:
    assert arms_of(visit_order(["A", "B", "C"])) == "ABCCBA"


def test_repeats_repeat_the_mirrored_pattern() -> None:
    order = visit_order(["A", "B"], repeats=2)
    assert arms_of(order) == "ABBAABBA"
    assert [r for _, _, r in order] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [p for _, p, _ in order] == [0, 1, 2, 3] * 2


def test_in_order_visits_each_arm_once_per_repeat() -> None:
    assert arms_of(visit_order(["A", "B", "C"], order="ABAB", repeats=2)) == "ABCABC"


def test_mirrored_order_balances_positions() -> None:
    # Every arm's mean position in the session is the same: a linear drift of the machine lands on all arms equally.
    order = visit_order(["A", "B", "C"], repeats=3)
    means = {arm: np.mean([i for i, (a, _, _) in enumerate(order) if a == arm]) for arm in "ABC"}
    assert len(set(means.values())) == 1


@pytest.mark.parametrize(
    ("arms", "kwargs", "message"),
    [
        ([], {}, "at least one arm"),
        (["A", "A"], {}, "distinct"),
        (["A", "B"], {"order": "ABC"}, "expected one of"),
        (["A", "B"], {"repeats": 0}, "repeats must be >= 1"),
    ],
)
def test_bad_orders_are_refused(arms, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        visit_order(arms, **kwargs)


@pytest.mark.parametrize("values", [[3.0], [2.0, 1.0], [5.0, 1.0, 4.0, 2.0, 3.0], [0.5, 0.7, 0.2, 0.9, 0.1, 0.4]])
def test_percentiles_match_numpy(values) -> None:
    for q in (0, 20, 25, 50, 75, 80, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert median(values) == pytest.approx(float(np.median(values)))


def test_summary_reports_median_range_and_quartiles() -> None:
    s = Summary.of([4.0, 1.0, 3.0, 2.0])
    assert (s.n, s.median, s.low, s.high) == (4, 2.5, 1.0, 4.0)
    assert (s.q1, s.q3) == (1.75, 3.25)
    assert s.as_dict()["max"] == 4.0


@pytest.mark.parametrize("values", [[], [1.0, -0.1], [float("nan")]])
def test_summary_refuses_meaningless_samples(values) -> None:
    with pytest.raises(ValueError):
        Summary.of(values)


def test_faster_arm_outside_control_range_is_a_difference() -> None:
    control = Summary.of([10.0, 10.4, 10.2, 9.9])
    arm = Summary.of([5.0, 5.2, 5.1, 4.9])
    c = compare(arm, control)
    assert c.speedup == pytest.approx(control.median / arm.median)
    assert c.speedup_low == pytest.approx(9.9 / 5.2)
    assert c.speedup_high == pytest.approx(10.4 / 4.9)
    assert c.delta == pytest.approx(arm.median - control.median)
    assert not c.no_difference
    assert "no difference" not in c.describe() and "×" in c.describe()


def test_delta_inside_control_spread_is_no_difference() -> None:
    control = Summary.of([10.0, 10.6, 10.2, 9.8])
    arm = Summary.of([10.5, 10.5, 10.4])  # median 10.5 lies inside 9.8..10.6
    c = compare(arm, control)
    assert c.no_difference
    assert c.describe().endswith("no difference")


def test_range_bounds_count_as_inside() -> None:
    control = Summary.of([1.0, 2.0])
    assert compare(Summary.of([2.0]), control).no_difference
    assert not compare(Summary.of([2.01]), control).no_difference


def test_zero_time_cannot_form_a_ratio() -> None:
    with pytest.raises(ValueError, match="zero time"):
        compare(Summary.of([0.0]), Summary.of([1.0]))
