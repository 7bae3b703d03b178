"""A bench session's machinery with stand-in visit processes (fast): order on disk, one row per visit, environment
isolation, contamination from a scripted nvidia-smi, failure handling, and the report those records render to."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from k6fast.bench.records import load_session, read_jsonl
from k6fast.bench.report import MARKER, headline, render
from k6fast.bench.session import (
    BenchError,
    SessionPlan,
    check_arm,
    child_environment,
    run_session,
    with_command,
)
from k6fast.bench.workload import Geometry, parse_geometry

# Stands in for `python -m k6fast.bench.visit --spec S --out O`: reads the spec, records its pid for the scripted
# nvidia-smi, and writes a record whose times depend on the arm ("slow" arms take 2 s, others 1 s, +0.01 per visit).
FAKE_VISIT = """#!{python}
import json, os, sys, time
args = sys.argv[1:]
spec = json.load(open(args[args.index("--spec") + 1]))
out = args[args.index("--out") + 1]
open(os.environ["FAKE_PID_FILE"], "a").write(f"{{os.getpid()}}\\n")
if spec["arm"] == "broken":
    sys.exit(3)
time.sleep(0.3)
base = 2.0 if spec["arm"].startswith("slow") else 1.0
seconds = [base + 0.01 * spec["visit"] + 0.001 * i for i in range(spec["requests"])]
record = {{
    "schema": "k6fast-bench-v1", "visit": spec["visit"], "arm": spec["arm"], "position": spec["position"],
    "repeat": spec["repeat"], "component": spec["component"], "load_s": 0.5,
    "warmup": [{{"seconds": base * 3, "telemetry": {{"step_s": [base * 3]}}}}],
    "requests": [{{"seconds": s, "telemetry": {{"step_s": [s / 2, s / 2], "per_block": [1, 2],
                  "stream_steps": [{{"copy_s": 1.0, "exposed_s": 0.25}}] if spec["arm"] == "slow" else []}}}}
                 for s in seconds],
    "seconds": seconds, "peak_vram_bytes": 2**30, "peak_rss_anon_bytes": 2**29,
    "environment": {{"gpu_name": "Fake GPU"}}, "provenance": {{"arm": spec["arm"], "arm_hash": "h-" + spec["arm"]}},
    "k6_env": sorted(k for k in os.environ if k.startswith("K6_")),
}}
json.dump(record, open(out, "w"))
"""


class SessionSmi:
    """nvidia-smi for a whole session: the GPU is idle between visits; each visit's process is listed while it runs,
    and during the visits in `foreign_in` this test process is listed too (a foreign compute process)."""

    def __init__(self, pid_file: Path, foreign_in: set[int]):
        self.pid_file = pid_file
        self.foreign_in = foreign_in

    def available(self) -> bool:
        return True

    def utilization(self) -> list[int]:
        return [0]

    def compute_pids(self) -> list[int]:
        if not self.pid_file.is_file():
            return []
        pids = [int(line) for line in self.pid_file.read_text().split()]
        if not pids or not Path(f"/proc/{pids[-1]}").exists():
            return []  # like nvidia-smi, list only live processes
        visit = len(pids) - 1
        return [pids[-1], os.getpid()] if visit in self.foreign_in else [pids[-1]]


@pytest.fixture
def fake_python(tmp_path) -> Path:
    path = tmp_path / "fake-python"
    path.write_text(FAKE_VISIT.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _plan(arms, **kw) -> SessionPlan:
    defaults = dict(model="/ckpt", component="pipeline", geometry=Geometry(64, 64, 9), steps=2, guidance=1.0)
    return SessionPlan(arms=tuple(arms), topic="fake", idle_timeout_s=5, **{**defaults, **kw})


def _run(tmp_path, fake_python, plan, foreign_in=frozenset(), environ=None):
    pid_file = tmp_path / "pids"
    env = {"PATH": os.environ.get("PATH", ""), "FAKE_PID_FILE": str(pid_file), **(environ or {})}
    smi = SessionSmi(pid_file, set(foreign_in))
    return run_session(
        plan,
        tmp_path / "sessions",
        smi=smi,
        python=str(fake_python),
        environ=env,
        log=lambda line: None,
        idle_poll_s=0.01,
        watch_poll_s=0.05,
    )


def test_session_records_mirrored_visits_and_flags_contamination(tmp_path, fake_python) -> None:
    plan = _plan(["fast", "slow"], repeats=2, requests=2)
    folder = _run(tmp_path, fake_python, plan, foreign_in={2}, environ={"K6_AUDIO_NORM": "clip"})

    assert folder.parent == tmp_path / "sessions" and folder.name.endswith("_fake")
    session = json.loads((folder / "session.json").read_text())
    assert session["status"] == "complete" and session["plan"]["arms"] == ["fast", "slow"]
    assert [v["arm"] for v in session["order"]] == ["fast", "slow", "slow", "fast"] * 2
    assert session["removed_environment"] == ["K6_AUDIO_NORM"]

    rows = read_jsonl(folder / "visits.jsonl")
    assert [r["arm"] for r in rows] == ["fast", "slow", "slow", "fast"] * 2
    assert [r["visit"] for r in rows] == list(range(8))
    assert all(r["k6_env"] == [] for r in rows)  # the arm alone decides a visit's switches
    assert [r["contaminated"] for r in rows] == [False, False, True, False, False, False, False, False]
    assert rows[2]["gpu_watch"]["foreign_pids"] == [os.getpid()]
    assert all(r["idle_wait"]["idle"] for r in rows)
    assert all(r["returncode"] == 0 and r["process_wall_s"] >= 0.3 for r in rows)
    assert rows[0]["requests"][0]["telemetry"]["per_block"] == [1, 2]  # telemetry passes through whole

    summary = headline(load_session(folder))
    fast, slow = summary["arms"]["fast"], summary["arms"]["slow"]
    assert fast["summary"]["n"] == 8 and slow["summary"]["n"] == 6  # visit 2's two requests left out
    assert slow["contaminated"] == [2]
    assert slow["vs_control"]["speedup"] == pytest.approx(fast["summary"]["median"] / slow["summary"]["median"])
    assert slow["vs_control"]["speedup"] < 0.6 and not slow["vs_control"]["same"]


def test_identical_arms_read_as_no_difference(tmp_path, fake_python) -> None:
    folder = _run(tmp_path, fake_python, _plan(["fast", "fast-too"], requests=3))
    arm = headline(load_session(folder))["arms"]["fast-too"]
    assert arm["vs_control"]["same"]  # 1.0x only differ by the per-visit offsets, inside the control's range


def test_a_failed_visit_is_recorded_and_stops_the_session(tmp_path, fake_python) -> None:
    with pytest.raises(BenchError, match="visit 1 \\(broken\\) failed: visit process exited with status 3"):
        _run(tmp_path, fake_python, _plan(["fast", "broken"]))
    folder = next((tmp_path / "sessions").iterdir())
    rows = read_jsonl(folder / "visits.jsonl")
    assert [r["arm"] for r in rows] == ["fast", "broken"] and "error" in rows[1]
    assert json.loads((folder / "session.json").read_text())["status"] == "failed"
    readme = tmp_path / "README.md"
    render(tmp_path / "sessions", readme, plots=False)
    assert "visit 1 (broken) failed" in readme.read_text()


def test_same_topic_same_day_gets_a_new_folder(tmp_path, fake_python) -> None:
    first = _run(tmp_path, fake_python, _plan(["fast"], order="ABAB"))
    second = _run(tmp_path, fake_python, _plan(["fast"], order="ABAB"))
    assert second.name == first.name + "_2"


def test_report_keeps_the_preamble_and_regenerates_below_the_marker(tmp_path, fake_python) -> None:
    folder = _run(tmp_path, fake_python, _plan(["fast", "slow", "diffusers"], requests=1), foreign_in={1})
    readme = tmp_path / "README.md"
    readme.write_text("# Our measurements\n\nHand-written notes that must survive.\n")
    render(tmp_path / "sessions", readme)
    text = readme.read_text()
    head, _, body = text.partition(MARKER)
    assert head.startswith("# Our measurements\n\nHand-written notes that must survive.\n")
    assert f"### {folder.name}" in body and "Fake GPU" in body
    assert "`diffusers` (peer)" in body and "`fast` (control)" in body
    slow_row = next(line for line in body.splitlines() if line.startswith("| `slow`"))
    assert slow_row.split("|")[2].strip() == "1"  # one clean visit of two
    assert slow_row.rstrip(" |").endswith("1")  # the contaminated visit is listed
    assert "| copies hidden |" in body and "| 75.0% |" in slow_row  # streamed weights: 1 - 0.25 / 1.0
    assert f"](sessions/{folder.name}/plot.png)" in body
    assert (folder / "plot.png").read_bytes().startswith(b"\x89PNG")

    # A second render replaces the generated part and leaves the preamble alone.
    readme.write_text(text.replace("Hand-written notes", "Edited notes") + "\nstale generated line\n")
    render(tmp_path / "sessions", readme)
    again = readme.read_text()
    assert "Edited notes that must survive." in again and "stale generated line" not in again
    assert again.count(MARKER) == 1


def test_gate_report_adds_lpips_and_a_second_panel(tmp_path, fake_python) -> None:
    folder = _run(tmp_path, fake_python, _plan(["fast", "slow"]))
    gate = {"arms": [{"label": "slow", "arm": "arms/slow.env", "arm_hash": "h-slow", "set": {"lpips_mean": 0.0421}}]}
    (folder / "gate.json").write_text(json.dumps(gate))
    readme = tmp_path / "README.md"
    render(tmp_path / "sessions", readme)
    assert "mean LPIPS `slow` 0.0421" in readme.read_text()
    import matplotlib.image

    with_gate = matplotlib.image.imread(folder / "plot.png").shape[1]
    (folder / "gate.json").unlink()
    render(tmp_path / "sessions", readme)
    assert with_gate > 1.5 * matplotlib.image.imread(folder / "plot.png").shape[1]  # the speed-vs-LPIPS panel


def test_report_without_matplotlib_says_how_to_proceed(tmp_path, fake_python, monkeypatch) -> None:
    _run(tmp_path, fake_python, _plan(["fast"], order="ABAB"))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(RuntimeError, match="pass --no-plot"):
        render(tmp_path / "sessions", tmp_path / "README.md")
    render(tmp_path / "sessions", tmp_path / "README.md", plots=False)
    assert MARKER in (tmp_path / "README.md").read_text()


def test_plan_and_arm_validation(tmp_path) -> None:
    with pytest.raises(ValueError, match="component"):
        _plan(["a"], component="vae")
    with pytest.raises(ValueError, match="topic"):
        SessionPlan(("a",), "/m", "dit", Geometry(64, 64, 9), 2, 1.0, topic="../escape")
    with pytest.raises(ValueError, match="nearest valid"):
        parse_geometry("100x64x9")
    assert parse_geometry("w1") == Geometry(864, 480, 121) and parse_geometry("32x48x5") == Geometry(32, 48, 5)
    assert check_arm("diffusers-offload") == "diffusers-offload" and check_arm("reference") == "reference"
    arm_file = tmp_path / "mine.env"
    arm_file.write_text("K6_AUDIO_NORM=clip\n")
    assert check_arm(str(arm_file)) == str(arm_file.resolve())
    arm_file.write_text("K6_AUDIO_NORMAL=clip\n")
    with pytest.raises(ValueError, match="unknown switch"):
        check_arm(str(arm_file))
    env, removed = child_environment({"K6_X": "1", "PATH": "/bin", "XK6_": "2"})
    assert env == {"PATH": "/bin", "XK6_": "2"} and removed == ["K6_X"]


def test_session_switches_reach_every_k6fast_visit_and_the_peer_budget() -> None:
    from k6fast.bench.peers import peer_budget_gb
    from k6fast.bench.session import parse_session_switch
    from k6fast.bench.visit import make_runner

    pair = parse_session_switch("K6_MAX_RESIDENT_BLOCKS=4")
    plan = _plan(["reference", "diffusers"], switches=(pair, ("K6_VRAM_BUDGET_GB", "32")))
    ref, peer = plan.visits("s")[:2]
    assert ref.switches == {"K6_MAX_RESIDENT_BLOCKS": "4", "K6_VRAM_BUDGET_GB": "32"}
    options = make_runner(ref).options
    assert (options.max_resident_blocks, options.vram_budget_gb) == (4, 32.0)
    assert peer_budget_gb(peer) == 32.0 and peer_budget_gb(_plan(["diffusers"]).visits("s")[0]) == 0.0
    assert plan.as_dict()["switches"] == {"K6_MAX_RESIDENT_BLOCKS": "4", "K6_VRAM_BUDGET_GB": "32"}
    with pytest.raises(ValueError, match="did you mean K6_VRAM_BUDGET_GB"):
        parse_session_switch("K6_VRAM_BUDGET=32")
    with pytest.raises(ValueError, match="K6_MAX_RESIDENT_BLOCKS"):
        parse_session_switch("K6_MAX_RESIDENT_BLOCKS=many")
    with pytest.raises(ValueError, match="expected K6_NAME=VALUE"):
        parse_session_switch("K6_COMPILE")
    with pytest.raises(ValueError, match="set twice"):
        _plan(["reference"], switches=(pair, pair))
    with pytest.raises(ValueError, match="secret"):
        parse_session_switch("K6_API_KEY=hunter2")
    command = with_command(plan, "out").command
    assert command.endswith("--set K6_MAX_RESIDENT_BLOCKS=4 --set K6_VRAM_BUDGET_GB=32"), command
