"""What fits a memory budget, asked per request: the largest clip length at a size, the largest size at a length, and
the message that refuses a request by naming them.

Arithmetic over a `fits(width, height, frames)` predicate (the residency planner's and the decode planner's, from
the pipeline or `k6fast doctor`), so it needs no PyTorch and no device.
"""

from __future__ import annotations

from collections.abc import Callable

from .request import SPATIAL_MULTIPLE, TEMPORAL_STRIDE

Fits = Callable[[int, int, int], bool]
# The longest clip asked about: the server's own frame limit is the tighter bound in practice.
MAX_FRAMES = 4 * 240 + 1


def largest_frames(fits: Fits, width: int, height: int, limit: int = MAX_FRAMES) -> int | None:
    """The most frames (4k+1, at most `limit`) that fit at width x height; None when not even one frame does.
    Fitting only shrinks as frames grow (more tokens, more activations), so a binary search over k is exact."""
    if not fits(width, height, 1):
        return None
    low, high = 0, (limit - 1) // TEMPORAL_STRIDE  # fits at k = low; the answer is in [low, high]
    while low < high:
        mid = (low + high + 1) // 2
        if fits(width, height, mid * TEMPORAL_STRIDE + 1):
            low = mid
        else:
            high = mid - 1
    return low * TEMPORAL_STRIDE + 1


def largest_size(fits: Fits, width: int, height: int, frames: int) -> tuple[int, int] | None:
    """The largest size of about the same aspect (both sides multiples of 16, the longer one scaled down in steps
    of 16) at which `frames` fit; None when not even the smallest does."""
    long_side, short_side = max(width, height), min(width, height)
    for side in range(long_side, SPATIAL_MULTIPLE - 1, -SPATIAL_MULTIPLE):
        other = max(SPATIAL_MULTIPLE, round(side * short_side / long_side / SPATIAL_MULTIPLE) * SPATIAL_MULTIPLE)
        w, h = (side, other) if width >= height else (other, side)
        if fits(w, h, frames):
            return w, h
    return None


def oversize_message(fits: Fits, width: int, height: int, frames: int, budget: str) -> str:
    """Why width x height x frames is refused and what fits instead, for a 400 or a CLI error. `budget` names the
    budget in words (e.g. "this server's VRAM budget of 32.0 GiB")."""
    offers = []
    most = largest_frames(fits, width, height, frames)
    if most is not None:
        offers.append(f"at {width}x{height} at most {most} frames")
    size = largest_size(fits, width, height, frames)
    if size is not None:
        offers.append(f"at {frames} frames at most {size[0]}x{size[1]}")
    fits_what = "; ".join(offers) if offers else "no clip of this aspect fits"
    return f"{width}x{height} with {frames} frames does not fit {budget}: {fits_what} fit"
