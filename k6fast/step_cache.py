"""The step cache for base checkpoints (K6_STEP_CACHE): MagCache's decision rule on k6fast's denoising loop.

A base checkpoint runs 50 flow-matching Euler steps with CFG, two DiT passes a step. A skipped step reuses the last
called step's prediction (both CFG branches, already combined; video and audio alike), so it costs no DiT work and
streams no blocks. Which steps to skip is decided from the model's own outputs, as MagCache does (Ma et al., "MagCache:
Fast Video Generation with Magnitude-Aware Cache", arXiv 2506.09045; the rule Kandinsky 5's official code runs on its
50-step models): the magnitude ratio of successive outputs, gamma_i = mean over tokens of |v_i| / |v_(i-1)|, falls
slowly and steadily for most of the schedule and fast at its end, and their directions barely change, so the error of
reusing v_j for steps j+1..i is modelled as |1 - gamma_(j+1) ... gamma_i|. Summed over the skipped run, it must stay
under K6_STEP_CACHE_THRESHOLD, and at most K6_STEP_CACHE_MAX_SKIP steps run skipped in a row. The first
K6_STEP_CACHE_RETENTION share of steps always runs (they set the layout), and so does the last (its prediction is
what the clip ends on; the ratios fall fastest there).

Why calibrated, and why no calibration means a refusal. The rule needs gamma at the steps it skips, where no
prediction exists. MagCache takes them from one calibration run per model (a single prompt suffices, the paper
finds: the curve is a property of the model and schedule, not the prompt). An online stand-in would extrapolate the
last measured ratio into the steps ahead, which is exactly where the law's fast final drop breaks it; TeaCache's
online signal (the relative change of the first block's modulated input) needs a polynomial fitted per model on
many prompts, a heavier calibration of the same kind, and a hook inside the DiT forward. So k6fast calibrates:
`K6_STEP_CACHE=calibrate` runs every step (nothing is skipped, the output is the plain run's) and records every
series' ratios for this checkpoint (a fingerprint of its transformer config and weight files) and step count, in
K6_STEP_CACHE_DIR or beside the checkpoint; `K6_STEP_CACHE=magcache` reads them and refuses, before any work, a
request it has no calibration for (naming the command that makes one). A schedule too short to skip anything needs
none. Calibration files hold plain numbers; their digest and the steps skipped go into each request's telemetry,
since the arm hash cannot cover a file's contents.

The series: video and audio predictions, each CFG branch (cond, and uncond when guidance > 1). A step is skipped only
if every series' accumulated error stays under the threshold, so both CFG passes and both streams skip together.
The reused quantity is the prediction itself, and the ratios are measured on the predictions, so the signal and what
is reused are the same thing; MagCache's own code reuses the block stack's hidden-state residual and re-runs the
head, which would need the DiT forward to expose that residual. Calibrated under one arm, the ratios are used under
any arm on the same checkpoint (the law is a property of the model; re-calibrate under the arm to be exact).

Distilled (PiFlow) checkpoints are refused: 10 policy steps leave nothing of the published setting (a retention
share of 50 Euler steps, CFG branches), and their fixed cache is K6_PIFLOW_CACHE_STEPS. That fixed cache is the
distilled schedule's only (`fixed_cache_steps`): its steps were chosen on the 10-step schedule, and step 8 of 50 Euler
steps lies inside the first 20 % that MagCache never skips, so a base checkpoint does not apply it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .atomic import write_json_atomic
from .switches import PIFLOW_CACHE_STEPS

if TYPE_CHECKING:
    from .checkpoint import Checkpoint
    from .switches import Options

CALIBRATION_FORMAT = "k6fast-magcache-calibration"
CALIBRATION_VERSION = 1
DEFAULT_DIR_NAME = "k6fast-step-cache"
STREAMS = ("video", "audio")
BRANCHES = ("cond", "uncond")


class StepCacheError(ValueError):
    """A step-cache setting that cannot run with this checkpoint or request; the message says what would."""


def series_names(cfg: bool, audio: bool) -> tuple[str, ...]:
    """The prediction series a run produces: `video.cond`, plus `video.uncond` with CFG, plus the audio ones."""
    branches = BRANCHES if cfg else BRANCHES[:1]
    streams = STREAMS if audio else STREAMS[:1]
    return tuple(f"{stream}.{branch}" for stream in streams for branch in branches)


def checkpoint_fingerprint(ckpt: Checkpoint) -> str:
    """16 hex digits naming the transformer: its config.json and its weight files' names and sizes (not their
    contents: a calibration is checked per request, and hashing 56 GB of weights would take minutes)."""
    digest = hashlib.sha256((ckpt.root / "transformer" / "config.json").read_bytes())
    for file in sorted(ckpt.transformer_files):
        digest.update(f"\n{file.name}:{file.stat().st_size}".encode())
    return digest.hexdigest()[:16]


def calibration_path(ckpt: Checkpoint, options: Options, steps: int) -> Path:
    folder = options.step_cache_dir or ckpt.root / DEFAULT_DIR_NAME
    return Path(folder) / f"magcache-{checkpoint_fingerprint(ckpt)}-{steps}steps.json"


def retained_steps(num_steps: int, retention: float) -> int:
    """How many first steps always run: the retention share (rounded down, as MagCache does), at least step 0."""
    return max(1, int(num_steps * retention))


def can_skip(num_steps: int, options: Options) -> bool:
    """Whether magcache could skip any step of this schedule (else it needs no calibration and runs every step)."""
    return (
        options.step_cache_threshold > 0.0 and retained_steps(num_steps, options.step_cache_retention) < num_steps - 1
    )


@dataclass(frozen=True)
class Calibration:
    """One checkpoint's magnitude ratios at one step count. ratios[series][i] = gamma_i (index 0 is 1.0: step 0 has
    no predecessor); cosine[series][i] = mean cosine distance of the same pair, kept to check the law's premise."""

    fingerprint: str
    steps: int
    ratios: dict[str, tuple[float, ...]]
    cosine: dict[str, tuple[float, ...]] = field(default_factory=dict)
    geometry: tuple[int, int, int] = (0, 0, 0)  # width, height, frames of the calibration run
    guidance: float = 1.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "format": CALIBRATION_FORMAT,
            "version": CALIBRATION_VERSION,
            "checkpoint": self.fingerprint,
            "steps": self.steps,
            "geometry": list(self.geometry),
            "guidance": self.guidance,
            "ratios": {k: list(v) for k, v in self.ratios.items()},
            "cosine_distance": {k: list(v) for k, v in self.cosine.items()},
        }

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def save(self, path: Path) -> None:
        try:
            write_json_atomic(path, self.as_dict())
        except OSError as exc:
            raise StepCacheError(f"K6_STEP_CACHE=calibrate could not write {path}: {exc}") from exc


