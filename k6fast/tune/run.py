"""`k6fast tune`'s work: time the base and the probes with the bench harness, then search (search.py) with each
candidate timed by a bench session and judged by a gate run against the reference, and write what it found.

Layout under `--out`:
    arms/<label>.env            every arm timed or gated (candidates `c-<levels>`, probes `probe-*`, `base`)
    bench/<date>_tune-<label>/  the bench session of each (session.json, visits.jsonl: the timing records)
    gate/<label>/               each candidate's gate report (report.md, report.json, sheets, plots)
    clips/                      the clip cache every gate run shares (each gate/<label>/clips links here), so the
                                reference's clips are generated once, by the first gate run, and reused after
    tune.json                   the record: every candidate's switches, speed, scores, pass/fail, why skipped
    <name>.env                  the winner, with its gate report and timing record named in its comments
"""

from __future__ import annotations

import datetime as dt
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..atomic import write_bytes_atomic, write_json_atomic
from ..bench.session import BenchError, SessionPlan, run_session
from ..bench.workload import Geometry
from ..quality_gate.gate import run_gate
from ..quality_gate.thresholds import METRICS
from ..switches import SWITCHES_BY_NAME, load_options, read_arm
from .config import TuneConfig, gate_config, space_for
from .search import Candidate, SearchResult, Space, TuneError, Verdict, result_record, search
from .speed import SpeedModel, Timing, probe_arms

RECORD = "tune.json"
ASSUMPTIONS = (
    "monotone quality: a candidate at least as lossy as one that failed would fail too (so it is not gated)",
    "monotone speed: less lossy is predicted slower (the speed model orders the climb; each gated candidate's own "
    "bench timing decides)",
)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def write_arm(path: Path, switches: dict[str, str], comments: list[str]) -> Path:
    """An arm file in switches/arms/*.env's format, checked by reading it back with the registry."""
    lines = [f"# {line}" if line else "#" for line in comments] + [f"{k}={v}" for k, v in switches.items()]
    write_bytes_atomic(path, ("\n".join(lines) + "\n").encode("utf-8"))
    read_arm(path)
    return path


class Bench:
    """Times arms with the bench harness: one session per arm (a fresh process, a warm-up, one timed request)."""

    def __init__(self, config: TuneConfig, model_root: str, steps: int, guidance: float, log: Callable[[str], None]):
        self.config, self.model_root, self.steps, self.guidance, self.log = config, model_root, steps, guidance, log
        self.root = config.out / "bench"

    def time(self, arm: Path, label: str) -> tuple[Timing, dict[str, Any]]:
        width, height, frames = self.config.geometry
        plan = SessionPlan(
            arms=(str(arm.resolve()),),
            model=self.model_root,
            component="pipeline",
            geometry=Geometry(width, height, frames),
            steps=self.steps,
            guidance=self.guidance,
            topic=f"tune-{label}",
            order="ABAB",
            seed=self.config.seeds[0],
            device=self.config.device,
            dtype=self.config.dtype,
        )
        try:
            folder = run_session(plan, self.root, log=self.log)
        except BenchError as exc:
            raise TuneError(f"timing {label} failed: {exc}") from exc
        rows = [json.loads(line) for line in (folder / "visits.jsonl").read_text().splitlines() if line.strip()]
        row = rows[-1]
        timing = Timing(
            seconds=statistics.median(row["seconds"]),
            step_s=tuple(row["requests"][0]["telemetry"]["step_s"]),
        )
        record = {
            "session": str(folder.relative_to(self.config.out)),
            "seconds": timing.seconds,
            "step_s": list(timing.step_s),
            "contaminated": row.get("contaminated"),
        }
        return timing, record


class Gate:
    """Scores candidates with the gate, each into its own report folder, all sharing one clip cache."""

    def __init__(self, config: TuneConfig, log: Callable[[str], None], prepare: Callable | None = None):
        self.config, self.log, self.prepare = config, log, prepare
        self.clips = config.out / "clips"
        self.reference_status: list[dict[str, str]] = []

    def score(self, arm: Path, label: str) -> Verdict:
        out = self.config.out / "gate" / label
        out.mkdir(parents=True, exist_ok=True)
        self.clips.mkdir(parents=True, exist_ok=True)
        link = out / "clips"
        if not link.is_symlink():
            link.symlink_to(Path("..") / ".." / "clips", target_is_directory=True)
        run = run_gate(gate_config(self.config, str(arm.resolve()), out), log=self.log, prepare=self.prepare)
        ref = run.reference.hash
        self.reference_status.append(
            {path: status for path, status in run.clip_status.items() if f"-{ref}-" in Path(path).name}
        )
        result = run.arms[0]
        agg = result.aggregates
        return Verdict(
            passed=result.passed,
            scores={m: float(agg[m]) for m in METRICS},
            report=str((out / "report.md").relative_to(self.config.out)),
            failed=tuple(c.metric for c in result.checks if not c.passed),
        )


