"""A stopped run's whole request, projected (`k6fast.bench.projection`), on the tiny base checkpoint with MagCache:
the projected schedule is what a whole run does, the projection adds each later step at its kind's measured median,
and it refuses what it cannot know. The report compares projected requests with the peer's."""

from __future__ import annotations

import statistics

import pytest

from k6fast.bench.acceptance_report import table_lines
from k6fast.bench.projection import project_peer, project_run, schedule
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
    steps exact: a whole run, and runs stopped after 2 and after 6 steps."""
    calibrations = tmp_path_factory.mktemp("calibrations")
    pipe = Pipeline(tiny_checkpoints["base"], Options(), device="cpu")
    try:
        pipe.options = Options().replace(step_cache="calibrate", step_cache_dir=calibrations)
        pipe.generate(REQUEST)
        options = Options().replace(step_cache="magcache", step_cache_dir=calibrations, step_cache_threshold=1.0,
                                    step_cache_max_skip=2, exact_attn_steps=2, exact_attn_last_steps=2)  # fmt: skip
        pipe.options = options
        out = {k: _sidecar(pipe.generate(REQUEST, stop_after_steps=k), options) for k in (2, 6)}
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


def test_a_stopped_run_adds_each_later_step_at_its_kinds_median(runs) -> None:
    out, ckpt = runs
    stopped, kinds = out[6]["telemetry"], schedule(out["whole"], ckpt)
    projected = project_run(out[6], ckpt)
    medians = {
        kind: statistics.median(s for i, s in enumerate(stopped["step_s"]) if i > 0 and kinds[i] == kind)
        for kind in set(kinds[1:6])
    }
    later = kinds[6:]
    assert set(later) <= set(medians)
    want = sum(stopped["phases_s"].values()) + sum(medians[k] for k in later)
    assert projected["request_s"] == pytest.approx(want, abs=1e-3)
    assert projected["basis"].startswith(f"6 of {STEPS} steps ran; ")
    assert project_run(out["whole"], ckpt) is None  # a whole run is not projected


def test_a_kind_the_run_never_reached_makes_it_unknown(runs) -> None:
    out, ckpt = runs
    kinds = schedule(out["whole"], ckpt)
    projected = project_run(out[2], ckpt)
    missing = next(k for k in kinds[2:] if k != "exact")  # step 1, the only one measured, is exact
    assert set(projected) == {"error"}
    assert f"no {missing} step among the 2 that ran" in projected["error"] and "run more steps" in projected["error"]


def test_a_run_that_did_not_follow_the_schedule_is_refused(runs) -> None:
    out, ckpt = runs
    sidecar = {**out[6], "telemetry": {**out[6]["telemetry"], "step_called": [True] * 6}}
    if schedule(out["whole"], ckpt)[:6] == ["exact", "exact"] + ["middle"] * 4:
        pytest.fail("the fixture's run skipped nothing in its first 6 steps: the refusal is not exercised")
    assert "are not what the run did" in project_run(sidecar, ckpt)["error"]


def test_the_peer_scales_its_denoise_and_the_report_compares_projections() -> None:
    peer = {"arm": "diffusers-offload", "run": "peer", "passed": True, "request_s": 30.0, "phases_s": {"denoise": 20.0}}
    peer["projected"] = project_peer(peer, steps=50, ran=5)
    assert peer["projected"] == {"request_s": 210.0, "basis": "5 of 50 steps ran; 45 more at 4.00 s"}
    assert project_peer(peer, steps=5, ran=5) is None
    fast = {"arm": "fast-base", "run": "fast-base", "passed": True, "request_s": 20.0, "phases_s": {"denoise": 12.0},
            "projected": {"request_s": 70.0, "basis": "5 of 50 steps ran; ..."}}  # fmt: skip
    lost = {"arm": "final", "run": "final", "passed": True, "request_s": 25.0, "projected": {"error": "no middle step"}}
    table = "\n".join(table_lines([fast, lost, peer]))
    assert "| 3.00× (projected) |" in table  # 210 / 70: the projected requests, not the 5 steps each ran
    assert "| 70.0 (5 of 50 steps ran; ...) |" in table and "unknown: no middle step" in table
    row_of = {line.split(" | ")[0]: line for line in table.splitlines()}
    assert "| — |" in row_of["| final"]  # no projection: no ratio against a projected peer
