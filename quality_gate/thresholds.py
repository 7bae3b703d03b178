"""The gate's limits: which set metrics are judged, their default limits, and the relative (noise-floor) rule.

Default limits. Video: LPIPS mean <= 0.15 and worst frame <= 0.25, the peers' G1 gate. Audio, calibrated on a
synthetic 5 s scene (harmonic tone with vibrato, band-limited noise, decaying clicks; peak 0.98) with the gate's
own metrics (tests/test_gate_metrics.py re-checks the verdicts on a 3 s scene and fails if the limits stop
separating them):

    case                                   log-mel dB   worst 0.25 s dB   MR-STFT
    AAC round trip (codec alone)           0.5          1.7               0.07
    gain -1 dB                             1.0          1.0               0.16
    100 ms dropout                         0.7          13.1              0.16
    another draw of the same scene         6.8          15.7              0.90
    other pitch, other draw                23           28                2.3

A lossy arm may cost about what a 1 dB level change or a codec pass costs, and must stay well clear of "a different
take of the same scene". Hence log-mel mean <= 3.0 dB (under half of another take), worst quarter second <= 8 dB
(a 100 ms dropout, 13 dB, fails; the codec's 1.7 dB passes) and MR-STFT <= 0.5 (about half of another take).

Relative mode (`--relative K`): each limit becomes floor x K + eps, with eps below what anyone can see or hear
(LPIPS 0.01 mean / 0.02 worst; the AAC round trip for audio), so a floor of exactly zero (a deterministic device)
still leaves room for a change at the rounding level.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import GateError

METRICS = ("lpips_mean", "lpips_worst", "log_mel_db", "log_mel_worst_db", "mrstft")
METRIC_NAMES = {
    "lpips_mean": "LPIPS set mean",
    "lpips_worst": "LPIPS worst frame",
    "log_mel_db": "log-mel distance (dB)",
    "log_mel_worst_db": "log-mel worst 0.25 s (dB)",
    "mrstft": "MR-STFT distance",
}
RELATIVE_EPS = {"lpips_mean": 0.01, "lpips_worst": 0.02, "log_mel_db": 0.5, "log_mel_worst_db": 1.7, "mrstft": 0.07}


@dataclass(frozen=True)
class Thresholds:
    lpips_mean: float = 0.15
    lpips_worst: float = 0.25
    log_mel_db: float = 3.0
    log_mel_worst_db: float = 8.0
    mrstft: float = 0.5
    relative: float | None = None  # K: limit = floor * K + RELATIVE_EPS

    def limit(self, metric: str, floor: dict[str, float] | None) -> tuple[float, str]:
        """(limit, rule text) for one set metric; `floor` is the noise floor's set aggregates (relative mode)."""
        if self.relative is None:
            return getattr(self, metric), "absolute"
        if floor is None:
            raise GateError("relative thresholds need the noise floor: run with --floor")
        eps = RELATIVE_EPS[metric]
        return floor[metric] * self.relative + eps, f"floor {floor[metric]:.4g} x {self.relative:g} + {eps:g}"

    def describe(self) -> str:
        if self.relative is not None:
            eps = ", ".join(f"{METRIC_NAMES[m]} {RELATIVE_EPS[m]:g}" for m in METRICS)
            return f"relative: every metric <= noise floor x {self.relative:g} + eps ({eps})"
        return (
            f"absolute: LPIPS mean <= {self.lpips_mean:g}, worst frame <= {self.lpips_worst:g}; "
            f"log-mel <= {self.log_mel_db:g} dB, worst 0.25 s <= {self.log_mel_worst_db:g} dB; "
            f"MR-STFT <= {self.mrstft:g}"
        )
