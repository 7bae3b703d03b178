"""A stopped run's whole request, projected (`k6fast.bench.projection`), on the tiny base checkpoint with MagCache:
the projected schedule is what a whole run does, the projection adds each later step at its kind's measured median,
and it refuses what it cannot know. The report compares projected requests with the peer's."""

from __future__ import annotations

import statistics

import pytest

from k6fast.bench.acceptance_report import table_lines
from k6fast.bench.projection import project_peer, project_run, schedule, steps_needed
from k6fast.checkpoint import open_checkpoint
from k6fast.pipeline import Pipeline, Request
from k6fast.switches import Options
from k6fast.switches.provenance import provenance

STEPS = 10
REQUEST = Request(prompt="Rain on a tin roof", width=32, height=32, frames=5, steps=STEPS, seed=3)


def _sidecar(result, options: Options) -> dict:
    """What `k6fast generate` writes beside a clip (`output._write_sidecar`), from a pipeline's result."""
    request = {**REQUEST.to_dict(), "steps": result.steps, "guidance": result.guidance}
    return {"provenance": provenance(options), "request": request, "telemetry": result.telemetry.as_dict()}


@pytest.fixture(scope="module")
def runs(tiny_checkpoints, tmp_path_factory):
    """A calibration, then MagCache (every step it may skip, two at most in a row) with the first 2 and last 2
    steps exact: a whole run, and runs stopped after 2, 6 and 8 steps (its schedule: exact, exact, skipped, skipped,
    middle, skipped, skipped, middle, skipped, exact; `test_the_schedule_is_what_a_whole_run_does`)."""
    calibrations = tmp_path_factory.mktemp("calibrations")
    pipe = Pipeline(tiny_checkpoints["base"], Options(), device="cpu")
    try:
        pipe.options = Options().replace(step_cache="calibrate", step_cache_dir=calibrations)
        pipe.generate(REQUEST)
        options = Options().replace(step_cache="magcache", step_cache_dir=calibrations, step_cache_threshold=1.0,
                                    step_cache_max_skip=2, exact_attn_steps=2, exact_attn_last_steps=2)  # fmt: skip
        pipe.options = options
        out = {k: _sidecar(pipe.generate(REQUEST, stop_after_steps=k), options) for k in (2, 6, 8)}
        out["whole"] = _sidecar(pipe.generate(REQUEST), options)
    finally:
        pipe.close()
    return out, open_checkpoint(tiny_checkpoints["base"])


def test_the_schedule_is_what_a_whole_run_does(runs) -> None:
    out, ckpt = runs
    whole = out["whole"]["telemetry"]
    kinds = schedule(out["whole"], ckpt)
    assert [k != "skipped" for k in kinds] == whole["step_called"]
    assert {"skipped", "middle"} <= set(kinds)  # the cache skips and is made to call: every kind occurs
    # The first 2 steps always run (MagCache's retention) and so does the last; a called step among the first and
    # last 2 is all-exact (K6_EXACT_ATTN_*), one between them a middle step.
    assert kinds[:2] == ["exact", "exact"] and kinds[-1] == "exact"
    assert all(k in ("middle", "skipped") for k in kinds[2:8]) and all(k in ("exact", "skipped") for k in kinds[8:])


def test_the_distilled_schedules_fixed_cache_is_no_skip_on_a_base_checkpoint(runs, tiny_checkpoints) -> None:
    # `final` sets K6_PIFLOW_CACHE_STEPS=8 for the 10-step distilled schedule: a base checkpoint runs step 8, and the
    # projection must say so; the distilled checkpoint skips it.
    _, base = runs
    options = Options().replace(piflow_cache_steps=(8,))
    sidecar = {"provenance": provenance(options), "request": {**REQUEST.to_dict(), "steps": STEPS, "guidance": 5.0}}
    assert "skipped" not in schedule(sidecar, base)
    distilled = open_checkpoint(tiny_checkpoints["distill"])
    sidecar["request"]["guidance"] = 1.0
    assert [i for i, k in enumerate(schedule(sidecar, distilled)) if k == "skipped"] == [8]


