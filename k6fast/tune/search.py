"""The search of `k6fast tune`: the fastest candidate whose gate passes, within a budget of gate runs. Pure Python (no
PyTorch): the space, the speed and the verdict come in as values and callables, so tests drive it with stand-ins.

The space is a lattice. Each knob is an axis of levels ordered from least to most lossy (level 0 = the base arm's
setting); a candidate is one level per knob, and `a <= b` (every knob of `a` at or below `b`'s) means `a` is no more
lossy than `b`. Two assumptions make the lattice searchable, and the record states them: more lossy never passes
where less lossy failed (monotone quality), and more lossy is predicted faster (the speed model).

The search climbs from the base (greedy, best first): of the candidates one knob above the current accepted one, it
measures and gates the one predicted fastest. What each run tells it prunes the rest:
- a gate that fails skips every candidate at least as lossy as the failure (it would fail too);
- a gate that passes makes that candidate the new start, and every candidate no more lossy than it and predicted no
  faster than its measured time is dominated;
- a candidate whose measured time is not below the best passing one's is not gated (no budget spent).
When no candidate is left above the current one, any left that the model predicts faster than the best pass is
tried, fastest first. It stops when the budget of gate runs is spent or no such candidate is left.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Candidate = tuple[int, ...]  # one level per knob, in the space's knob order


class TuneError(ValueError):
    """`k6fast tune` cannot run as asked; the message says what was expected and what was found."""


@dataclass(frozen=True)
class Knob:
    """One lossy axis. `levels[i]`: the switch values (K6_NAME → raw value) that level i sets, least lossy first; level
    0 is the base arm's setting. `labels[i]` names the level in records. `needs`: knobs of which at least one must be
    above level 0 for this one to change anything (the exact-blocks policy only matters with lossy attention)."""

    name: str
    levels: tuple[Mapping[str, str], ...]
    labels: tuple[str, ...]
    needs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.levels) < 2:
            raise TuneError(
                f"knob {self.name}: expected at least 2 levels (off and one lossy), found {len(self.levels)}"
            )
        if len(self.labels) != len(self.levels):
            raise TuneError(f"knob {self.name}: {len(self.levels)} levels but {len(self.labels)} labels")


@dataclass(frozen=True)
class Space:
    """The candidate lattice over `base` (the base arm's switch values, K6_NAME → raw)."""

    knobs: tuple[Knob, ...]
    base: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        names = [k.name for k in self.knobs]
        if not names or len(set(names)) != len(names):
            raise TuneError(f"expected at least one knob, with distinct names; found {names}")
        for knob in self.knobs:
            unknown = [n for n in knob.needs if n not in names or n == knob.name]
            if unknown:
                raise TuneError(f"knob {knob.name}: needs {unknown}, which are not other knobs of the space")

    @property
    def origin(self) -> Candidate:
        return (0,) * len(self.knobs)

    def canonical(self, levels: Sequence[int]) -> Candidate:
        """The candidate with every knob whose `needs` are all off put back to level 0 (it would change nothing)."""
        on = {k.name for k, level in zip(self.knobs, levels, strict=True) if level > 0}
        return tuple(
            0 if knob.needs and not any(n in on for n in knob.needs) else level
            for knob, level in zip(self.knobs, levels, strict=True)
        )

    def candidates(self) -> list[Candidate]:
        """Every distinct canonical candidate but the origin (the base itself is not a lossy arm)."""
        seen = dict.fromkeys(
            self.canonical(levels) for levels in itertools.product(*(range(len(k.levels)) for k in self.knobs))
        )
        seen.pop(self.origin, None)
        return list(seen)

    def switches(self, candidate: Candidate) -> dict[str, str]:
        """The arm's switch values: the base's, then each knob's level (level 0 included: it restates the base)."""
        out = dict(self.base)
        for knob, level in zip(self.knobs, candidate, strict=True):
            out.update(knob.levels[level])
        return out

    def describe(self, candidate: Candidate) -> str:
        parts = [f"{k.name}={k.labels[level]}" for k, level in zip(self.knobs, candidate, strict=True) if level > 0]
        return ", ".join(parts) or "base"

    def label(self, candidate: Candidate) -> str:
        """A short file-name-safe name: `c-` and the levels, e.g. `c-1020100`."""
        return "c-" + "".join(str(level) if level < 10 else f"({level})" for level in candidate)


def at_most(a: Candidate, b: Candidate) -> bool:
    """`a` is no more lossy than `b` on any knob."""
    return all(x <= y for x, y in zip(a, b, strict=True))


@dataclass(frozen=True)
class Verdict:
    """One gate run's answer for a candidate: whether it passed, its set scores, and where its report is."""

    passed: bool
    scores: Mapping[str, float] = field(default_factory=dict)
    report: str | None = None
    failed: tuple[str, ...] = ()  # the metrics over their limits


@dataclass
class Outcome:
    """What the search did with one candidate. `status`: pass, fail, slower (measured, not gated: not faster than
    the best pass), pruned (more lossy than a failure), dominated (less lossy than a pass and predicted slower), or
    unreached (the budget ran out first, or the search never climbed to it)."""

    candidate: Candidate
    predicted_s: float
    status: str = "unreached"
    why: str = ""
    seconds: float | None = None
    timing: Any = None  # what measure_speed returned beside the seconds (the bench session), for the record
    verdict: Verdict | None = None
    order: int | None = None  # 1-based position among the candidates gated


@dataclass
class SearchResult:
    best: Outcome | None
    outcomes: dict[Candidate, Outcome]
    gate_runs: int
    speed_runs: int
    budget: int
    base_seconds: float | None
    stopped: str  # why the search ended

    @property
    def evaluated(self) -> list[Outcome]:
        """The gated candidates in the order they were gated."""
        return sorted((o for o in self.outcomes.values() if o.order is not None), key=lambda o: o.order)


Speed = Callable[[Candidate], tuple[float, Any]]  # measured seconds of a request, and what to record about it


def search(
    space: Space,
    *,
    predict: Callable[[Candidate], float],
    measure_speed: Speed,
    score: Callable[[Candidate], Verdict],
    budget: int,
    base_seconds: float | None = None,
    log: Callable[[str], None] = lambda line: None,
) -> SearchResult:
    """Find the fastest candidate of `space` whose `score` passes, calling `score` at most `budget` times.

    predict(c): predicted seconds of a request (the order); measure_speed(c): (measured seconds, a record of the
    measurement), called once per candidate at most and only for candidates about to be gated; score(c): the gate.
    `base_seconds`: the base arm's measured time, recorded beside the candidates'.
    """
    if budget < 1:
        raise TuneError(f"budget must be >= 1 gate run, found {budget}")
    outcomes = {c: Outcome(c, float(predict(c))) for c in space.candidates()}
    if not outcomes:
        raise TuneError("the search space holds no lossy candidate")
    current, best = space.origin, None
    gate_runs = speed_runs = 0
    stopped = ""
    while True:
        moves = [o for c, o in outcomes.items() if o.status == "unreached" and _one_knob_above(current, c)]
        if not moves and best is not None:
            # The climb has stalled: any candidate left that the model predicts faster than the best pass.
            moves = [o for o in outcomes.values() if o.status == "unreached" and o.predicted_s < best.seconds]
        if not moves:
            stopped = (
                "no candidate left predicted faster than the best pass"
                if best
                else "every candidate was gated or pruned"
            )
            break
        if gate_runs >= budget:
            stopped = f"budget of {budget} gate runs spent"
            break
        move = min(moves, key=lambda o: (o.predicted_s, sum(o.candidate), o.candidate))
        c = move.candidate
        move.seconds, move.timing = measure_speed(c)
        speed_runs += 1
        if best is not None and move.seconds >= best.seconds:
            move.status = "slower"
            move.why = (
                f"measured {move.seconds:.3f} s, not faster than {space.label(best.candidate)} ({best.seconds:.3f} s)"
            )
            log(f"tune: {space.label(c)} ({space.describe(c)}): {move.why}; not gated")
            continue
        gate_runs += 1
        move.order = gate_runs
        move.verdict = score(c)
        verdict = "PASS" if move.verdict.passed else "FAIL"
        log(f"tune: gate {gate_runs}/{budget}: {space.label(c)} ({space.describe(c)}) {move.seconds:.3f} s {verdict}")
        if move.verdict.passed:
            move.status, move.why = "pass", "gate passed"
            if best is None or move.seconds < best.seconds:
                best = move
            current = c
            for other in outcomes.values():
                if other.status == "unreached" and at_most(other.candidate, c) and other.predicted_s >= move.seconds:
                    other.status = "dominated"
                    other.why = f"no more lossy than {space.label(c)}, which passed, and predicted no faster"
        else:
            move.status = "fail"
            move.why = "gate failed" + (f": {', '.join(move.verdict.failed)}" if move.verdict.failed else "")
            for other in outcomes.values():
                if other.status == "unreached" and at_most(c, other.candidate):
                    other.status = "pruned"
                    other.why = f"at least as lossy as {space.label(c)}, which failed"
    for o in outcomes.values():
        if o.status != "unreached":
            continue
        if best is not None and o.predicted_s >= best.seconds:
            label = space.label(best.candidate)
            o.why = f"predicted {o.predicted_s:.3f} s, no faster than {label}, which passed ({best.seconds:.3f} s)"
        else:
            o.why = "not reached: " + stopped
    return SearchResult(best, outcomes, gate_runs, speed_runs, budget, base_seconds, stopped)


def _one_knob_above(current: Candidate, c: Candidate) -> bool:
    """`c` raises exactly one knob of `current` (to any higher level) and keeps the others."""
    diff = [(a, b) for a, b in zip(current, c, strict=True) if a != b]
    return len(diff) == 1 and diff[0][1] > diff[0][0]


def result_record(space: Space, result: SearchResult) -> dict[str, Any]:
    """The JSON-ready record of every candidate: switches, predicted and measured speed, scores, status and why."""

    def row(o: Outcome) -> dict[str, Any]:
        v = o.verdict
        return {
            "label": space.label(o.candidate),
            "levels": {k.name: k.labels[i] for k, i in zip(space.knobs, o.candidate, strict=True)},
            "switches": space.switches(o.candidate),
            "predicted_s": o.predicted_s,
            "seconds": o.seconds,
            "speedup_vs_base": (result.base_seconds / o.seconds) if result.base_seconds and o.seconds else None,
            "timing": o.timing,
            "status": o.status,
            "why": o.why,
            "gate_order": o.order,
            "passed": None if v is None else v.passed,
            "scores": None if v is None else dict(v.scores),
            "failed_metrics": None if v is None else list(v.failed),
            "gate_report": None if v is None else v.report,
        }

    rows = sorted(result.outcomes.values(), key=lambda o: (o.order is None, o.order or 0, o.predicted_s))
    return {
        "winner": space.label(result.best.candidate) if result.best else None,
        "stopped": result.stopped,
        "gate_runs": result.gate_runs,
        "budget": result.budget,
        "speed_runs": result.speed_runs,
        "base_seconds": result.base_seconds,
        "knobs": [{"name": k.name, "levels": list(k.labels), "needs": list(k.needs)} for k in space.knobs],
        "base_switches": dict(space.base),
        "candidates": [row(o) for o in rows],
    }
