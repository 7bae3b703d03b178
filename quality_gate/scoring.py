"""Scores of one arm against the reference: per clip, per set, and the checks that decide pass or fail.

Per clip (one prompt at one seed): LPIPS of every decoded frame (mean and worst frame) and the audio distances.
Per set: LPIPS mean = mean of the clip means; LPIPS worst = the worst frame anywhere in the set; log-mel and
MR-STFT = mean of the clip values; log-mel worst = the worst quarter second anywhere in the set.
The limits and their calibration are in `thresholds.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..media import read_mp4
from . import GateError
from .audio_metric import AudioScore, score_audio
from .lpips_metric import LpipsScorer
from .thresholds import METRICS, Thresholds


@dataclass
class ClipScore:
    """One prompt at one seed. lpips: float64 [F], one value per decoded frame."""

    prompt_id: str
    seed: int
    lpips: np.ndarray
    identical_video: bool
    audio: AudioScore
    reference: Path | None = None
    test: Path | None = None

    @property
    def lpips_mean(self) -> float:
        return float(self.lpips.mean())

    @property
    def worst_frame(self) -> int:
        return int(np.argmax(self.lpips))

    @property
    def lpips_worst(self) -> float:
        return float(self.lpips.max())

    @property
    def identical(self) -> bool:
        return self.identical_video and self.audio.identical

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt_id,
            "seed": self.seed,
            "lpips_mean": self.lpips_mean,
            "lpips_worst": self.lpips_worst,
            "worst_frame": self.worst_frame,
            "lpips_per_frame": [float(v) for v in self.lpips],
            "identical_video": self.identical_video,
            "identical": self.identical,
            "audio": self.audio.as_dict(),
            "reference_clip": str(self.reference) if self.reference else None,
            "test_clip": str(self.test) if self.test else None,
        }


def read_clip(path: Path) -> tuple[np.ndarray, np.ndarray, int]:
    """Decode a gate clip: (frames uint8 [F, H, W, 3], audio float32 [N], sample rate). Audio is required."""
    frames, audio, sample_rate = read_mp4(path)
    if audio is None:
        raise GateError(f"{path}: expected an audio stream (the gate scores video and audio), found none")
    return frames, audio, sample_rate


def score_clip(
    scorer: LpipsScorer,
    reference: tuple[np.ndarray, np.ndarray, int],
    test: tuple[np.ndarray, np.ndarray, int],
    prompt_id: str,
    seed: int,
) -> ClipScore:
    """Score decoded clips (as `read_clip` returns them) against each other."""
    (ref_frames, ref_audio, ref_rate), (test_frames, test_audio, test_rate) = reference, test
    if ref_rate != test_rate:
        raise GateError(f"{prompt_id} s{seed}: expected equal sample rates, found {ref_rate} and {test_rate} Hz")
    return ClipScore(
        prompt_id=prompt_id,
        seed=seed,
        lpips=scorer.frames(ref_frames, test_frames),
        identical_video=bool(np.array_equal(ref_frames, test_frames)),
        audio=score_audio(ref_audio, test_audio, ref_rate),
    )


def aggregate(clips: list[ClipScore]) -> dict[str, Any]:
    """Set aggregates (every name in METRICS) plus where the worst frame and worst quarter second are."""
    if not clips:
        raise GateError("no clips to aggregate; expected at least one prompt and seed")
    worst = max(clips, key=lambda c: c.lpips_worst)
    worst_audio = max(clips, key=lambda c: c.audio.log_mel_worst_db)
    return {
        "lpips_mean": float(np.mean([c.lpips_mean for c in clips])),
        "lpips_worst": worst.lpips_worst,
        "lpips_worst_at": {"prompt": worst.prompt_id, "seed": worst.seed, "frame": worst.worst_frame},
        "log_mel_db": float(np.mean([c.audio.log_mel_db for c in clips])),
        "log_mel_worst_db": worst_audio.audio.log_mel_worst_db,
        "log_mel_worst_at": {
            "prompt": worst_audio.prompt_id,
            "seed": worst_audio.seed,
            "start_s": worst_audio.audio.log_mel_worst_at_s,
        },
        "mrstft": float(np.mean([c.audio.mrstft for c in clips])),
        "identical_clips": sum(c.identical for c in clips),
        "clips": len(clips),
    }


@dataclass(frozen=True)
class Check:
    metric: str
    value: float
    limit: float
    rule: str

    @property
    def passed(self) -> bool:
        return self.value <= self.limit

    def as_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "value": self.value,
            "limit": self.limit,
            "rule": self.rule,
            "passed": self.passed,
        }


@dataclass
class ArmResult:
    """An arm's scores and verdict. `floor` marks the reference re-run (scored, never judged)."""

    label: str
    spec: str
    arm_hash: str
    switches: dict[str, str]
    lossy: list[str]
    exact: bool
    shares_reference: bool
    clips: list[ClipScore]
    checks: list[Check] = field(default_factory=list)
    floor: bool = False

    @property
    def aggregates(self) -> dict[str, Any]:
        return aggregate(self.clips)

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    def as_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "arm": self.spec,
            "arm_hash": self.arm_hash,
            "switches": self.switches,
            "lossy_switches": self.lossy,
            "exact": self.exact,
            "shares_reference_clips": self.shares_reference,
            "floor": self.floor,
            "passed": None if self.floor else self.passed,
            "set": self.aggregates,
            "checks": [c.as_dict() for c in self.checks],
            "clips": [c.as_dict() for c in self.clips],
        }


def judge(result: ArmResult, thresholds: Thresholds, floor: dict[str, float] | None) -> list[Check]:
    """The checks of one arm: every set metric against its limit and, for an exact arm, bit-identical clips."""
    agg = result.aggregates
    checks = []
    for metric in METRICS:
        limit, rule = thresholds.limit(metric, floor)
        checks.append(Check(metric, float(agg[metric]), float(limit), rule))
    if result.exact:
        differing = agg["clips"] - agg["identical_clips"]
        checks.append(Check("differing_clips", float(differing), 0.0, "exact: decoded video and audio bit-identical"))
    return checks