def test_a_stopped_run_adds_each_later_step_at_its_kinds_median(runs) -> None:
    out, ckpt = runs
    stopped, kinds = out[8]["telemetry"], schedule(out["whole"], ckpt)
    projected = project_run(out[8], ckpt)
    ran = list(zip(stopped["step_s"], kinds[:8], strict=True))
    samples = {kind: [s for s, k in ran if k == kind] for kind in set(kinds[:8])}
    # A called kind's first step in the process does first-use work: it is left out of that kind's median.
    kept = {k: v[1:] if k != "skipped" else v for k, v in samples.items()}
    medians = {k: statistics.median(v) for k, v in kept.items() if v}
    later = kinds[8:]
    assert set(later) <= set(medians)
    want = sum(stopped["phases_s"].values()) + sum(medians[k] for k in later)
    assert projected["request_s"] == pytest.approx(want, abs=1e-3)
    assert projected["basis"].startswith(f"8 of {STEPS} steps ran; ")
    assert projected["steady_s"] == pytest.approx(medians["middle"], abs=1e-3)  # the per-step figure beside the peer
    assert project_run(out["whole"], ckpt) is None  # a whole run is not projected


def test_a_first_use_outlier_does_not_reach_the_projection(runs) -> None:
    """The first step of each called kind (a lossy kernel's first call, 3x a steady step in the 2026-12-03 `fast`
    cold run) is left out: making it 100 s adds only its own 100 s; making a kept step of its kind 100 s adds more."""
    out, ckpt = runs
    kinds = schedule(out["whole"], ckpt)
    base = project_run(out[8], ckpt)["request_s"]
    firsts = [i for i, k in enumerate(kinds[:8]) if k in ("exact", "middle") and k not in kinds[:i]]
    # A called kind that is projected (it occurs after step 8), at its kept steps: those are in its median.
    later = [i for i, k in enumerate(kinds[:8]) if k in kinds[8:] and k != "skipped" and i not in firsts]
    if not later:
        pytest.fail("no kept step of a projected called kind in the fixture's first 8 steps: not exercised")

    def with_step(i: int, seconds: float) -> dict:
        step_s = list(out[8]["telemetry"]["step_s"])
        step_s[i] = seconds
        phases = {**out[8]["telemetry"]["phases_s"]}
        phases["denoise"] += seconds - out[8]["telemetry"]["step_s"][i]
        return {**out[8], "telemetry": {**out[8]["telemetry"], "step_s": step_s, "phases_s": phases}}

    for i in firsts:  # only its own 100 s come in, as a measured step of the run
        assert project_run(with_step(i, 100.0), ckpt)["request_s"] == pytest.approx(
            base + 100.0 - out[8]["telemetry"]["step_s"][i], abs=1e-3
        )
    assert project_run(with_step(later[-1], 100.0), ckpt)["request_s"] > base + 100.0  # in the median as well


def test_a_kind_the_run_never_reached_makes_it_unknown(runs) -> None:
    out, ckpt = runs
    kinds = schedule(out["whole"], ckpt)
    projected = project_run(out[2], ckpt)
    missing = next(k for k in kinds[2:] if k != "exact")  # steps 0 and 1 are exact
    assert "request_s" not in projected
    # no middle step measured: the steady step is the all-exact step 1 (step 0, the process's first, left out)
    assert projected["steady_s"] == pytest.approx(out[2]["telemetry"]["step_s"][1], abs=1e-3)
    assert f"no measured {missing} step among the 2 that ran" in projected["error"]
    assert "run at least" in projected["error"] or "run all" in projected["error"]
    # After 6 steps one middle step ran (step 4): its first, left out, so the middle kind is still unmeasured.
    if kinds[:6].count("middle") != 1 or "middle" not in kinds[6:]:
        pytest.fail("the fixture's first 6 steps do not hold exactly one middle step: the rule is not exercised")
    error = project_run(out[6], ckpt)["error"]
    second = [i for i, k in enumerate(kinds) if k == "middle"][1]
    assert "no measured middle step among the 6 that ran" in error and f"run at least {second + 1} steps" in error


