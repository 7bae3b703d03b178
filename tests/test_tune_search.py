"""`k6fast tune`'s search (k6fast/tune/search.py) driven by deterministic stand-ins: a speed model where each knob
level multiplies the request time, and a gate that passes a candidate when each knob stays within a limit (or when
the summed loss stays under a budget). Checks: the known best is found, the budget of gate runs is never exceeded,
failures prune the more lossy candidates, passes dominate the less lossy ones, nothing passing is a clear result."""

from __future__ import annotations

import itertools
import math

import pytest

from k6fast.tune.search import Knob, Space, TuneError, Verdict, at_most, result_record, search
from k6fast.tune.space import build_space


def _knob(name: str, n: int, needs: tuple[str, ...] = ()) -> Knob:
    return Knob(name, tuple({f"K6_{name.upper()}": str(i)} for i in range(n)), tuple(map(str, range(n))), needs)


SPACE = Space((_knob("a", 4), _knob("b", 3), _knob("c", 3)))
# Seconds each level of each knob takes off a 100 s request, multiplicatively (more lossy, faster).
FACTORS = ((1.0, 0.8, 0.7, 0.65), (1.0, 0.9, 0.75), (1.0, 0.85, 0.8))


def seconds(c: tuple[int, ...]) -> float:
    return 100.0 * math.prod(f[level] for f, level in zip(FACTORS, c, strict=True))


class Stand:
    """A stand-in bench and gate that count their calls."""

    def __init__(self, passes, speed=seconds):
        self.passes, self.speed, self.speed_calls, self.gate_calls, self.gated = passes, speed, 0, 0, []

    def measure(self, c):
        self.speed_calls += 1
        return self.speed(c), {"stand-in": True}

    def score(self, c):
        self.gate_calls += 1
        self.gated.append(c)
        ok = self.passes(c)
        return Verdict(passed=ok, scores={"lpips_mean": sum(c) / 10}, failed=() if ok else ("lpips_mean",))


def run(passes, budget: int, space: Space = SPACE, predict=seconds):
    stand = Stand(passes, predict)
    result = search(space, predict=predict, measure_speed=stand.measure, score=stand.score, budget=budget)
    return result, stand


def true_best(space: Space, passes) -> tuple[int, ...] | None:
    ok = [c for c in space.candidates() if passes(c)]
    return min(ok, key=seconds) if ok else None


LIMITS = [(2, 1, 2), (3, 2, 0), (0, 0, 1), (1, 2, 2), (3, 0, 1)]


@pytest.mark.parametrize("limits", LIMITS, ids=str)
def test_finds_the_known_best_when_each_knob_has_a_limit(limits) -> None:
    passes = lambda c: all(level <= lim for level, lim in zip(c, limits, strict=True))  # noqa: E731
    result, stand = run(passes, budget=len(SPACE.candidates()))
    assert result.best is not None and result.best.candidate == true_best(SPACE, passes) == limits
    assert stand.gate_calls == result.gate_runs < len(SPACE.candidates())  # pruning saved gate runs


@pytest.mark.parametrize("loss_budget", [1, 2, 3, 4, 5])
def test_finds_the_known_best_when_the_losses_add_up(loss_budget: int) -> None:
    # Not a box: a candidate passes while its summed levels stay within the budget, so the climb can stall on a pass
    # that is not the fastest, and the search must go on to the candidates the model predicts faster.
    passes = lambda c: sum(c) <= loss_budget  # noqa: E731
    result, stand = run(passes, budget=len(SPACE.candidates()))
    assert result.best is not None and seconds(result.best.candidate) == seconds(true_best(SPACE, passes))
    assert stand.gate_calls < len(SPACE.candidates())


@pytest.mark.parametrize("budget", [1, 2, 3, 5])
def test_never_exceeds_the_budget(budget: int) -> None:
    passes = lambda c: sum(c) <= 3  # noqa: E731
    result, stand = run(passes, budget)
    assert stand.gate_calls == result.gate_runs <= budget
    assert stand.speed_calls <= stand.gate_calls + len(SPACE.knobs) * budget  # only candidates about to be gated
    assert sum(o.status in ("pass", "fail") for o in result.outcomes.values()) == stand.gate_calls


