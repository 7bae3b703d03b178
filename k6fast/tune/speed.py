"""The speed model that orders `k6fast tune`'s candidates: a request's predicted seconds from a few bench timings.

Measured (one bench visit each, on the machine being tuned): the base arm, and one probe per rate-changing setting
with lossy attention at full coverage (no protected block, only the first and last step dense): each 8-bit GEMM
format, each quantized-attention site set, the sparse attention at the searched density furthest from dense, and each
MagCache threshold. The rest is structure, not measurement:

    request = rest + sum over called steps i of  b_i * g * (1 - coverage * lossy(i) * (1 - a))  [* magcache share]

b_i: the base's time of step i; rest: the base's request less its steps (text, decode, mux); g: the GEMM probe's step
time over the base's; a: the attention probes' step-time ratios over their lossy steps (sparse and quantized
multiply; a sparse density between dense and the probe's scales linearly with the key blocks kept); coverage: the
share of blocks outside the protected ones (blocks cost the same); lossy(i): step i lies between the dense first and
last steps; called steps: those not in K6_PIFLOW_CACHE_STEPS. Predictions order the search; the winner's speed is its
own measurement.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..switches import SWITCHES_BY_NAME
from .search import TuneError


@dataclass(frozen=True)
class Timing:
    """One arm's request as a bench visit measured it: wall seconds and the denoising steps' seconds."""

    seconds: float
    step_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.seconds > 0 or not self.step_s:
            raise TuneError(f"a timing needs positive seconds and per-step times, found {self.seconds}, {self.step_s}")


FULL_COVERAGE = {"K6_EXACT_ATTN_BLOCKS": "0", "K6_EXACT_ATTN_STEPS": "1", "K6_EXACT_ATTN_LAST_STEPS": "1"}


def probe_arms(space_levels: Sequence[Mapping[str, str]], densities: Sequence[float]) -> dict[str, dict[str, str]]:
    """The probes to time, name → switch values over the base: one per rate-changing level of the space
    (`space_levels`: every knob level's switch values) and the lowest of `densities`."""
    probes: dict[str, dict[str, str]] = {}
    for level in space_levels:
        gemm = level.get("K6_GEMM")
        if gemm and gemm != "bf16":
            probes[f"gemm-{gemm}"] = {"K6_GEMM": gemm}
        if level.get("K6_ATTN") == "k6":
            site = level["K6_QUANT_ATTN_SITES"]
            probes[f"quant-{site}"] = {"K6_ATTN": "k6", "K6_QUANT_ATTN_SITES": site, **FULL_COVERAGE}
        if level.get("K6_STEP_CACHE") == "magcache":
            threshold = level["K6_STEP_CACHE_THRESHOLD"]
            probes[f"magcache-{threshold}"] = {"K6_STEP_CACHE": "magcache", "K6_STEP_CACHE_THRESHOLD": threshold}
    if densities:
        probes[f"sparse-{min(densities):g}"] = {"K6_SPARSE_ATTN": str(min(densities)), **FULL_COVERAGE}
    return probes


def _value(switches: Mapping[str, str], name: str):
    """A switch's parsed value in `switches` (K6_NAME → raw), parsed by the registry; its default where unset or
    empty."""
    switch = SWITCHES_BY_NAME[name]
    raw = switches.get(name)
    return switch.parse(raw) if raw else switch.default


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


@dataclass
class SpeedModel:
    """Predicts a request's seconds from switch values (K6_NAME → raw), given the base's timing and the probes'."""

    base: Timing
    num_blocks: int
    probes: dict[str, Timing] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return len(self.base.step_s)

    def _ratio(self, name: str, lossy_only: bool) -> float:
        """A probe's mean step time over the base's, on its lossy steps (1..steps-2) or on every step."""
        probe = self.probes.get(name)
        if probe is None:
            return 1.0
        if len(probe.step_s) != self.steps:
            raise TuneError(f"probe {name} timed {len(probe.step_s)} steps, the base {self.steps}")
        idx = range(1, self.steps - 1) if lossy_only and self.steps > 2 else range(self.steps)
        return _mean([probe.step_s[i] for i in idx]) / _mean([self.base.step_s[i] for i in idx])

    def _sparse_ratio(self, density: float) -> float:
        name = next((n for n in self.probes if n.startswith("sparse-")), None)
        if density <= 0.0 or density >= 1.0 or name is None:
            return 1.0
        probe_density = float(name.removeprefix("sparse-"))
        kept_less = (1.0 - density) / (1.0 - probe_density)  # share of the probe's skipped key blocks skipped here
        return 1.0 - (1.0 - self._ratio(name, lossy_only=True)) * kept_less

    def predict(self, switches: Mapping[str, str]) -> float:
        steps = self.steps
        gemm = switches.get("K6_GEMM", "bf16")
        g = self._ratio(f"gemm-{gemm}", lossy_only=False) if gemm != "bf16" else 1.0
        a = 1.0
        if switches.get("K6_ATTN", "exact") == "k6":
            a *= self._ratio(f"quant-{switches.get('K6_QUANT_ATTN_SITES', 'video_self')}", lossy_only=True)
        a *= self._sparse_ratio(_value(switches, "K6_SPARSE_ATTN"))
        coverage = max(0, self.num_blocks - 2 * _value(switches, "K6_EXACT_ATTN_BLOCKS")) / self.num_blocks
        first = _value(switches, "K6_EXACT_ATTN_STEPS")
        last = _value(switches, "K6_EXACT_ATTN_LAST_STEPS")
        cached = set(_value(switches, "K6_PIFLOW_CACHE_STEPS"))
        denoise = sum(
            b * g * (1.0 - coverage * (1.0 - a) * (first <= i < steps - last))
            for i, b in enumerate(self.base.step_s)
            if i not in cached
        )
        if switches.get("K6_STEP_CACHE") == "magcache":
            denoise *= self._ratio(f"magcache-{switches.get('K6_STEP_CACHE_THRESHOLD')}", lossy_only=False)
        rest = max(0.0, self.base.seconds - sum(self.base.step_s))
        return rest + denoise
