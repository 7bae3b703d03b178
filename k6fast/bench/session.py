"""A bench session: the plan, the mirrored visit order, and running each visit as a fresh process.

Arms are visited mirrored (A B B A; A B C C B A for three) so that a slow drift of the machine (clocks, thermal
state, page cache) lands on every arm equally; `repeats` repeats the pattern. Before each visit the session waits,
for a bounded time, until the GPU is idle; while the visit runs, a watcher polls nvidia-smi and marks the visit
contaminated when another process computed on the GPU. Each visit's row is appended to `visits.jsonl` as soon as it
ends, so an interrupted session keeps what it measured.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from .gpu import GpuWatch, NvidiaSmi, Smi, gpu_inventory, wait_for_idle
from .peers import PEER_ARMS, is_peer
from .records import SCHEMA, SESSION_FILE, VISITS_FILE, append_jsonl, check_topic, new_session_dir, write_json
from .runner import COMPONENTS, DEFAULT_PROMPT, VisitSpec
from .workload import Geometry

ORDERS = {"ABBA": "mirrored", "ABAB": "in order"}


class BenchError(RuntimeError):
    """A session could not run as asked, or one of its visits failed; the message says which and why."""


def visit_order(arms: Sequence[str], order: str = "ABBA", repeats: int = 1) -> list[tuple[str, int, int]]:
    """The visits as (arm, position in the pattern, repeat): ABBA mirrors the arms (A B B A, A B C C B A), ABAB
    visits them in the given order once per repeat."""
    if not arms:
        raise ValueError("expected at least one arm")
    if len(set(arms)) != len(arms):
        raise ValueError(f"arms must be distinct, found {list(arms)}")
    if order not in ORDERS:
        raise ValueError(f"order {order!r}: expected one of {', '.join(ORDERS)}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, found {repeats}")
    pattern = list(arms) + list(reversed(arms)) if order == "ABBA" else list(arms)
    return [(arm, position, r) for r in range(repeats) for position, arm in enumerate(pattern)]


def check_arm(arm: str) -> str:
    """A peer arm name, or a k6fast arm (packaged name or .env path, validated now so a typo fails before any
    visit); file paths come back absolute because visits may run from another folder."""
    if is_peer(arm):
        return arm
    from ..switches import read_arm, resolve_arm
    from ..switches.arms import is_arm_path

    path = resolve_arm(arm)
    read_arm(path)
    return str(Path(path).resolve()) if is_arm_path(arm) else arm


@dataclass(frozen=True)
class SessionPlan:
    arms: tuple[str, ...]
    model: str
    component: str
    geometry: Geometry
    steps: int
    guidance: float
    topic: str
    order: str = "ABBA"
    repeats: int = 1
    requests: int = 1
    warmup: int = 1
    seed: int = 42
    prompt: str = DEFAULT_PROMPT
    device: str | None = None
    dtype: str | None = None
    mux: bool = True
    idle_timeout_s: float = 300.0
    max_utilization: int = 5
    visit_timeout_s: float = 3600.0
    command: str = ""
    # Session-wide switches ((K6_NAME, value) pairs) laid over every k6fast arm's file, e.g. the VRAM budget; a
    # K6_VRAM_BUDGET_GB here also caps the peers' allocator, so every arm runs under the same budget.
    switches: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.component not in COMPONENTS:
            raise ValueError(f"component {self.component!r}: expected one of {', '.join(COMPONENTS)}")
        check_session_switches(self.switches)
        check_topic(self.topic)
        visit_order(self.arms, self.order, self.repeats)  # validates arms, order, repeats
        if self.requests < 1:
            raise ValueError(f"requests must be >= 1, found {self.requests}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, found {self.steps}")

    @property
    def control(self) -> str:
        return self.arms[0]

    @property
    def peer(self) -> str | None:
        return next((arm for arm in PEER_ARMS if arm in self.arms[1:]), None)

    def visits(self, session: str) -> list[VisitSpec]:
        g = self.geometry
        return [
            VisitSpec(
                session=session,
                visit=index,
                position=position,
                repeat=repeat,
                arm=arm,
                model=self.model,
                component=self.component,
                width=g.width,
                height=g.height,
                frames=g.frames,
                steps=self.steps,
                guidance=self.guidance,
                seed=self.seed,
                prompt=self.prompt,
                requests=self.requests,
                warmup=self.warmup,
                device=self.device,
                dtype=self.dtype,
                mux=self.mux,
                command=self.command,
                switches=dict(self.switches),
            )
            for index, (arm, position, repeat) in enumerate(visit_order(self.arms, self.order, self.repeats))
        ]

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["geometry"] = self.geometry.label()
        out["arms"] = list(self.arms)
        out["switches"] = dict(self.switches)
        out["control"] = self.control
        out["peer"] = self.peer
        return out


def parse_session_switch(text: str) -> tuple[str, str]:
    """`K6_NAME=VALUE` → (name, value), checked against the switch registry (name known, value accepted)."""
    name, sep, value = text.partition("=")
    name, value = name.strip(), value.strip()
    if not sep or not name:
        raise ValueError(f"expected K6_NAME=VALUE, found {text!r}")
    check_session_switches(((name, value),))
    return name, value


def check_session_switches(pairs: Sequence[tuple[str, str]]) -> None:
    from ..switches import SWITCHES_BY_NAME
    from ..switches.registry import closest_switch

    seen: set[str] = set()
    for name, value in pairs:
        switch = SWITCHES_BY_NAME.get(name)
        if switch is None:
            hint = closest_switch(name, SWITCHES_BY_NAME)
            raise ValueError(f"unknown switch {name!r}" + (f"; did you mean {hint}?" if hint else ""))
        if name in seen:
            raise ValueError(f"switch {name} is set twice for the session")
        if switch.secret:  # the plan is written to session.json and rendered into measurements/README.md
            raise ValueError(f"switch {name} is a secret and cannot be a session switch (it would be recorded)")
        seen.add(name)
        switch.parse(value)  # SwitchError (a ValueError) names the variable, the value and what is accepted


def child_environment(environ: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """The visits' environment: the session's, less every K6_* variable, so that an arm file alone decides a k6fast
    arm's switches (a K6_* left in the shell would otherwise apply to every arm and blur the comparison)."""
    removed = sorted(k for k in environ if k.startswith("K6_"))
    return {k: v for k, v in environ.items() if not k.startswith("K6_")}, removed


