"""The server's own settings (limits, defaults, where jobs live), fixed at start and handed to every part of it.

Switch values (the arm, the API key, the default data directory) come from `Options`; these are the server's
command-line settings. `ServerConfig` checks itself so that a limit that contradicts a default fails at start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

FPS = 24  # frames = seconds x FPS + 1 (the pipeline's frame rate)
DEFAULT_DATA_DIR = Path("k6fast-data")


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

    def __post_init__(self) -> None:
        problems = []
        if not self.served_model_name:
            problems.append("served_model_name must be non-empty")
        for name in ("max_queue", "max_frames", "max_steps", "max_upload_bytes", "poll_after_ms", "max_attempts"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                problems.append(f"{name} must be an integer >= 1, found {value!r}")
        for name in ("ttl_seconds", "reap_interval_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                problems.append(f"{name} must be a positive number of seconds, found {value!r}")
        if self.dtype not in (None, "bf16", "fp16", "fp32"):
            problems.append(f"dtype must be bf16, fp16 or fp32, found {self.dtype!r}")
        if not 0 <= self.port <= 65535:
            problems.append(f"port must be in [0, 65535], found {self.port}")
        if not problems and not fits(self.default_size, self.max_size):
            problems.append(
                f"the default size {fmt_size(self.default_size)} exceeds the maximum {fmt_size(self.max_size)}"
            )
        if problems:
            raise ValueError("invalid server settings: " + "; ".join(problems))

    @property
    def jobs_db(self) -> Path:
        return self.data_dir / "jobs.sqlite3"


def fmt_size(size: tuple[int, int]) -> str:
    return f"{size[0]}x{size[1]}"


def fits(size: tuple[int, int], limit: tuple[int, int]) -> bool:
    """True when `size` fits inside `limit` in either orientation (a 1280x720 limit admits 720x1280)."""
    return max(size) <= max(limit) and min(size) <= min(limit)


def seconds_for_frames(frames: int) -> str:
    """The `seconds` string reported for a frame count: (frames - 1) / 24, as short as it is exact to 3 places."""
    return f"{(frames - 1) / FPS:.3f}".rstrip("0").rstrip(".")
