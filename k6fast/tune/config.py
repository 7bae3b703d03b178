"""One `k6fast tune` run's settings, and every check that needs nothing heavy loaded: bad input is refused in a fraction
of a second, before PyTorch, the model or LPIPS load (`run.py` runs the search)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from ..bench.workload import parse_geometry as bench_geometry
from ..checkpoint import Checkpoint, open_checkpoint
from ..quality_gate.config import GateConfig, validate_config
from ..quality_gate.thresholds import Thresholds
from ..switches import PIFLOW_CACHE_STEPS, read_arm, resolve_arm
from .search import Space, TuneError
from .space import KNOBS, build_space

RANDOM_BACKBONE = "random"  # the gate's seeded random LPIPS trunk (quality_gate/lpips_metric.py RANDOM)
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# The gate's default LPIPS worst-frame limit over its set-mean limit, and the other audio limits over the log-mel one:
# --lpips-max and --audio-max move each family of limits together, keeping the gate's proportions.
_GATE = Thresholds()


@dataclass(frozen=True)
class TuneConfig:
    model: str
    prompts: Path
    lpips_max: float
    out: Path
    audio_max: float | None = None
    budget: int = 6
    knobs: tuple[str, ...] = KNOBS
    base_arm: str = "reference"
    reference: str = "reference"
    geometry: tuple[int, int, int] = (864, 480, 121)
    steps: int | None = None
    seeds: tuple[int, ...] = (42,)
    backbone: str | None = None  # None: the torch hub cache; a path; or "random" (with test=True only)
    test: bool = False
    device: str | None = None
    dtype: str | None = None
    name: str = "tuned"
    command: str = ""  # the `k6fast tune` line that repeats this run, for the record

    @property
    def thresholds(self) -> Thresholds:
        """The gate's limits, scaled: LPIPS mean = --lpips-max (worst frame in the gate's proportion); with
        --audio-max, log-mel = that many dB (the worst quarter second and MR-STFT in the gate's proportion)."""
        lpips = {"lpips_mean": self.lpips_max, "lpips_worst": self.lpips_max * _GATE.lpips_worst / _GATE.lpips_mean}
        audio = {}
        if self.audio_max is not None:
            k = self.audio_max / _GATE.log_mel_db
            audio = {
                "log_mel_db": self.audio_max,
                "log_mel_worst_db": _GATE.log_mel_worst_db * k,
                "mrstft": _GATE.mrstft * k,
            }
        return Thresholds(**lpips, **audio)

    @property
    def plumbing_only(self) -> bool:
        return self.backbone == RANDOM_BACKBONE


def parse_geometry(text: str) -> tuple[int, int, int]:
    """`w1`, `smoke` or WIDTHxHEIGHTxFRAMES: `k6fast bench`'s --geometry, checked the same way."""
    try:
        geometry = bench_geometry(text)
    except ValueError as exc:
        raise TuneError(str(exc)) from None
    return geometry.width, geometry.height, geometry.frames


def check_prompts(path: Path) -> int:
    """The prompt set must be a readable JSON object with a non-empty "prompts" list (the gate checks each entry);
    returns how many prompts it holds."""
    if not path.is_file():
        raise TuneError(f"--prompts {path}: no such file; expected a prompt set JSON such as quality_gate/setA.json")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TuneError(f"--prompts {path}: expected a readable JSON file ({exc})") from None
    prompts = data.get("prompts") if isinstance(data, dict) else None
    if not isinstance(prompts, list) or not prompts:
        raise TuneError(f'--prompts {path}: expected an object with a non-empty "prompts" list, found none')
    return len(prompts)


def gate_config(config: TuneConfig, arm: str, out: Path) -> GateConfig:
    """The gate run that scores one arm against the reference, writing its report into `out`."""
    width, height, frames = config.geometry
    return GateConfig(
        model=config.model,
        out=out,
        arms=[arm],
        reference=config.reference,
        prompts=config.prompts,
        seeds=list(config.seeds),
        width=width,
        height=height,
        frames=frames,
        steps=config.steps,
        thresholds=config.thresholds,
        backbone=config.backbone,
        device=config.device,
        dtype=config.dtype,
    )


def validate(config: TuneConfig) -> None:
    """Everything that can be refused before anything heavy loads; raises TuneError (GateError for what the gate
    refuses, SwitchError for an arm, CheckpointError for the model, RequestError for the geometry)."""
    if not (math.isfinite(config.lpips_max) and config.lpips_max > 0):
        raise TuneError(f"--lpips-max: expected a number > 0 (the LPIPS set-mean limit), found {config.lpips_max}")
    if config.audio_max is not None and not (math.isfinite(config.audio_max) and config.audio_max > 0):
        raise TuneError(f"--audio-max: expected a number > 0 (the log-mel limit in dB), found {config.audio_max}")
    if config.budget < 1:
        raise TuneError(f"--budget: expected at least 1 gate run, found {config.budget}")
    if config.steps is not None and config.steps < 1:
        raise TuneError(f"--steps: expected an integer >= 1, found {config.steps}")
    if not config.seeds:
        raise TuneError("--seeds: expected at least one seed")
    if not _NAME_RE.fullmatch(config.name):
        raise TuneError(f"--name {config.name!r}: expected letters, digits, '.', '_' or '-' (it names the .env file)")
    if config.plumbing_only and not config.test:
        raise TuneError(
            "--lpips-backbone random measures nothing (the gate's plumbing only), so its verdicts cannot choose an "
            "arm; give the AlexNet weights (--lpips-backbone PATH or the torch hub cache), or add --test for a "
            "plumbing run"
        )
    if config.out.exists() and not config.out.is_dir():
        raise TuneError(f"--out {config.out}: exists and is not a directory")
    unknown = [k for k in config.knobs if k not in KNOBS]
    if unknown or not config.knobs:
        raise TuneError(
            f"--knobs: expected a comma-separated subset of {', '.join(KNOBS)}, found {','.join(config.knobs)}"
        )
    check_prompts(config.prompts)
    # The gate's own checks: geometry (and LPIPS's smallest frame), both arms, the checkpoint's files.
    validate_config(gate_config(config, config.base_arm, config.out))
    space_for(config)  # the knobs against this checkpoint, and the base arm against the knobs


def space_for(config: TuneConfig) -> tuple[Space, list[str], Checkpoint]:
    """The search space over the base arm for this checkpoint and schedule, the notes on knobs left out, and the
    checkpoint (headers and configs only)."""
    ckpt = open_checkpoint(config.model)
    steps = config.steps if config.steps is not None else ckpt.default_steps
    base = read_arm(resolve_arm(config.base_arm))
    if not ckpt.distilled:  # not applied on a base checkpoint (`fixed_cache_steps`): neither a lossy base nor a skip
        base.pop(PIFLOW_CACHE_STEPS.name, None)
    space, notes = build_space(
        base, steps=steps, num_blocks=ckpt.dit.num_visual_blocks, distilled=ckpt.distilled, knobs=config.knobs
    )
    return space, notes, ckpt
