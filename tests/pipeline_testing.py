"""Shared by the tests that run the tiny pipeline on the CPU: the prompt and conditioning image the golden set and
the parity test generate from, and a one-thread scope for CPU runs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import PIL.Image

PROMPT = "A brass band marches down a rainy street, trumpets echoing off the walls"


def gradient_image() -> PIL.Image.Image:
    """An 96x80 RGB image of smooth gradients (the image-to-video condition)."""
    y, x = np.mgrid[0:80, 0:96]
    rgb = np.stack([x * 2.5, y * 3.0, (x + y) * 1.4], axis=-1).clip(0, 255).astype(np.uint8)
    return PIL.Image.fromarray(rgb)


@contextmanager
def one_thread() -> Iterator[None]:
    """PyTorch's CPU ops on one thread inside the block, the thread count restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