def test_a_failure_prunes_everything_at_least_as_lossy() -> None:
    passes = lambda c: c[0] <= 1  # noqa: E731
    result, stand = run(passes, budget=40)
    failed = [o.candidate for o in result.outcomes.values() if o.status == "fail"]
    assert failed
    for c in stand.gated:  # nothing gated after a failure was more lossy than it
        earlier = stand.gated[: stand.gated.index(c)]
        assert not any(at_most(f, c) for f in earlier if not passes(f))
    pruned = [o for o in result.outcomes.values() if o.status == "pruned"]
    assert pruned and all(any(at_most(f, o.candidate) for f in failed) for o in pruned)
    assert all("which failed" in o.why for o in pruned)


def test_a_pass_dominates_the_less_lossy_and_slower() -> None:
    passes = lambda c: True  # noqa: E731
    result, stand = run(passes, budget=40)
    assert result.best.candidate == (3, 2, 2)  # the most lossy corner, the fastest
    dominated = [o for o in result.outcomes.values() if o.status == "dominated"]
    assert dominated and all("which passed" in o.why for o in dominated)
    # Every candidate no more lossy than the winner and predicted no faster was never gated.
    for o in result.outcomes.values():
        if o.candidate != result.best.candidate and at_most(o.candidate, result.best.candidate):
            assert o.status in ("dominated", "pass"), o


def test_a_measured_time_no_faster_than_the_best_costs_no_gate_run() -> None:
    # The speed model is wrong about knob c: it predicts a gain, the measurement shows none.
    predict = seconds
    stand = Stand(lambda c: True)

    def measure(c):
        stand.speed_calls += 1
        return (seconds(c[:2] + (0,)) + 0.5 * (c[2] > 0)), None

    result = search(SPACE, predict=predict, measure_speed=measure, score=stand.score, budget=40)
    slower = [o for o in result.outcomes.values() if o.status == "slower"]
    assert slower and all(o.verdict is None and "not faster" in o.why for o in slower)
    assert result.best.candidate[2] == 0


def test_nothing_passes_is_a_clear_result() -> None:
    result, stand = run(lambda c: False, budget=4)
    assert result.best is None and stand.gate_calls == 4 == result.gate_runs
    record = result_record(SPACE, result)
    assert record["winner"] is None and "budget of 4 gate runs spent" in record["stopped"]
    assert {row["status"] for row in record["candidates"]} <= {"fail", "pruned", "unreached"}


def test_the_search_stops_early_when_nothing_is_left_to_climb() -> None:
    result, stand = run(lambda c: False, budget=100)
    # Each knob's levels fail from the top down; once every knob's first level failed, nothing is left to climb to.
    assert result.best is None and stand.gate_calls == sum(len(k.levels) - 1 for k in SPACE.knobs) == 7
    assert all(sum(c) == max(c) for c in stand.gated)  # only single-knob moves from the base were ever gated
    assert result.stopped == "every candidate was gated or pruned"


def test_the_record_lists_every_candidate_with_switches_and_why() -> None:
    result, _ = run(lambda c: c[0] <= 2 and c[1] <= 1, budget=3)
    record = result_record(SPACE, result)
    assert len(record["candidates"]) == len(SPACE.candidates()) == 4 * 3 * 3 - 1
    for row in record["candidates"]:
        assert row["status"] in ("pass", "fail", "slower", "pruned", "dominated", "unreached") and row["why"]
        assert set(row["switches"]) == {"K6_A", "K6_B", "K6_C"}
        assert (row["passed"] is None) == (row["gate_order"] is None)


def test_knobs_that_need_another_collapse_to_off_without_it() -> None:
    space = Space((_knob("sparse", 3), _knob("blocks", 3, needs=("sparse",))))
    cands = space.candidates()
    assert (0, 1) not in cands and (0, 2) not in cands and len(cands) == 2 * 3
    result, stand = run(lambda c: True, budget=10, space=space, predict=lambda c: 10.0 - sum(c))
    # The climb turns sparse on before it lowers the protected blocks (a blocks-only move is not a candidate).
    assert stand.gated[0][0] > 0 and result.best.candidate == (2, 2)


def test_bad_budget_and_bad_knobs_are_refused() -> None:
    with pytest.raises(TuneError, match="budget must be >= 1"):
        run(lambda c: True, budget=0)
    with pytest.raises(TuneError, match="at least 2 levels"):
        Knob("x", ({},), ("off",))
    with pytest.raises(TuneError, match="needs"):
        Space((_knob("a", 2, needs=("nope",)),))


