"""Shared by the tests that run the tiny pipeline on the CPU: the prompt and conditioning image the golden set and
the parity test generate from, a one-thread scope for CPU runs, the rounding bound that outputs computed on another
CPU are held to, and a DiT wrapper that counts its calls (the step caches' tests).

The rounding bound. PyTorch's float32 CPU kernels differ by instruction set (AVX-512, AVX2, the scalar `default`
kernels; `ATEN_CPU_CAPABILITY` picks one): they order their sums and evaluate exp and tanh differently, so the same
computation rounds differently. One rounding moves a value by at most u = 2**-24 of its size. Along a chain of D
dependent roundings the errors add up; Higham and Mary's probabilistic analysis ("A New Approach to Probabilistic
Rounding Error Analysis", SIAM J. Sci. Comput. 41(5), 2019) bounds the accumulated relative error by lambda * sqrt(D)
* u with probability at least 1 - 2 * exp(-lambda**2 / 2), 0.9993 for lambda = 4. Two evaluations, each within that
of the exact result, differ by at most twice as much, relative to the output's magnitude M:

    |a - b| <= 2 * lambda * sqrt(D) * u * M

D is measured, not guessed: `RoundingDepth` counts the longest chain of float-producing ops behind a request's outputs
(each op rounds its result at most once, so the count errs on the long side). The analysis assumes errors that
neither grow nor shrink through the layers, which a network with normalisation layers roughly keeps; the golden test
checks the bound both ways, against the kernels of other instruction sets (CI runs it under `avx2` and `default`) and
against real changes to the computation, which must fall outside it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import PIL.Image

PROMPT = "A brass band marches down a rainy street, trumpets echoing off the walls"
UNIT_ROUNDOFF = 2.0**-24  # float32, round to nearest
LAMBDA = 4.0


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


def rounding_bound(depth: int, magnitude: float) -> float:
    """How far two float32 evaluations of one computation of rounding depth `depth` may differ, for outputs of
    magnitude `magnitude` (the module docstring derives it)."""
    return 2.0 * LAMBDA * math.sqrt(depth) * UNIT_ROUNDOFF * magnitude


def rounding_depth(run) -> tuple[object, int]:
    """(run(), the longest chain of float-producing ATen ops behind anything `run` computed)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from torch.utils.weak import WeakIdKeyDictionary

    class RoundingDepth(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.depth: WeakIdKeyDictionary = WeakIdKeyDictionary()
            self.deepest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            depth = max((self.depth.get(t, 0) for t in inputs), default=0)
            if not func.is_view and any(t.is_floating_point() for t in outputs):
                depth += 1
            for t in outputs:  # an in-place op returns the tensor it changed, which gets the new depth
                self.depth[t] = depth
            self.deepest = max(self.deepest, depth)
            return out

    mode = RoundingDepth()
    with mode:
        result = run()
    return result, mode.deepest


class CountingDiT:
    """Wraps a pipeline's DiT and counts its forward calls; what the pipeline tells the DiT per step and per request
    (`begin_step`, `should_stop`) reaches the wrapped one."""

    def __init__(self, dit):
        self.dit = dit
        self.calls = 0

    def __call__(self, **kwargs):
        self.calls += 1
        return self.dit(**kwargs)

    def begin_step(self, *args) -> None:
        self.dit.begin_step(*args)

    def __setattr__(self, name, value):
        if name == "should_stop":  # the pipeline sets it per request on the DiT it holds
            setattr(self.dit, name, value)
        super().__setattr__(name, value)
