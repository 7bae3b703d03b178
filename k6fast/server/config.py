"""The server's own settings (limits, defaults, where jobs live), fixed at start and handed to every part of it.

Switch values (the arm, the API key, the default data directory) come from `Options`; these are the server's
command-line settings. `ServerConfig` checks every one of them so that a bad setting (a default size the pipeline
would refuse, a limit that contradicts a default) fails at start instead of in every request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..request import FPS as PIPELINE_FPS
from ..request import SPATIAL_MULTIPLE
from ..vae_geometry import TEMPORAL_STRIDE
from .errors import ApiError, bad_param

FPS = int(PIPELINE_FPS)  # frames = seconds x FPS + 1: the API's seconds in whole frames of the pipeline's rate
DEFAULT_DATA_DIR = Path("k6fast-data")
# The longest a duration setting may be (ten years): a job's expiry must stay a finite integer timestamp.
MAX_SECONDS_SETTING = 10 * 365 * 24 * 3600.0


@dataclass(frozen=True)
class ServerConfig:
    model: str  # --model as given (a directory or a Hub id)
    served_model_name: str  # what `model` in a request must be (or be left out)
    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 8094
    device: str | None = None
    dtype: str | None = None  # "bf16" | "fp16" | "fp32" | None (the pipeline's default)
    max_queue: int = 16  # queued jobs (not counting the one running) before POST answers 429
    max_size: tuple[int, int] = (1280, 720)  # either orientation: 720x1280 is allowed too
    max_frames: int = 241  # 10 s at 24 fps
    max_steps: int = 100
    default_size: tuple[int, int] = (864, 480)
    default_seconds: str = "5"  # 121 frames
    ttl_seconds: float = 24 * 3600.0  # a finished job's record and files live this long
    max_upload_bytes: int = 20 * 2**20
    poll_after_ms: int = 1000  # `openai-poll-after-ms`: how often a client should poll a job
    max_attempts: int = 3  # starts of one job across server crashes before it is failed instead of re-run
    reap_interval_s: float = 60.0  # how often expired jobs are looked for
    body_timeout_s: float = 60.0  # a create request's whole body must arrive within this (else 408)

    def __post_init__(self) -> None:
        problems = []
        for name in ("model", "served_model_name", "host"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip() or not value.isprintable():
                problems.append(f"{name} must be a non-empty printable string, found {value!r}")
        for name in ("max_queue", "max_frames", "max_steps", "max_upload_bytes", "poll_after_ms", "max_attempts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{name} must be an integer >= 1, found {value!r}")
        for name in ("ttl_seconds", "reap_interval_s", "body_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 < value <= MAX_SECONDS_SETTING:
                problems.append(
                    f"{name} must be a number of seconds in (0, {MAX_SECONDS_SETTING:.0f}], found {value!r}"
                )
        if self.dtype not in (None, "bf16", "fp16", "fp32"):
            problems.append(f"dtype must be bf16, fp16 or fp32, found {self.dtype!r}")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            problems.append(f"port must be in [0, 65535], found {self.port}")
        for name in ("max_size", "default_size"):
            problem = size_problem(getattr(self, name))
            if problem:
                problems.append(f"{name} {problem}")
        if isinstance(self.max_frames, int) and self.max_frames >= 1 and (self.max_frames - 1) % TEMPORAL_STRIDE:
            low = (self.max_frames - 1) // TEMPORAL_STRIDE * TEMPORAL_STRIDE + 1
            problems.append(
                f"max_frames must be a frame count of the form 4k+1, found {self.max_frames} (nearest valid: {low} "
                f"or {low + TEMPORAL_STRIDE})"
            )
        if not problems and not fits(self.default_size, self.max_size):
            problems.append(
                f"the default size {fmt_size(self.default_size)} exceeds the maximum {fmt_size(self.max_size)}"
            )
        if not problems:
            try:
                frames = frames_for_seconds(self.default_seconds)
            except ApiError as exc:
                problems.append(f"default_seconds: {exc.message}")
            else:
                if frames > self.max_frames:
                    problems.append(
                        f"default_seconds {self.default_seconds} gives {frames} frames, over max_frames "
                        f"{self.max_frames}"
                    )
        if problems:
            raise ValueError("invalid server settings: " + "; ".join(problems))

    @property
    def jobs_db(self) -> Path:
        return self.data_dir / "jobs.sqlite3"


@dataclass(frozen=True)
class Limits:
    """The request limits `k6fast serve` starts with when none are given: the API's largest on a GPU (what a request
    there may ask for; what the VRAM budget cannot fit is refused per request, naming what fits), and on the CPU
    what the tiny test checkpoints finish in about a minute, not hours (a 1280x720 CPU request's first step alone
    ran for minutes)."""

    max_size: tuple[int, int]
    max_frames: int
    max_steps: int
    default_size: tuple[int, int]
    default_seconds: str

    def describe(self) -> str:
        return (f"max size {fmt_size(self.max_size)}, max {self.max_frames} frames, max {self.max_steps} steps, "
                f"default {fmt_size(self.default_size)} for {self.default_seconds} s")  # fmt: skip


GPU_LIMITS = Limits((1280, 720), 241, 100, (864, 480), "5")
CPU_LIMITS = Limits((256, 256), 33, 20, (256, 144), "1")


def device_limits(cpu: bool, **given: object) -> Limits:
    """The limits for this device, with each one the user gave (not None) in place of its default."""
    base = CPU_LIMITS if cpu else GPU_LIMITS
    return Limits(**{name: given.get(name) if given.get(name) is not None else getattr(base, name)
                     for name in Limits.__dataclass_fields__})  # fmt: skip


def limits_of(config: ServerConfig) -> Limits:
    return Limits(config.max_size, config.max_frames, config.max_steps, config.default_size, config.default_seconds)


def fmt_size(size: tuple[int, int]) -> str:
    return f"{size[0]}x{size[1]}"


def size_problem(size: object) -> str | None:
    """What is wrong with a (width, height) setting, or None: each side a positive multiple of 16."""
    if not (isinstance(size, tuple) and len(size) == 2 and all(isinstance(v, int) for v in size)):
        return f"must be (width, height) in whole pixels, found {size!r}"
    bad = [
        f"{name} {value} is not a positive multiple of {SPATIAL_MULTIPLE}"
        for name, value in zip(("width", "height"), size, strict=True)
        if value < SPATIAL_MULTIPLE or value % SPATIAL_MULTIPLE
    ]
    return f"{fmt_size(size)}: {'; '.join(bad)}" if bad else None


def fits(size: tuple[int, int], limit: tuple[int, int]) -> bool:
    """True when `size` fits inside `limit` in either orientation (a 1280x720 limit admits 720x1280)."""
    return max(size) <= max(limit) and min(size) <= min(limit)


def seconds_for_frames(frames: int) -> str:
    """The `seconds` string reported for a frame count: (frames - 1) / 24, as short as it is exact to 3 places."""
    return f"{(frames - 1) / FPS:.3f}".rstrip("0").rstrip(".")


# Accept a seconds value whose x24 is this close to a whole frame count, so "0.333" means 9 frames.
_SECONDS_TOLERANCE = 0.015
_MAX_SECONDS = 86_400.0  # far beyond any clip; keeps seconds x 24 a float that rounds to an integer


def frames_for_seconds(text: str) -> int:
    """frames = seconds x 24 + 1, which must be 4k+1; raises ApiError (param `seconds`) otherwise."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or not 0 < value <= _MAX_SECONDS:
        raise bad_param(
            "seconds",
            f"seconds must be a positive number such as '5' (at most {_MAX_SECONDS:.0f}), found {str(text)[:40]!r}",
        )
    scaled = value * FPS
    whole = round(scaled)
    if abs(scaled - whole) <= _SECONDS_TOLERANCE and whole % TEMPORAL_STRIDE == 0 and whole > 0:
        return whole + 1
    low = math.floor(scaled / TEMPORAL_STRIDE) * TEMPORAL_STRIDE
    nearest = " or ".join(
        f"'{seconds_for_frames(f + 1)}' ({f + 1} frames)" for f in (low, low + TEMPORAL_STRIDE) if f > 0
    )
    raise bad_param(
        "seconds",
        f"seconds {str(text)[:40]!r} does not map to a valid frame count: frames = seconds x {FPS} + 1 must be of the "
        f"form 4k+1, so seconds x {FPS} must be a multiple of 4 (e.g. '5' -> 121 frames); nearest valid: {nearest}",
    )
