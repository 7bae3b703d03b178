"""What fits a memory budget: the largest clip length at a size, the largest size at a length, the message that
refuses a request by naming them, and `FitTable`, the whole answer for one budget over a server's size grid, which a
`k6fast serve --ray` replica computes once and its ingress consults for every request.

Arithmetic over a `fits(width, height, frames)` predicate (the residency planner's and the decode planner's, from
the pipeline or `k6fast doctor`), so it needs no PyTorch and no device. Everything here rests on one premise:
fitting only shrinks as the width, the height or the frame count grows (every DiT token count and every decode
tensor grows with each), so a boundary found by bisection is the exact one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from .memory import GiB
from .request import SPATIAL_MULTIPLE, TEMPORAL_STRIDE

Fits = Callable[[int, int, int], bool]
# The longest clip asked about: the server's own frame limit is the tighter bound in practice.
MAX_FRAMES = 4 * 240 + 1
EXACT_DECODE_HINT = (
    "; the exact video decode is what does not fit: K6_VIDEO_DECODE=streamed (slabs with running GroupNorm "
    "statistics) or tiled would fit a larger clip"
)


def _most_k(fits: Fits, width: int, height: int, low: int, high: int) -> int:
    """The largest k in [low, high] at which 4k+1 frames fit, given that k = low fits (low = -1: none, which always
    "fits"). Bisection: exact because fitting only shrinks as frames grow."""
    while low < high:
        mid = (low + high + 1) // 2
        if fits(width, height, mid * TEMPORAL_STRIDE + 1):
            low = mid
        else:
            high = mid - 1
    return low


def largest_frames(fits: Fits, width: int, height: int, limit: int = MAX_FRAMES) -> int | None:
    """The most frames (4k+1, at most `limit`) that fit at width x height; None when not even one frame does."""
    if not fits(width, height, 1):
        return None
    return _most_k(fits, width, height, 0, (limit - 1) // TEMPORAL_STRIDE) * TEMPORAL_STRIDE + 1


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


def vram_budget(budgets: Iterable[int]) -> str:
    """One or more VRAM budgets (bytes) in words, for `oversize_message`: several when replicas differ."""
    shown = sorted({f"{b / GiB:.1f}" for b in budgets}, key=float)
    if len(shown) == 1:
        return f"the VRAM budget of {shown[0]} GiB (K6_VRAM_BUDGET_GB)"
    return f"the VRAM budget of any replica ({' or '.join(shown)} GiB; K6_VRAM_BUDGET_GB)"


def oversize_message(
    fits: Fits, width: int, height: int, frames: int, budget: str, dit_fits: Fits | None = None
) -> str:
    """Why width x height x frames is refused and what fits instead, for a 400 or a CLI error. `budget` names the
    budget in words (`vram_budget`, or e.g. "a 32.0 GiB budget"). `dit_fits`: whether the DiT alone fits; where it
    does, the exact video decode is what does not, and the message says so."""
    offers = []
    most = largest_frames(fits, width, height, frames)
    if most is not None:
        offers.append(f"at {width}x{height} at most {most} frames")
    size = largest_size(fits, width, height, frames)
    if size is not None:
        offers.append(f"at {frames} frames at most {size[0]}x{size[1]}")
    fits_what = "; ".join(offers) if offers else "no clip of this aspect fits"
    message = f"{width}x{height} with {frames} frames does not fit {budget}: {fits_what} fit"
    if dit_fits is not None and dit_fits(width, height, frames):
        message += EXACT_DECODE_HINT
    return message


class FitModel(Protocol):
    """What `fit_table` reads from a pipeline: its two fit predicates and its budget."""

    budget_bytes: int

    def fits(self, width: int, height: int, frames: int) -> bool: ...

    def dit_fits(self, width: int, height: int, frames: int) -> bool: ...


@dataclass(frozen=True)
class FitTable:
    """What fits one budget, exactly, for every size up to side x side (both sides multiples of 16) and every frame
    count up to `max_frames`: `most[j * n + i]` is the most frames that fit at width 16(i+1) x height 16(j+1)
    (0: not one), n = side / 16. `dit_most` is the same for the DiT alone where that differs (the exact video
    decode binds somewhere), else None. Plain tuples: a few tens of KB pickled for a 1280-pixel grid."""

    budget_bytes: int
    side: int
    max_frames: int
    most: tuple[int, ...]
    dit_most: tuple[int, ...] | None = None

    def _cell(self, width: int, height: int, frames: int) -> int:
        n = self.side // SPATIAL_MULTIPLE
        i, j = width // SPATIAL_MULTIPLE - 1, height // SPATIAL_MULTIPLE - 1
        if width % SPATIAL_MULTIPLE or height % SPATIAL_MULTIPLE or not (0 <= i < n and 0 <= j < n):
            raise ValueError(f"{width}x{height} is not in this fit table's grid (multiples of 16 up to {self.side})")
        if not 1 <= frames <= self.max_frames:
            raise ValueError(f"{frames} frames is outside this fit table's range [1, {self.max_frames}]")
        return j * n + i

    def fits(self, width: int, height: int, frames: int) -> bool:
        return frames <= self.most[self._cell(width, height, frames)]

    def dit_fits(self, width: int, height: int, frames: int) -> bool:
        return frames <= (self.dit_most or self.most)[self._cell(width, height, frames)]


def _staircase(fits: Fits, n: int, top_k: int, ceiling: Sequence[int] | None = None) -> list[int]:
    """The most k (frames 4k+1; -1: none) per cell of the n x n size grid, row-major by height. Fitting shrinks along
    each axis, so a rectangle whose smallest and largest corners agree is filled without a call; otherwise it is
    halved across its longer side. A budget that fits everything (or nothing) costs a call or two; one whose
    boundary moves from cell to cell about one and a half per cell, where a bisection per size would cost seven.
    `ceiling`: a k per cell known to bound this one (the DiT's alone)."""
    table = [0] * (n * n)

    def at(i: int, j: int, low: int, high: int) -> int:
        width, height = (i + 1) * SPATIAL_MULTIPLE, (j + 1) * SPATIAL_MULTIPLE
        if ceiling is not None:
            high = min(high, ceiling[j * n + i])
        if low >= high or fits(width, height, high * TEMPORAL_STRIDE + 1):
            return high
        return _most_k(fits, width, height, low, high - 1)

    def fill(i0: int, i1: int, j0: int, j1: int, top: int, bottom: int) -> None:
        # top: the k at (i0, j0), the rectangle's largest; bottom: at (i1, j1), its smallest.
        if top == bottom:
            for j in range(j0, j1 + 1):
                table[j * n + i0 : j * n + i1 + 1] = [top] * (i1 - i0 + 1)
        elif i1 - i0 >= j1 - j0:
            mid = (i0 + i1) // 2
            fill(i0, mid, j0, j1, top, at(mid, j1, bottom, top))
            fill(mid + 1, i1, j0, j1, at(mid + 1, j0, bottom, top), bottom)
        else:
            mid = (j0 + j1) // 2
            fill(i0, i1, j0, mid, top, at(i1, mid, bottom, top))
            fill(i0, i1, mid + 1, j1, at(i0, mid + 1, bottom, top), bottom)

    top = at(0, 0, -1, top_k)
    fill(0, n - 1, 0, n - 1, top, at(n - 1, n - 1, -1, top))
    return table


def fit_table(model: FitModel, side: int, max_frames: int) -> FitTable:
    """`model`'s FitTable over sizes up to side x side and up to `max_frames` frames (a server's limits: its
    `max(max_size)` and `max_frames`). The DiT's table first (its planner is cheap), then the whole pipeline's
    under it, so the decode planner is asked only where the DiT fits."""
    if side < SPATIAL_MULTIPLE or side % SPATIAL_MULTIPLE or max_frames < 1 or (max_frames - 1) % TEMPORAL_STRIDE:
        raise ValueError(f"expected a side that is a multiple of 16 and 4k+1 frames, found {side} and {max_frames}")
    n, top_k = side // SPATIAL_MULTIPLE, (max_frames - 1) // TEMPORAL_STRIDE
    dit = _staircase(model.dit_fits, n, top_k)
    both = _staircase(model.fits, n, top_k, ceiling=dit)

    def frames(ks: list[int]) -> tuple[int, ...]:
        return tuple(k * TEMPORAL_STRIDE + 1 if k >= 0 else 0 for k in ks)

    return FitTable(model.budget_bytes, side, max_frames, frames(both), None if dit == both else frames(dit))


def refusal(tables: Sequence[FitTable], width: int, height: int, frames: int) -> str | None:
    """None when a request fits some table's budget (or no table is known); else the message `Pipeline.check_fits`
    gives, built by `oversize_message` over what fits any of them."""
    if not tables:
        return None

    def fits(w: int, h: int, f: int) -> bool:
        return any(table.fits(w, h, f) for table in tables)

    if fits(width, height, frames):
        return None

    def dit_fits(w: int, h: int, f: int) -> bool:
        return any(table.dit_fits(w, h, f) for table in tables)

    budget = vram_budget(table.budget_bytes for table in tables)
    return oversize_message(fits, width, height, frames, budget, dit_fits)