def load_calibration(path: Path, fingerprint: str, steps: int) -> Calibration:
    """Read and check a calibration file; raises StepCacheError naming the file and what is wrong."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StepCacheError(f"cannot read the MagCache calibration {path}: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != CALIBRATION_FORMAT:
        raise StepCacheError(f"{path} is not a k6fast MagCache calibration (no format {CALIBRATION_FORMAT!r})")
    if data.get("version") != CALIBRATION_VERSION:
        raise StepCacheError(f"{path}: calibration version {data.get('version')!r}, expected {CALIBRATION_VERSION}")
    if data.get("checkpoint") != fingerprint or data.get("steps") != steps:
        raise StepCacheError(
            f"{path} calibrates checkpoint {data.get('checkpoint')} at {data.get('steps')} steps, expected "
            f"{fingerprint} at {steps}"
        )
    ratios = _series(path, data.get("ratios"), steps, "ratios")
    cosine = _series(path, data.get("cosine_distance", {}), steps, "cosine_distance")
    try:
        geometry = tuple(int(x) for x in data.get("geometry", (0, 0, 0)))
        guidance = float(data.get("guidance", 1.0))
    except (TypeError, ValueError):
        raise StepCacheError(f"{path}: geometry must be 3 integers and guidance a number") from None
    return Calibration(fingerprint, steps, ratios, cosine, geometry, guidance)


def _series(path: Path, raw: object, steps: int, key: str) -> dict[str, tuple[float, ...]]:
    if not isinstance(raw, dict):
        raise StepCacheError(f"{path}: {key} must map series names to lists of {steps} numbers")
    out = {}
    for name, values in raw.items():
        ok = isinstance(values, list) and len(values) == steps
        ok = ok and all(isinstance(v, int | float) and math.isfinite(v) and v >= 0 for v in values)
        if not ok:
            raise StepCacheError(f"{path}: {key}[{name!r}] must be {steps} finite numbers >= 0")
        out[name] = tuple(float(v) for v in values)
    return out


def fixed_cache_steps(ckpt: Checkpoint, options: Options) -> tuple[int, ...]:
    """The steps K6_PIFLOW_CACHE_STEPS skips on this checkpoint: its steps on a distilled (PiFlow) checkpoint, none on
    a base one (whose step cache is K6_STEP_CACHE; see the module docstring)."""
    return options.piflow_cache_steps if ckpt.distilled else ()


def fixed_cache_note(ckpt: Checkpoint, options: Options) -> str | None:
    """What a run on this checkpoint says about K6_PIFLOW_CACHE_STEPS where it does not apply it; None where it does
    (or where it is empty)."""
    if ckpt.distilled or not options.piflow_cache_steps:
        return None
    shown = ",".join(map(str, options.piflow_cache_steps))
    return (
        f"{PIFLOW_CACHE_STEPS.name}={shown} not applied: it is the distilled (PiFlow) schedule's fixed cache, and "
        "this is a base checkpoint (flow-matching Euler, CFG), whose step cache is K6_STEP_CACHE (the fast-base arm)"
    )


def check_request(ckpt: Checkpoint, options: Options, steps: int, guidance: float, audio: bool) -> None:
    """Refuse, before any work, a step-cache setting this checkpoint or request cannot run; raises StepCacheError."""
    mode = options.step_cache
    if mode == "off":
        return
    if ckpt.distilled:
        raise StepCacheError(
            f"K6_STEP_CACHE={mode} is for base checkpoints (flow-matching Euler, CFG); this one is distilled (PiFlow, "
            f"{ckpt.default_steps} steps): its step cache is K6_PIFLOW_CACHE_STEPS, and arms that set K6_STEP_CACHE "
            "(fast-base) are for base checkpoints only"
        )
    if mode == "magcache" and can_skip(steps, options):
        calibration_for(ckpt, options, steps, series_names(guidance > 1.0, audio))


def calibration_for(ckpt: Checkpoint, options: Options, steps: int, series: Sequence[str]) -> Calibration:
    """The calibration magcache needs for this run, checked to hold every series it produces."""
    path = calibration_path(ckpt, options, steps)
    if not path.is_file():
        raise StepCacheError(
            f"K6_STEP_CACHE=magcache has no calibration for this checkpoint at {steps} steps (expected {path}); make "
            f"one by running a request once with K6_STEP_CACHE=calibrate and the same steps (nothing is skipped), "
            f"e.g. K6_STEP_CACHE=calibrate k6fast generate --model {ckpt.root} --steps {steps} --prompt ... --out x.mp4"
        )
    calibration = load_calibration(path, checkpoint_fingerprint(ckpt), steps)
    missing = [name for name in series if name not in calibration.ratios]
    if missing:
        raise StepCacheError(
            f"{path} was calibrated without {', '.join(missing)} (with CFG and audio as this request needs); "
            "re-run the calibration with them"
        )
    return calibration


@dataclass
class MagCache:
    """MagCache's decision for one request: `call(step)` says whether the DiT runs at that step. Every call is
    recorded (`record`), with the estimated error a skip carried; `observe` adds the ratio a called step measured
    against the calibrated one (how far this request is from the calibration)."""

    ratios: Mapping[str, Sequence[float]]  # only the series this run produces
    num_steps: int
    threshold: float
    max_skip: int
    retention: float
    record: list[dict[str, Any]] = field(default_factory=list)
    _product: dict[str, float] = field(default_factory=dict)
    _error: dict[str, float] = field(default_factory=dict)
    _skipped: int = 0

    def __post_init__(self) -> None:
        self._retained = retained_steps(self.num_steps, self.retention)
        self._reset()

    def _reset(self) -> None:
        self._product = dict.fromkeys(self.ratios, 1.0)
        self._error = dict.fromkeys(self.ratios, 0.0)
        self._skipped = 0

    def call(self, step: int) -> bool:
        if step < self._retained or step == self.num_steps - 1:
            self._reset()
            self.record.append({"step": step, "called": True, "why": "first" if step < self._retained else "last"})
            return True
        for name, gammas in self.ratios.items():
            self._product[name] *= gammas[step]
            self._error[name] += abs(1.0 - self._product[name])
        self._skipped += 1
        error = max(self._error.values())
        if error < self.threshold and self._skipped <= self.max_skip:
            self.record.append({"step": step, "called": False, "error": round(error, 6)})
            return False
        why = "error" if error >= self.threshold else "max_skip"
        self.record.append({"step": step, "called": True, "why": why, "error": round(error, 6)})
        self._reset()
        return True

    def observe(self, step: int, since: int, measured: Mapping[str, float]) -> None:
        """A called `step` measured `measured[series]` = mean |v_step| / |v_since| against the last called step."""
        expected = {name: math.prod(self.ratios[name][since + 1 : step + 1]) for name in self.ratios}
        drift = max(
            (abs(measured[name] / expected[name] - 1.0) for name in self.ratios if expected[name] > 0), default=0.0
        )
        self.record[-1]["drift"] = round(drift, 6)

    @property
    def skipped_steps(self) -> list[int]:
        return [entry["step"] for entry in self.record if not entry["called"]]


def magcache_for(calibration: Calibration, options: Options, num_steps: int, series: Sequence[str]) -> MagCache:
    return MagCache(
        ratios={name: calibration.ratios[name] for name in series},
        num_steps=num_steps,
        threshold=options.step_cache_threshold,
        max_skip=options.step_cache_max_skip,
        retention=options.step_cache_retention,
    )


@dataclass
class StepCacheRun:
    """What one request's denoising skips: the `fixed` steps (K6_PIFLOW_CACHE_STEPS, distilled checkpoints), the steps
    `magcache` decides (K6_STEP_CACHE, base ones); `measure` records a calibration to `path`. `finish` writes the
    calibration (calibrate) and returns the telemetry entry."""

    mode: str
    fixed: tuple[int, ...] = ()  # the steps K6_PIFLOW_CACHE_STEPS skips here (`fixed_cache_steps`)
    magcache: MagCache | None = None
    measure: bool = False
    path: Path | None = None
    fingerprint: str = ""
    digest: str = ""

    def finish(
        self,
        ratios: Mapping[str, Sequence[float]],
        cosine: Mapping[str, Sequence[float]],
        geometry: tuple[int, int, int],
        guidance: float,
    ) -> dict[str, Any]:
        entry: dict[str, Any] = {"mode": self.mode}
        if self.measure:
            steps = len(next(iter(ratios.values()), ()))
            calibration = Calibration(
                self.fingerprint,
                steps,
                {k: tuple(v) for k, v in ratios.items()},
                {k: tuple(v) for k, v in cosine.items()},
                geometry,
                guidance,
            )
            calibration.save(self.path)
            entry.update(calibration=str(self.path), digest=calibration.digest())
        elif self.magcache is not None:
            entry.update(calibration=str(self.path), digest=self.digest, decisions=self.magcache.record)
            entry["skipped_steps"] = self.magcache.skipped_steps
        return entry


def plan_run(ckpt: Checkpoint, options: Options, steps: int, guidance: float, audio: bool) -> StepCacheRun:
    """The step cache of one request (checked as `check_request` does; raises StepCacheError)."""
    check_request(ckpt, options, steps, guidance, audio)
    mode = options.step_cache
    if mode == "calibrate":
        if steps < 2:
            raise StepCacheError(f"K6_STEP_CACHE=calibrate needs at least 2 steps to measure a ratio, found {steps}")
        path = calibration_path(ckpt, options, steps)
        try:  # before any work: a calibration that cannot be kept is a request not worth running
            path.parent.mkdir(parents=True, exist_ok=True)
            writable = os.access(path.parent, os.W_OK)
        except OSError:
            writable = False
        if not writable:
            raise StepCacheError(
                f"K6_STEP_CACHE=calibrate cannot write to {path.parent}; expected a writable folder: set "
                "K6_STEP_CACHE_DIR to one"
            )
        return StepCacheRun(mode, measure=True, path=path, fingerprint=checkpoint_fingerprint(ckpt))
    if mode == "magcache" and can_skip(steps, options):
        series = series_names(guidance > 1.0, audio)
        calibration = calibration_for(ckpt, options, steps, series)
        path = calibration_path(ckpt, options, steps)
        magcache = magcache_for(calibration, options, steps, series)
        return StepCacheRun(mode, magcache=magcache, path=path, digest=calibration.digest())
    return StepCacheRun(mode, fixed=fixed_cache_steps(ckpt, options))  # K6_STEP_CACHE runs on base checkpoints only
