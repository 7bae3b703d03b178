"""What `Pipeline.generate` hands a clip's frames to as the video decode finishes them, so that a consumer (the MP4
encoder of output.py, on its own thread) works while the decode goes on instead of after it."""

from __future__ import annotations

from typing import Protocol

import numpy as np
from torch import Tensor


class FrameSink(Protocol):
    def begin(
        self, num_frames: int, height: int, width: int, fps: float, audio: np.ndarray | None, sample_rate: int
    ) -> None:
        """Called once, before the first frame: the clip's frame count and size, and its whole decoded audio
        (float32 [N] mono as the vocoder made it, not normalised; None for a clip without audio)."""

    def frames(self, start: int, stop: int, frames: Tensor) -> None:
        """Frames [start, stop) of the clip, final: fp32 [stop - start, H, W, 3] in [0, 1] on the decode's device.
        Called in order, each frame once; the tensor is the decode's own output, to be read (copied) during the call
        and not changed. An exception raised here stops the decode and the request."""
