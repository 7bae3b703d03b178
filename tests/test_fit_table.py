"""`fit.FitTable`: what fits one VRAM budget over a server's size grid, computed once by a `serve --ray` replica and
consulted by its ingress for every request. The table must say exactly what `Pipeline.fits` says (checked on the
tiny pipeline where the DiT binds and where the exact video decode binds), refuse with exactly the message
`Pipeline.check_fits` gives, and cost calls in proportion to its fit boundaries rather than to its cells.
"""

from __future__ import annotations

import itertools
import pickle
from pathlib import Path

import pytest
from server_testing import budget_fitting

from k6fast.fit import fit_table, oversize_message, refusal, vram_budget
from k6fast.memory import GiB
from k6fast.request import Request, RequestError

SIDE, MAX_FRAMES = 640, 97  # the tiny pipeline's fit boundaries at the budgets below fall inside this grid
FRAME_COUNTS = range(1, MAX_FRAMES + 1, 4)


class Predicates:
    """A FitModel over plain functions, counting the calls the table makes."""

    def __init__(self, fits, dit_fits=None, budget_bytes: int = 32 * GiB):
        self._fits, self._dit_fits, self.budget_bytes = fits, dit_fits or fits, budget_bytes
        self.calls = 0

    def fits(self, w: int, h: int, f: int) -> bool:
        self.calls += 1
        return self._dit_fits(w, h, f) and self._fits(w, h, f)

    def dit_fits(self, w: int, h: int, f: int) -> bool:
        self.calls += 1
        return self._dit_fits(w, h, f)


