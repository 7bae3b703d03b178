"""The statistics a bench session reports: per-arm medians with their spread, ratios, and the no-difference rule.

The protocol follows the published peer benchmarks': few samples per arm, each from a fresh process, compared median
against median. With two to eight samples an interval estimate would be fiction, so the spread shown is the
observed range (min/max) next to the quartiles, and a difference counts only when the other arm's median falls
outside the control's observed range.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

NO_DIFFERENCE = "no difference"


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method), q in [0, 100]."""
    if not values:
        raise ValueError("percentile of an empty sequence; expected at least one value")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], found {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50.0)


@dataclass(frozen=True)
class Summary:
    """One arm's samples (seconds), summarised."""

    n: int
    median: float
    low: float  # min
    high: float  # max
    q1: float
    q3: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        if not values:
            raise ValueError("cannot summarise an arm with no samples")
        bad = [v for v in values if not math.isfinite(v) or v < 0]
        if bad:
            raise ValueError(f"samples must be finite non-negative seconds, found {bad[:3]}")
        return cls(
            n=len(values),
            median=median(values),
            low=min(values),
            high=max(values),
            q1=percentile(values, 25.0),
            q3=percentile(values, 75.0),
        )

    def contains(self, value: float) -> bool:
        """Whether `value` lies inside this arm's observed range."""
        return self.low <= value <= self.high

    def as_dict(self) -> dict[str, float | int]:
        return {"n": self.n, "median": self.median, "min": self.low, "max": self.high, "q1": self.q1, "q3": self.q3}


@dataclass(frozen=True)
class Comparison:
    """An arm against a baseline arm: speedup = baseline median / arm median (> 1: the arm is faster)."""

    speedup: float
    speedup_low: float  # baseline min / arm max: the least favourable pairing of observed extremes
    speedup_high: float  # baseline max / arm min
    delta: float  # arm median - baseline median, seconds
    no_difference: bool  # the arm's median lies inside the baseline's observed range

    def describe(self) -> str:
        text = f"{self.speedup:.3f}× ({self.speedup_low:.3f}–{self.speedup_high:.3f})"
        return f"{text}, {NO_DIFFERENCE}" if self.no_difference else text


def compare(arm: Summary, baseline: Summary) -> Comparison:
    """Compare two arms by median; the range of the ratio pairs the observed extremes of both."""
    if arm.median <= 0 or arm.low <= 0:
        raise ValueError(f"cannot form a speed ratio with a zero time (arm median {arm.median}, min {arm.low})")
    return Comparison(
        speedup=baseline.median / arm.median,
        speedup_low=baseline.low / arm.high,
        speedup_high=baseline.high / arm.low,
        delta=arm.median - baseline.median,
        no_difference=baseline.contains(arm.median),
    )