def run_visit_process(
    spec: VisitSpec,
    smi: Smi,
    *,
    python: str,
    env: dict[str, str],
    timeout_s: float,
    poll_s: float = 0.5,
) -> dict[str, Any]:
    """Run one visit in a fresh process under the GPU watch; returns its row (an `error` key when it failed)."""
    with tempfile.TemporaryDirectory(prefix="k6fast-visit-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "record.json"
        spec_path.write_text(json.dumps(spec.as_dict()))
        cmd = [python, "-m", "k6fast.bench.visit", "--spec", str(spec_path), "--out", str(out_path)]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env)
        watch = GpuWatch(smi, interval_s=poll_s)
        watch.start(proc.pid)
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            returncode = None
        verdict = watch.stop()
        wall = time.perf_counter() - start
        if out_path.is_file():
            row = json.loads(out_path.read_text())
        else:
            row = {"schema": SCHEMA, "visit": spec.visit, "arm": spec.arm}
            row["error"] = (
                f"visit timed out after {timeout_s:.0f} s and was killed"
                if returncode is None
                else f"visit process exited with status {returncode} and wrote no record"
            )
    row.update(
        returncode=returncode,
        process_wall_s=wall,
        gpu_watch=verdict.as_dict(),
        contaminated=verdict.contaminated,
    )
    if returncode not in (0, None) and "error" not in row:
        row["error"] = f"visit process exited with status {returncode}"
    return row