def test_what_a_stopped_run_needs_to_measure_a_kind() -> None:
    fast = ["exact"] + ["middle"] * 4 + ["skipped"] + ["middle"] * 2 + ["skipped", "exact"]  # `fast`'s 10 steps
    assert steps_needed(fast, "exact") == "a stopped run cannot measure it: run all 10 steps"  # step 0 and the last
    assert steps_needed(fast, "middle") == "run at least 3 steps"  # the first middle step (1) is left out
    assert steps_needed(fast, "skipped") == "run at least 6 steps"  # skipped steps do no first-use work


def test_a_run_that_did_not_follow_the_schedule_is_refused(runs) -> None:
    out, ckpt = runs
    sidecar = {**out[6], "telemetry": {**out[6]["telemetry"], "step_called": [True] * 6}}
    if schedule(out["whole"], ckpt)[:6] == ["exact", "exact"] + ["middle"] * 4:
        pytest.fail("the fixture's run skipped nothing in its first 6 steps: the refusal is not exercised")
    assert "are not what the run did" in project_run(sidecar, ckpt)["error"]


def test_the_peer_adds_steps_at_its_steady_median_and_the_report_compares_projections() -> None:
    peer = {"arm": "diffusers-offload", "run": "peer", "passed": True, "request_s": 30.0, "phases_s": {"denoise": 22.0},
            "step_s": [6.0, 4.0, 3.5, 4.5, 4.0]}  # fmt: skip
    peer["projected"] = project_peer(peer, steps=50, ran=5)
    # its first step (set-up) left out: 45 more at the median of 4.0, 3.5, 4.5, 4.0, not at 22 / 5 = 4.4
    assert peer["projected"] == {"request_s": 210.0, "basis": "5 of 50 steps ran; 45 more at 4.00 s", "steady_s": 4.0}
    assert project_peer(peer, steps=5, ran=5) is None
    assert "error" in project_peer({**peer, "step_s": [6.0]}, steps=50, ran=1)
    fast = {"arm": "fast-base", "run": "fast-base", "passed": True, "request_s": 20.0, "phases_s": {"denoise": 12.0},
            "projected": {"request_s": 70.0, "basis": "5 of 50 steps ran; ...", "steady_s": 1.6}}  # fmt: skip
    lost = {"arm": "final", "run": "final", "passed": True, "request_s": 25.0, "projected": {"error": "no middle step"}}
    cells = {row["run"]: _cells(table_lines([fast, lost, peer]), row["run"]) for row in (fast, lost, peer)}
    assert cells["fast-base"][2] == "3.00× (projected)"  # 210 / 70: the projected requests, not the 5 steps each ran
    assert "70.0 (5 of 50 steps ran; ...)" in cells["fast-base"] and "unknown: no middle step" in cells["final"]
    assert cells["fast-base"][-1] == "1.60" and cells["peer"][-1] == "4.00" and cells["final"][-1] == "—"
    assert cells["final"][2] == "— (no projection)"  # no ratio of a stopped request against a projected peer
    # A peer whose projection failed: the stopped rows are not compared with its stopped request either.
    unprojected = {**peer, "projected": {"error": "no steps"}}
    assert _cells(table_lines([fast, unprojected]), "fast-base")[2] == "— (no projection)"


def _cells(lines: list[str], run: str) -> list[str]:
    """The cells of the table row of `run` (the first cell is the run's name)."""
    (line,) = [line for line in lines if line.startswith(f"| {run} ")]
    return [cell.strip() for cell in line.strip().strip("|").split("|")]
