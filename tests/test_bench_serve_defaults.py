"""measurements/bench_serve_defaults.py end to end on the CPU: a real `k6fast serve` of the tiny checkpoint with no
size options, driven by the script through the openai SDK and through plain HTTP, its record's shape, every job
completed or deleted as planned, and a request beyond the server's limits refused before it is queued. The record
lands in an acceptance record folder, whose README then shows it.

The tiny checkpoint cannot show a refusal by the VRAM budget here: its text phase needs more room than the
activations of any clip within the CPU's limits, so every such clip fits once the text phase does; the refusal itself
is the server's, tested with the server (test_server_limits.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from k6fast.bench.acceptance_report import PLAN_FILE
from k6fast.server.config import CPU_LIMITS

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "measurements" / "bench_serve_defaults.py"
LARGE, SMALL = (96, 64, 9), (64, 64, 5)
OVERSIZE = (64, 64, CPU_LIMITS.max_frames + 4)  # one latent frame more than `serve` takes on a CPU by default
BUDGET_GB = 8


def _record_dir(tmp_path: Path, tiny_distill: Path) -> Path:
    record_dir = tmp_path / "record"
    record_dir.mkdir()
    plan = {"model": str(tiny_distill), "geometry": "64x64x5", "steps": 20, "started": "now", "argv": ["k6fast"]}
    (record_dir / PLAN_FILE).write_text(json.dumps(plan))
    return record_dir


def label(geometry: tuple[int, int, int]) -> str:
    return "x".join(map(str, geometry))


@pytest.mark.parametrize("client", ["sdk", "http"])
def test_serve_at_its_defaults_on_the_tiny_checkpoint(client: str, tiny_distill: Path, tmp_path: Path) -> None:
    if client == "sdk":
        pytest.importorskip("openai")
    record_dir = _record_dir(tmp_path, tiny_distill)
    # 20 steps, the distilled checkpoint's most: the third job is still running when it passes 30 %.
    command = [sys.executable, "-W", "ignore::DeprecationWarning", str(SCRIPT), "--model", str(tiny_distill),
               "--budget-gb", str(BUDGET_GB), "--large", label(LARGE), "--small", label(SMALL),
               "--oversize", label(OVERSIZE), "--steps", "20", "--record", str(record_dir),
               "--work", str(tmp_path / "work"), "--timeout-s", "400", "--start-timeout-s", "300",
               *(["--http"] if client == "http" else [])]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    out = record_dir / "serve" / f"env-{BUDGET_GB}.json"
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["passed"] and record["problems"] == []
    assert record["client"].startswith("openai" if client == "sdk" else "plain HTTP")
    assert record["server_command"][3:5] == ["serve", "--model"]
    assert not any(a in record["server_command"] for a in ("--max-size", "--max-frames", "--default-size"))
    assert float(record["provenance"]["switches"]["K6_VRAM_BUDGET_GB"]) == BUDGET_GB
    assert record["startup"]["ready_s"] > 0 and record["startup"]["peak_rss_bytes"] > 0
    assert record["peak_rss_bytes"] >= record["startup"]["peak_rss_bytes"]
    assert record["disk_read_bytes"] is not None and record["stop"]["exit"] is not None

    jobs = {job["name"]: job for job in record["jobs"]}
    assert [j["outcome"] for j in record["jobs"]] == ["completed", "completed", "deleted", "completed"]
    assert [j["geometry"] for j in record["jobs"]] == [label(LARGE), label(SMALL), label(LARGE), label(SMALL)]
    assert [j["prompt"] for j in record["jobs"]] == ["first", "first", "first", "second"]
    for job in record["jobs"]:
        assert job["done_after_s"] >= job["started_after_s"] >= job["submitted_after_s"] >= 0, job
        assert job["peak_rss_bytes"] > 0 and job["disk_read_bytes"] is not None
        if job["outcome"] == "completed":
            phases = job["telemetry"]["phases_s"]
            assert {"text_encode", "denoise", "video_decode", "mux"} <= set(phases) and job["telemetry"]["job_s"] > 0
            assert job["content_bytes"] > 0
    deleted = jobs["large-deleted"]
    assert "telemetry" not in deleted
    assert deleted["delete"]["status"] == 200 and deleted["delete"]["progress"] >= 30
    assert deleted["delete"]["phase"] == "denoise" and 0 < deleted["delete"]["took_effect_s"] < 60
    # The worker ran the jobs in order: each started as the one before it ended.
    starts = [j["started_after_s"] for j in record["jobs"]]
    assert starts == sorted(starts)

    oversize = record["oversize"]
    assert oversize["status"] == 400 and oversize["queued"] is False
    assert f"maximum of {CPU_LIMITS.max_frames} frames" in oversize["message"]

    readme = (record_dir / "README.md").read_text()
    assert "## `k6fast serve` at its defaults" in readme
    assert readme.count("| env @ ") == 4 and "DELETE at " in readme and "not queued" in readme


def test_only_the_first_job(tiny_distill: Path, tmp_path: Path) -> None:
    """--jobs first: one job from a fresh prompt and the oversize request (an arm and budget beyond the one measured
    in full), through plain HTTP."""
    record_dir = _record_dir(tmp_path, tiny_distill)
    command = [sys.executable, str(SCRIPT), "--model", str(tiny_distill), "--budget-gb", str(BUDGET_GB),
               "--large", label(LARGE), "--oversize", label(OVERSIZE), "--steps", "2", "--jobs", "first",
               "--record", str(record_dir), "--timeout-s", "400", "--start-timeout-s", "300", "--http"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((record_dir / "serve" / f"env-{BUDGET_GB}-first.json").read_text())
    assert record["passed"] and record["jobs_set"] == "first"
    assert [(j["name"], j["outcome"], j["geometry"]) for j in record["jobs"]] == [
        ("large-first-prompt", "completed", label(LARGE))
    ]
    assert record["oversize"]["status"] == 400 and record["oversize"]["queued"] is False
    readme = (record_dir / "README.md").read_text()
    assert readme.count("| env @ ") == 1 and "the first job only (`--jobs first`)" in readme