def tokens_within(limit: int):
    """Fits while width/16 x height/16 x (latent frames + 1) stays within `limit`: the DiT planner's shape."""
    return lambda w, h, f: (w // 16) * (h // 16) * ((f - 1) // 4 + 2) <= limit


def cells(side: int):
    return itertools.product(range(16, side + 1, 16), repeat=2)


def test_the_table_holds_what_a_predicate_says_at_every_size_and_length() -> None:
    # A GPU server's grid (1280 either way, 241 frames): the DiT binds large clips, a stand-in decode (which grows
    # with frames x pixels, faster in height) binds some the DiT would take.
    model = Predicates(lambda w, h, f: w * h * h * f <= 640 * 360 * 360 * 121, tokens_within(80 * 45 * 32))
    table = fit_table(model, 1280, 241)
    assert table.dit_most is not None, "the decode binds somewhere: the DiT's table is kept beside"
    sent = pickle.dumps(table)  # what a replica sends the ingress with its card and each job's start
    assert pickle.loads(sent) == table and len(sent) < 64 * 1024
    for (w, h), f in itertools.product(cells(1280), range(1, 242, 4)):
        assert table.fits(w, h, f) == model.fits(w, h, f), (w, h, f)
        assert table.dit_fits(w, h, f) == model.dit_fits(w, h, f), (w, h, f)
    # Two tables (the DiT's, then the whole pipeline's) of 80 x 80 sizes whose boundary moves from cell to cell:
    # under two calls a cell each, where a bisection per size would take seven.
    model.calls = 0
    fit_table(model, 1280, 241)
    assert model.calls < 2 * 2 * 80 * 80


def test_a_budget_that_fits_everything_or_nothing_costs_a_few_calls() -> None:
    everything = Predicates(lambda w, h, f: True)
    table = fit_table(everything, 1280, 241)
    assert set(table.most) == {241} and table.dit_most is None
    assert everything.calls == 4  # the largest clip at the smallest and the largest size, for the DiT and for all
    nothing = Predicates(lambda w, h, f: False)
    table = fit_table(nothing, 1280, 241)
    assert set(table.most) == {0} and not table.fits(16, 16, 1)
    assert nothing.calls <= 8  # one bisection at 16x16: every larger size is known not to fit from it


def test_the_table_checks_its_grid_and_its_settings() -> None:
    table = fit_table(Predicates(tokens_within(2000)), 256, 33)
    for width, height, frames in ((272, 16, 1), (16, 0, 1), (24, 16, 1), (16, 16, 37), (16, 16, 0)):
        with pytest.raises(ValueError, match="this fit table's"):
            table.fits(width, height, frames)
    for side, frames in ((250, 33), (0, 33), (256, 35)):
        with pytest.raises(ValueError, match="multiple of 16 and 4k\\+1 frames"):
            fit_table(Predicates(tokens_within(2000)), side, frames)


def test_a_request_fits_when_one_replica_budget_fits_it() -> None:
    small = fit_table(Predicates(tokens_within(20 * 20 * 10), budget_bytes=24 * GiB), 640, 97)
    large = fit_table(Predicates(tokens_within(30 * 30 * 20), budget_bytes=80 * GiB), 640, 97)
    assert refusal([], 640, 640, 97) is None, "no table known: only the checkpoint's checks apply"
    assert refusal([small], 336, 336, 33) is not None and refusal([small, large], 336, 336, 33) is None
    both = refusal([small, large], 640, 640, 97)
    assert both == oversize_message(large.fits, 640, 640, 97, vram_budget([24 * GiB, 80 * GiB]), large.dit_fits)
    assert "does not fit the VRAM budget of any replica (24.0 or 80.0 GiB; K6_VRAM_BUDGET_GB)" in both
    assert refusal([small], 640, 640, 97) == oversize_message(
        small.fits, 640, 640, 97, "the VRAM budget of 24.0 GiB (K6_VRAM_BUDGET_GB)"
    )


def _pipeline(root: Path, budget_gb: float):
    from k6fast.pipeline import Pipeline
    from k6fast.switches import load_options

    options = load_options({"K6_VRAM_BUDGET_GB": repr(budget_gb), "K6_VIDEO_DECODE": "exact"})
    return Pipeline(root, options, device="cpu")


@pytest.mark.parametrize(
    ("geometry", "binds"),
    [((512, 512, 65), "the DiT"), ((640, 640, 97), "the exact video decode")],
    ids=["dit-binds", "decode-binds"],
)
def test_the_table_is_the_pipelines_fit_and_its_refusal(tiny_distill: Path, geometry, binds: str) -> None:
    pipe = _pipeline(tiny_distill, budget_fitting(tiny_distill, *geometry))
    try:
        table = fit_table(pipe, SIDE, MAX_FRAMES)
        assert 0 < min(table.most) < MAX_FRAMES, "the fit boundary lies inside the grid"
        assert (table.dit_most is not None) == (binds == "the exact video decode")
        for w, h in cells(SIDE):
            i, j = w // 16 - 1, h // 16 - 1
            edge = min(i, j) == 0 or max(i, j) == SIDE // 16 - 1
            # Every frame count on the edges (1 x N and N x 1 included) and on every third cell; the boundary
            # frame counts (the most that fit and the next) elsewhere.
            most = table.most[j * (SIDE // 16) + i]
            counts = FRAME_COUNTS if edge or (i + j) % 3 == 0 else [f for f in (most, most + 4) if 1 <= f <= 97]
            for f in counts:
                assert table.fits(w, h, f) == pipe.fits(w, h, f), (w, h, f)
                assert table.dit_fits(w, h, f) == pipe.dit_fits(w, h, f), (w, h, f)
        oversize = [g for g in ((SIDE, SIDE, MAX_FRAMES), (SIDE, 16, MAX_FRAMES), (608, 336, 89)) if not pipe.fits(*g)]
        assert (SIDE, SIDE, MAX_FRAMES) in oversize
        for w, h, f in oversize:
            with pytest.raises(RequestError) as refused:
                pipe.check_fits(Request(prompt="a fox", width=w, height=h, frames=f))
            assert refusal([table], w, h, f) == str(refused.value)
            suffix = "the exact video decode is what does not fit" in str(refused.value)
            assert suffix == (binds == "the exact video decode")
    finally:
        pipe.close()
