"""How the acceptance and `serve` tables write a value: seconds, GiB and GB, and a request's phases."""

from __future__ import annotations

from ..memory import GiB


def secs(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def gib(value: int | None) -> str:
    return "—" if not value else f"{value / GiB:.2f}"


def gb(value: int | None) -> str:
    return "—" if value is None else f"{value / 1e9:.2f}"


# A request's phases in the order they run (the audio decode precedes the video decode: a streamed mux needs the
# whole waveform before the first frame).
PHASES = ("text_encode", "denoise", "audio_decode", "video_decode", "mux")
PHASES_HEADER = "text / denoise / audio / video decode / mux s"


def phase_split(phases: dict[str, float]) -> str:
    return " / ".join(secs(phases.get(k)) for k in PHASES)