def _candidate_comments(space: Space, c: Candidate, config: TuneConfig) -> list[str]:
    return [
        f"k6fast tune candidate {space.label(c)}: {space.describe(c)}",
        f"base arm: {config.base_arm}; lossy: judge it with `k6fast gate` against `{config.reference}`",
    ]


def run_tune(
    config: TuneConfig, log: Callable[[str], None] = _stderr, prepare: Callable | None = None
) -> tuple[SearchResult, Space, dict[str, Any]]:
    """The whole run: probes, search, record, winner. Returns the search result, the space and the record.
    prepare: what the command's process does before each gate pipeline is built (see `clips.run_jobs`)."""
    space, notes, ckpt = space_for(config)
    steps = config.steps if config.steps is not None else ckpt.default_steps
    for note in notes:
        log(f"tune: left out {note}")
    out = config.out
    arms = out / "arms"
    arms.mkdir(parents=True, exist_ok=True)
    bench = Bench(config, str(ckpt.root), steps, ckpt.default_guidance, log)
    gate = Gate(config, log, prepare)

    log(f"tune: timing the base arm {config.base_arm}")
    base_arm = write_arm(arms / "base.env", dict(space.base), [f"k6fast tune: the base arm {config.base_arm}"])
    base_timing, base_record = bench.time(base_arm, "base")
    levels = [level for knob in space.knobs for level in knob.levels[1:]]
    densities = [float(lv["K6_SPARSE_ATTN"]) for lv in levels if "K6_SPARSE_ATTN" in lv]
    probes: dict[str, Timing] = {}
    probe_records: dict[str, Any] = {}
    for name, values in probe_arms(levels, densities).items():
        log(f"tune: timing probe {name}")
        path = write_arm(arms / f"probe-{name}.env", {**space.base, **values}, [f"k6fast tune speed probe {name}"])
        probes[name], probe_records[name] = bench.time(path, f"probe-{name}")
    model = SpeedModel(base_timing, ckpt.dit.num_visual_blocks, probes)

    def arm_of(c: Candidate) -> Path:
        return write_arm(arms / f"{space.label(c)}.env", space.switches(c), _candidate_comments(space, c, config))

    def measure(c: Candidate) -> tuple[float, dict[str, Any]]:
        timing, record = bench.time(arm_of(c), space.label(c))
        return timing.seconds, record

    result = search(
        space,
        predict=lambda c: model.predict(space.switches(c)),
        measure_speed=measure,
        score=lambda c: gate.score(arm_of(c), space.label(c)),
        budget=config.budget,
        base_seconds=base_timing.seconds,
        log=log,
    )
    record = {
        "command": config.command,
        "finished": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "plumbing_only": config.plumbing_only,
        "warning": "random LPIPS backbone (--test): every verdict is plumbing, not quality"
        if config.plumbing_only
        else None,
        "model": str(ckpt.root),
        "variant": ckpt.variant,
        "geometry": {"width": config.geometry[0], "height": config.geometry[1], "frames": config.geometry[2]},
        "steps": steps,
        "guidance": ckpt.default_guidance,
        "prompts": str(config.prompts),
        "seeds": list(config.seeds),
        "thresholds": {**asdict(config.thresholds), "rule": config.thresholds.describe()},
        "base_arm": config.base_arm,
        "reference": config.reference,
        "assumptions": list(ASSUMPTIONS),
        "left_out": notes,
        "base_timing": base_record,
        "probes": probe_records,
        "reference_clips_per_gate_run": gate.reference_status,
        **result_record(space, result),
    }
    write_json_atomic(out / RECORD, record)
    if result.best is not None:
        write_winner(config, space, result, record)
    return result, space, record


def write_winner(config: TuneConfig, space: Space, result: SearchResult, record: dict[str, Any]) -> Path:
    best = result.best
    row = next(r for r in record["candidates"] if r["label"] == space.label(best.candidate))
    options = load_options(environ={}, arm=config.out / "arms" / f"{space.label(best.candidate)}.env")
    lossy = [n for n, v in options.non_default().items() if SWITCHES_BY_NAME[n].lossy]
    speedup = f" ({row['speedup_vs_base']:.2f}x the base)" if row["speedup_vs_base"] else ""
    where = "x".join(map(str, config.geometry))
    comments = [
        f"`{config.name}`: found by `k6fast tune` ({record['finished']}): the fastest candidate whose gate passed,",
        f"{space.describe(best.candidate)}; {result.gate_runs} of {config.budget} gate runs spent.",
        f"Lossy ({', '.join(lossy) or 'nothing'}): it passed {record['thresholds']['rule']}",
        f"on {config.prompts} at {where}, {record['steps']} steps.",
        f"Gate report: {row['gate_report']} (under {config.out})",
        f"Timing record: {row['timing']['session']}/visits.jsonl, {best.seconds:.3f} s a request{speedup}",
        f"Every candidate (switches, speed, scores, why skipped): {RECORD}",
    ]
    if config.plumbing_only:
        comments.insert(
            0, "PLUMBING ONLY: the gate ran with the random LPIPS backbone (--test); not a quality verdict."
        )
    return write_arm(config.out / f"{config.name}.env", space.switches(best.candidate), comments)
