"""`k6fast bench` for real on the CPU with the tiny checkpoint: every visit a fresh `python -m k6fast.bench.visit`
process. An A B B A pipeline session of the reference against an arm file that sets every switch explicitly to its
default, the diffusers peer row, and the dit and block components for k6fast and the peer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k6fast.bench.cli import main
from k6fast.bench.records import load_session, read_jsonl
from k6fast.bench.report import MARKER, headline
from k6fast.bench.session import SessionPlan, run_session
from k6fast.bench.workload import Geometry
from k6fast.switches import SWITCHES

PHASES = {"load", "text_encode", "denoise", "video_decode", "audio_decode", "mux"}


def _only_folder(root: Path) -> Path:
    (folder,) = [p for p in root.iterdir() if p.is_dir()]
    return folder


def _run(tmp_path: Path, model: Path, arms: tuple[str, ...], component: str) -> list[dict]:
    plan = SessionPlan(
        arms=arms,
        model=str(model),
        component=component,
        geometry=Geometry(64, 64, 9),
        steps=2,
        guidance=1.0,
        topic=component,
        order="ABAB",
        device="cpu",
        idle_timeout_s=0,
        warmup=0,  # the A B B A test keeps the protocol's warm-up; these check what a visit records
    )
    folder = run_session(plan, tmp_path / "sessions", log=lambda line: None)
    return read_jsonl(folder / "visits.jsonl")


def test_abba_session_of_two_equal_arms(tiny_distill, tmp_path, capsys) -> None:
    all_off = tmp_path / "all-off.env"
    all_off.write_text("".join(f"{s.name}={s.format(s.default)}\n" for s in SWITCHES if not s.secret))
    out = tmp_path / "measurements" / "sessions"
    argv = ["bench", "--model", str(tiny_distill), "--arms", f"reference,{all_off}", "--geometry", "smoke"]
    argv += ["--steps", "2", "--component", "pipeline", "--device", "cpu", "--topic", "equal-arms"]
    argv += ["--out", str(out), "--idle-timeout", "0"]
    assert main(argv) == 0
    assert "| `all-off.env` |" in capsys.readouterr().out  # the session's table is printed at the end

    folder = _only_folder(out)
    rows = read_jsonl(folder / "visits.jsonl")
    assert [r["arm"] for r in rows] == ["reference", str(all_off), str(all_off), "reference"]
    assert [r["position"] for r in rows] == [0, 1, 2, 3]
    assert len({r["environment"]["pid"] for r in rows}) == 4  # a fresh process per visit
    for row in rows:
        assert row["geometry"] == "64x64x9" and row["steps"] == 2 and row["dtype"] == "float32"
        assert len(row["warmup"]) == 1 and len(row["requests"]) == 1 and row["seconds"][0] > 0
        telemetry = row["requests"][0]["telemetry"]
        assert PHASES - {"load"} <= set(telemetry["phases_s"]) and len(telemetry["step_s"]) == 2
        assert row["load_s"] > 0 and row["peak_rss_anon_bytes"] >= row["rss_anon_end_bytes"] > 0
        assert row["environment"]["versions"]["torch"] and row["environment"]["hostname"]
        assert row["provenance"]["switches"]["K6_AUDIO_NORM"] == "peak"
        assert row["contaminated"] is False and "error" not in row
    # Every switch off is the reference: the same hash, whatever the arm is called.
    assert len({r["provenance"]["arm_hash"] for r in rows}) == 1
    assert {r["provenance"]["arm"] for r in rows} == {"reference", str(all_off)}

    summary = headline(load_session(folder))
    assert summary["arms"]["reference"]["summary"]["n"] == 2 and summary["arms"][str(all_off)]["summary"]["n"] == 2

    assert main(["bench", "report", "--sessions", str(out)]) == 0
    readme = (out.parent / "README.md").read_text()
    assert MARKER in readme and f"### {folder.name}" in readme and "| `reference` (control) | 2 |" in readme
    assert (folder / "plot.png").read_bytes().startswith(b"\x89PNG")
    command = json.loads((folder / "session.json").read_text())["command"]
    assert command.startswith(f"k6fast bench --model {tiny_distill} --arms reference,{all_off} --component pipeline")


def test_diffusers_peer_visit(tiny_distill, tmp_path) -> None:
    (row,) = _run(tmp_path, tiny_distill, ("diffusers",), "pipeline")
    assert "error" not in row and row["provenance"]["peer"]["library"] == "diffusers"
    telemetry = row["requests"][0]["telemetry"]
    assert PHASES - {"load"} <= set(telemetry["phases_s"]) and len(telemetry["step_s"]) == 2
    assert telemetry["dit_calls"] == 2 and row["seconds"][0] >= sum(telemetry["step_s"])


@pytest.mark.parametrize("component", ["dit", "block"])
def test_dit_and_block_components(tiny_distill, tmp_path, component) -> None:
    rows = _run(tmp_path, tiny_distill, ("reference", "diffusers"), component)
    assert [r["arm"] for r in rows] == ["reference", "diffusers"]
    phase = "dit_forward" if component == "dit" else "block"
    for row in rows:
        assert "error" not in row, row.get("error")
        telemetry = row["requests"][0]["telemetry"]
        assert set(telemetry["phases_s"]) == {phase} and row["seconds"][0] > 0
        assert telemetry["step_s"] == [pytest.approx(row["seconds"][0], abs=1e-6)]