def test_the_default_space_uses_declared_switches_and_keeps_the_last_step_dense() -> None:
    space, notes = build_space({}, steps=10, num_blocks=60, distilled=True)
    assert notes == []
    names = [k.name for k in space.knobs]
    assert names == ["gemm", "quant_attn", "sparse", "exact_blocks", "exact_first_steps", "exact_last_steps", "cache"]
    last = next(k for k in space.knobs if k.name == "exact_last_steps")
    assert [lv["K6_EXACT_ATTN_LAST_STEPS"] for lv in last.levels] == ["2", "1"]
    # 4 steps: one dense step at each end is the only level left, fixed in the base instead of searched.
    short, _ = build_space({}, steps=4, num_blocks=60, distilled=True)
    assert "exact_last_steps" not in [k.name for k in short.knobs] and short.base["K6_EXACT_ATTN_LAST_STEPS"] == "1"
    for c in itertools.islice(space.candidates(), 0, None, 37):
        switches = space.switches(c)
        assert int(switches["K6_EXACT_ATTN_STEPS"]) >= 1 and int(switches["K6_EXACT_ATTN_LAST_STEPS"]) >= 1
    cache = next(k for k in space.knobs if k.name == "cache")
    assert [lv["K6_PIFLOW_CACHE_STEPS"] for lv in cache.levels] == ["", "8", "5,8"]


def test_a_tiny_dit_leaves_the_attention_knobs_out_and_says_why() -> None:
    space, notes = build_space({}, steps=6, num_blocks=2, distilled=True, knobs=("gemm", "sparse", "cache"))
    assert [k.name for k in space.knobs] == ["gemm", "cache"]
    assert any("2-block DiT" in n for n in notes)


def test_a_lossy_base_arm_is_refused() -> None:
    with pytest.raises(TuneError, match="--base-arm sets K6_SPARSE_ATTN=0.25"):
        build_space({"K6_SPARSE_ATTN": "0.25"}, steps=10, num_blocks=60, distilled=True)


def test_the_speed_model_combines_the_probes_by_structure() -> None:
    from k6fast.tune.speed import SpeedModel, Timing, probe_arms

    base = Timing(12.0, (1.0,) * 10)  # 2 s outside the 10 steps
    probes = {
        "gemm-auto-lossy": Timing(10.0, (0.8,) * 10),
        "sparse-0.25": Timing(8.0, (1.0,) + (0.5,) * 8 + (1.0,)),  # every block lossy in steps 1..8
    }
    model = SpeedModel(base, num_blocks=60, probes=probes)
    assert model.predict({}) == pytest.approx(12.0)
    assert model.predict({"K6_GEMM": "auto-lossy"}) == pytest.approx(2.0 + 8.0)
    assert model.predict({"K6_PIFLOW_CACHE_STEPS": "5,8"}) == pytest.approx(2.0 + 8.0)
    policy = {"K6_EXACT_ATTN_BLOCKS": "6", "K6_EXACT_ATTN_STEPS": "1", "K6_EXACT_ATTN_LAST_STEPS": "1"}
    # 48 of 60 blocks lossy in steps 1..8, each at half the dense cost: 1 - 0.8 * 0.5 of a step.
    assert model.predict({"K6_SPARSE_ATTN": "0.25", **policy}) == pytest.approx(2.0 + 2.0 + 8 * 0.6)
    # Density 0.5 skips two thirds of the key blocks the 0.25 probe skipped.
    assert model.predict({"K6_SPARSE_ATTN": "0.5", **policy}) == pytest.approx(4.0 + 8 * (1 - 0.8 * (1 / 3)))
    levels = [{"K6_GEMM": "auto-lossy"}, {"K6_ATTN": "k6", "K6_QUANT_ATTN_SITES": "self"}, {"K6_SPARSE_ATTN": "0.5"}]
    names = probe_arms(levels, [0.5, 0.25])
    assert set(names) == {"gemm-auto-lossy", "quant-self", "sparse-0.25"}
    assert (
        names["quant-self"]["K6_EXACT_ATTN_BLOCKS"] == "0" and names["sparse-0.25"]["K6_EXACT_ATTN_LAST_STEPS"] == "1"
    )


def test_the_search_speed_and_space_modules_import_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, k6fast.tune.search, k6fast.tune.speed, k6fast.tune.space; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-2000:]
