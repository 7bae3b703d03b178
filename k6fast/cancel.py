"""Stopping a request part-way: a `should_stop` callable handed down with the request and checked where the work can
stop without leaving anything half-made.

Where it is checked: before each phase of `Pipeline.generate`, before each denoising step, between the DiT's fused
blocks, between the video decode's ops (and its slabs and tiles), and between the frames of the MP4 mux. So a stop
takes effect within one fused block, one decode op or one encoded frame, whichever phase the request is in; the text
encoders, the audio decode and diffusers' tiled video decode run whole and are checked before and after.

`Cancelled` names the phase it stopped in and where, so that a server can log it; it is not an error of the request.
"""

from __future__ import annotations

from collections.abc import Callable

StopCheck = Callable[[], bool]


class Cancelled(RuntimeError):
    """The caller asked the request to stop. `phase`: the telemetry phase it stopped in (text_encode, denoise,
    video_decode, audio_decode, mux); `where`: the point within it (e.g. "step 3 of 10, before fused block 5 of 60")."""

    def __init__(self, phase: str, where: str = ""):
        super().__init__(f"cancelled during {phase}" + (f" ({where})" if where else ""))
        self.phase = phase
        self.where = where


def check_stop(should_stop: StopCheck | None, phase: str, where: str = "") -> None:
    """Raise `Cancelled(phase, where)` when `should_stop` says so; nothing when it is None."""
    if should_stop is not None and should_stop():
        raise Cancelled(phase, where)
