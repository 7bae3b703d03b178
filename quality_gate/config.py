"""One gate run's settings and the checks that need nothing loaded: `k6fast gate` refuses bad arguments with them in a
fraction of a second, before PyTorch, LPIPS or the model load (`gate.py` runs the gate)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint import open_checkpoint
from ..request import validate_geometry
from ..switches import load_options
from . import GateError
from .thresholds import Thresholds

SET_A = Path(__file__).resolve().parent / "setA.json"  # the packaged prompt set
MIN_SIZE = 32  # LPIPS's AlexNet trunk needs frames of at least this many pixels a side


@dataclass(frozen=True)
class GateConfig:
    """One gate run. The report lists the `arms` in order, then the `exact` arms."""

    model: str
    out: Path  # the report and the clip cache
    arms: list[str] = field(default_factory=list)
    exact: list[str] = field(default_factory=list)
    reference: str = "reference"
    prompts: Path = SET_A
    seeds: list[int] = field(default_factory=lambda: [42])
    width: int = 864
    height: int = 480
    frames: int = 121
    steps: int | None = None
    floor: bool = False
    thresholds: Thresholds = field(default_factory=Thresholds)
    backbone: str | None = None  # None: torch hub cache; a path; or "random" (tests only)
    device: str | None = None
    dtype: str | None = None
    regenerate: bool = False


def validate_config(config: GateConfig) -> None:
    """What can be checked before anything loads: raises GateError (RequestError for the geometry, SwitchError for
    an arm, CheckpointError for the model)."""
    if not config.arms and not config.exact and not config.floor:
        raise GateError("nothing to do: expected at least one --arm, --exact or --floor")
    if config.thresholds.relative is not None and not config.floor:
        raise GateError("--relative K compares against the noise floor: add --floor")
    if not config.seeds:
        raise GateError("expected at least one seed")
    validate_geometry(config.width, config.height, config.frames)
    if min(config.width, config.height) < MIN_SIZE:
        raise GateError(
            f"LPIPS (AlexNet) needs frames of at least {MIN_SIZE}x{MIN_SIZE}, found {config.width}x{config.height}"
        )
    for spec in (config.reference, *config.arms, *config.exact):
        load_options(environ={}, arm=spec)  # SwitchError for an unknown arm or a bad file, as the gate's own load
    open_checkpoint(config.model)  # CheckpointError for a missing or broken checkpoint: configs and headers only