def run_session(
    plan: SessionPlan,
    out_root: Path,
    *,
    smi: Smi | None = None,
    python: str = sys.executable,
    environ: dict[str, str] | None = None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
    idle_poll_s: float = 1.0,
    watch_poll_s: float = 0.5,
) -> Path:
    """Run every visit of `plan`; returns the session folder. Raises BenchError after recording a failed visit."""
    smi = smi if smi is not None else NvidiaSmi()
    env, removed = child_environment(dict(os.environ if environ is None else environ))
    if removed:
        log(f"bench: not passing {', '.join(removed)} to the visits: the arm files alone set the switches")
    session_dir = new_session_dir(out_root, plan.topic)
    specs = plan.visits(session_dir.name)
    header = {
        "schema": SCHEMA,
        "session": session_dir.name,
        "plan": plan.as_dict(),
        "order": [{"visit": s.visit, "arm": s.arm, "position": s.position, "repeat": s.repeat} for s in specs],
        "command": plan.command,
        "argv": sys.argv,
        "hostname": socket.gethostname(),
        "gpus": gpu_inventory() if isinstance(smi, NvidiaSmi) else [],
        "gpu_watch": "nvidia-smi" if smi.available() else "no GPU",
        "removed_environment": removed,
        "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "status": "running",
    }
    write_json(session_dir / SESSION_FILE, header)
    (session_dir / VISITS_FILE).touch()
    for spec in specs:
        idle = wait_for_idle(
            smi, timeout_s=plan.idle_timeout_s, max_utilization=plan.max_utilization, poll_s=idle_poll_s
        )
        if idle.gpu and not idle.idle:
            log(f"bench: GPU not idle after {idle.waited_s:.0f} s (pids {idle.last_pids}); visit {spec.visit} runs")
        log(f"bench: visit {spec.visit + 1}/{len(specs)}: {spec.arm} ({plan.component}, {plan.geometry.label()})")
        row = run_visit_process(spec, smi, python=python, env=env, timeout_s=plan.visit_timeout_s, poll_s=watch_poll_s)
        row["idle_wait"] = idle.as_dict()
        append_jsonl(session_dir / VISITS_FILE, row)
        if "error" in row:
            write_json(session_dir / SESSION_FILE, {**header, "status": "failed", "failed_visit": spec.visit})
            raise BenchError(f"visit {spec.visit} ({spec.arm}) failed: {row['error']} (recorded in {session_dir})")
        flag = " CONTAMINATED" if row["contaminated"] else ""
        times = ", ".join(f"{s:.3f}" for s in row["seconds"])
        log(
            f"bench:   {spec.arm}: warm-up {row['warmup'][0]['seconds']:.3f} s, timed [{times}] s{flag}"
            if row["warmup"]
            else f"bench:   {spec.arm}: timed [{times}] s{flag}"
        )
    finished = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    write_json(session_dir / SESSION_FILE, {**header, "status": "complete", "finished": finished})
    return session_dir


def with_command(plan: SessionPlan, out: Path | str) -> SessionPlan:
    """The plan with `command` set to the `k6fast bench` line that repeats it, every default spelled out."""
    import shlex

    argv = ["k6fast", "bench", "--model", plan.model, "--arms", ",".join(plan.arms), "--component", plan.component]
    argv += ["--geometry", plan.geometry.label(), "--steps", str(plan.steps), "--guidance", f"{plan.guidance:g}"]
    argv += ["--order", plan.order, "--repeats", str(plan.repeats), "--requests", str(plan.requests)]
    argv += ["--seed", str(plan.seed), "--topic", plan.topic, "--out", str(out)]
    if plan.prompt != DEFAULT_PROMPT:
        argv += ["--prompt", plan.prompt]
    argv += ["--device", plan.device] if plan.device else []
    argv += ["--dtype", plan.dtype] if plan.dtype else []
    argv += [] if plan.mux else ["--no-mux"]
    argv += ["--idle-timeout", f"{plan.idle_timeout_s:g}", "--visit-timeout", f"{plan.visit_timeout_s:g}"]
    for name, value in plan.switches:
        argv += ["--set", f"{name}={value}"]
    return replace(plan, command=shlex.join(argv))
