"""A stopped run's whole request, projected from the steps it ran (issue #36: a 50-step Pro base request at full depth
takes minutes a run, so the acceptance may run the first K steps of each, `--stop-after-steps K`).

A k6fast run's steps are not all alike: the step cache skips some (a skipped step reuses the last prediction), and
the K6_EXACT_ATTN_* policy keeps the first and last steps' attention exact where the middle ones may run a lossy one
(block-sparse or quantized). Which steps the cache calls is fixed before the run: PiFlow's cached steps are a switch,
and MagCache's rule reads only the calibrated ratios (`step_cache.MagCache.call`), so the schedule of all the steps
is known from the run's switches and its calibration. The projection adds, for every step past the K that ran, the
median measured seconds of that step's kind (called exact, called lossy, skipped) among the steps that ran, each
called kind's first step in the process left out of its median (the process's first step carries the compile and
first-use work; a lossy arm's first middle step its kernels' first use: the 2026-12-03 `fast` cold run's first
sparse step took 9.13 s against 3.02 s after it). A kind the run never measured makes the projection unknown: it
says how many steps a run needs to measure it. The schedule's first K entries must be what the run did (its
`step_called`), else the projection is refused.

The peer's steps are alike (no cache, no lossy attention, no compile), but its first carries its own set-up: each
later step is added at the median of its steps after the first.
"""

from __future__ import annotations

import statistics
from typing import Any

KINDS = ("exact", "middle", "skipped")  # all-exact first and last steps, the steps between, steps the cache skips
CALLED = ("exact", "middle")  # the kinds that call the DiT: their first step in a process does first-use work
PROJECTION_COLUMNS = ("projected request s", "steady step s")
PROJECTION_NOTES = (
    "projected request s = a stopped run's whole request: the seconds it measured plus, for each step past those it "
    "ran, the median measured seconds of that step's kind (all-exact first and last steps, middle steps, skipped "
    "steps: the schedule is fixed by the run's switches and step-cache calibration), each kind's first DiT step in "
    "the process left out of its median (first-use work; `k6fast/bench/projection.py`); the peer's later steps at "
    "the median of its steps after its first. Where rows have it, request vs peer compares the projected requests. "
    "steady step s = the median seconds of a called middle step (an all-exact one where the run has none), its kind's "
    "first left out; the peer's, of its steps after the first: per-step seconds side by side (under CFG every step is "
    "two DiT passes, the peer's too)"
)


def schedule(sidecar: dict[str, Any], ckpt) -> list[str]:
    """Each step's kind for the run a `k6fast generate` sidecar describes, on checkpoint `ckpt` (its calibration)."""
    from ..step_cache import plan_run
    from ..switches import load_options

    request = sidecar["request"]
    options = load_options(environ=sidecar["provenance"]["switches"])
    steps, guidance = int(request["steps"]), float(request["guidance"])
    plan = plan_run(ckpt, options, steps, guidance, bool(request["audio"]))
    kinds = []
    for i in range(steps):
        called = i not in plan.fixed and (plan.magcache is None or plan.magcache.call(i))
        exact = i < options.exact_attn_steps or i >= steps - options.exact_attn_last_steps
        kinds.append("skipped" if not called else "exact" if exact else "middle")
    return kinds


def project_run(sidecar: dict[str, Any], ckpt) -> dict[str, Any] | None:
    """{request_s, basis, steady_s} of a stopped k6fast run's whole request (see the module docstring; steady_s: its
    middle steps' median, else its exact steps'); None where the run was not stopped; {error} (and steady_s where
    measured) where it cannot be projected."""
    telemetry = sidecar["telemetry"]
    measured, called = list(telemetry["step_s"]), list(telemetry["step_called"])
    steps, ran = int(sidecar["request"]["steps"]), len(telemetry["step_s"])
    if ran >= steps:
        return None
    kinds = schedule(sidecar, ckpt)
    if [k != "skipped" for k in kinds[:ran]] != called:
        return {"error": f"the schedule's first {ran} steps {kinds[:ran]} are not what the run did ({called})"}
    seconds: dict[str, float] = {}
    for kind in KINDS:
        samples = [s for s, k in zip(measured, kinds, strict=False) if k == kind]
        if kind in CALLED:
            samples = samples[1:]
        if samples:
            seconds[kind] = statistics.median(samples)
    steady = seconds.get("middle", seconds.get("exact"))
    steady_s = {} if steady is None else {"steady_s": round(steady, 3)}
    rest = kinds[ran:]
    unmeasured = next((i for i, kind in enumerate(rest) if kind not in seconds), None)
    if unmeasured is not None:
        kind, first = rest[unmeasured], ran + unmeasured + 1
        return {"error": f"no measured {kind} step among the {ran} that ran (the first to project is step {first} of "
                         f"{steps}); {steps_needed(kinds, kind)}", **steady_s}  # fmt: skip
    counts = {kind: rest.count(kind) for kind in KINDS if kind in rest}
    added = sum(seconds[kind] * n for kind, n in counts.items())
    parts = ", ".join(f"{n} {kind} at {seconds[kind]:.2f} s" for kind, n in counts.items())
    request_s = sum(telemetry["phases_s"].values())  # the acceptance's request seconds: the sum of the phases
    return {"request_s": round(request_s + added, 3), "basis": f"{ran} of {steps} steps ran; {parts}", **steady_s}


def steps_needed(kinds: list[str], kind: str) -> str:
    """What a stopped run needs to measure `kind`: the steps up to its first occurrence the median keeps."""
    at = [i for i, k in enumerate(kinds) if k == kind][1 if kind in CALLED else 0 :]
    if not at or at[0] + 1 >= len(kinds):
        return f"a stopped run cannot measure it: run all {len(kinds)} steps"
    return f"run at least {at[0] + 1} steps"


def project_peer(row: dict[str, Any], steps: int, ran: int) -> dict[str, Any] | None:
    """{request_s, basis, steady_s} of the peer's whole request from a run of its first `ran` of `steps` steps: each
    later step at the median of its steps after the first (steady_s). None where it ran them all."""
    if ran >= steps:
        return None
    step_s = row.get("step_s") or []
    if not isinstance(row.get("request_s"), (int, float)) or len(step_s) != ran:
        return {"error": f"the peer's row has no request seconds or not its {ran} steps' seconds"}
    if ran < 2:
        return {"error": "the peer ran 1 step: no step after its first was measured"}
    per_step = statistics.median(step_s[1:])
    return {"request_s": round(row["request_s"] + per_step * (steps - ran), 3),
            "basis": f"{ran} of {steps} steps ran; {steps - ran} more at {per_step:.2f} s",
            "steady_s": round(per_step, 3)}  # fmt: skip


def projected_s(row: dict[str, Any]) -> float | None:
    """A row's projected request seconds, None without a projection."""
    value = (row.get("projected") or {}).get("request_s")
    return float(value) if isinstance(value, (int, float)) else None


def projection_cell(row: dict[str, Any]) -> list[str]:
    projected = row.get("projected")
    if not projected:
        return ["—", "—"]
    steady = projected.get("steady_s")
    steady_cell = "—" if steady is None else f"{steady:.2f}"
    if "error" in projected:
        return [f"unknown: {projected['error']}", steady_cell]
    return [f"{projected['request_s']:.1f} ({projected['basis']})", steady_cell]
