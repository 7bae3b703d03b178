"""A ballast row of `k6fast acceptance` carries `k6fast doctor`'s prediction of its disk reads per step and the
measured counterpart (k6fast/bench/disk_prediction.py): the prediction is doctor's own function called with the
host memory the row saw and the session's read speed; the measured bytes come from read_bytes at the step
boundaries the child's progress bar shows; the table shows both only where a row has them."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import k6fast.bench.acceptance as acceptance
from k6fast.bench import disk_prediction
from k6fast.bench.acceptance_report import COLUMNS, EXTRA_COLUMNS, PREDICTION_COLUMNS, render_table
from k6fast.bench.disk_prediction import StepReads, steady_reads, step_forwards
from k6fast.bench.records import read_jsonl
from k6fast.dit.config import BLOCK_PREFIX
from k6fast.doctor import dit_plan, predict_disk_per_step, read_gpus
from k6fast.memory import CgroupLimit, GiB, HostMemory


def _bar(done: int, total: int) -> str:
    """The denoise bar as tqdm writes it to a file (carriage return first)."""
    return f"\rdenoise: {100 * done // total:3d}%|{'#' * done}{' ' * (total - done)}| {done}/{total} [00:01<00:03]"


def test_step_reads_takes_the_last_count_of_the_bar_even_split_across_reads(tmp_path) -> None:
    log = tmp_path / "stderr.log"
    log.write_text("loading\n" + _bar(0, 4))
    steps = StepReads(log)
    steps.record(steps.poll(), 100)
    steps.record(steps.poll(), 150)  # nothing new in the log: no count, nothing recorded
    text = _bar(1, 4) + _bar(2, 4)
    with open(log, "a") as f:
        f.write(text[: text.rindex("2/4")])  # the bar of step 2 cut before its count
    steps.record(steps.poll(), 1000)
    with open(log, "a") as f:
        f.write(text[text.rindex("2/4") :])
    steps.record(steps.poll(), 1600)
    steps.record(None, 9999)
    assert steps.at == {0: 100, 1: 1000, 2: 1600} and steps.total == 4


def test_steady_reads_per_forward_from_the_first_boundary_after_the_first_step() -> None:
    at = {0: 10, 1: 1_000, 2: 1_500, 4: 2_500}  # step 3's boundary not seen: steps 2..4 span 1_500 bytes
    assert steady_reads(at, {}) == {"bytes": 500, "read_bytes": 1_500, "forwards": 3, "from_step": 1, "to_step": 4}
    assert steady_reads(at, {3: 0})["bytes"] == 750  # a cached step runs no forward
    assert steady_reads(at, {2: 2, 3: 2, 4: 2})["bytes"] == 250  # CFG: two forwards a step
    assert steady_reads({0: 10, 1: 1_000}, {}) is None  # one boundary after the first step: no steady step
    assert steady_reads({1: 5, 2: 5}, {2: 0}) is None


def test_step_forwards_from_the_sidecar_and_the_arms_cache_steps() -> None:
    telemetry = {"step_s": [1.0] * 5, "dit_calls": 6, "cached_steps": 2, "step_cache": {"skipped_steps": [1]}}
    assert step_forwards(telemetry, (3,)) == {1: 2, 2: 0, 3: 2, 4: 0, 5: 2}
    assert step_forwards({"step_s": [1.0, 1.0], "dit_calls": 2}, ()) == {1: 1, 2: 1}
    # A sidecar with step_called says what ran: the arm's cache steps are not applied on a base checkpoint.
    called = {"step_s": [1.0] * 4, "dit_calls": 8, "cached_steps": 0, "step_called": [True] * 4}
    assert step_forwards(called, (2,)) == {1: 2, 2: 2, 3: 2, 4: 2}
    called.update(dit_calls=6, cached_steps=1, step_called=[True, False, True, True])
    assert step_forwards(called, ()) == {1: 2, 2: 0, 3: 2, 4: 2}


def _deeper(tiny: Path, out: Path, blocks: int) -> Path:
    """The tiny checkpoint with `blocks` fused blocks (copies of its own): with two, every plan keeps both resident
    or fails, so nothing would stream."""
    shutil.copytree(tiny, out)
    folder = out / "transformer"
    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
        shard.unlink()
    (folder / "diffusion_pytorch_model.safetensors.index.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    have = config["num_visual_blocks"]
    for name, tensor in list(tensors.items()):
        if name.startswith(f"{BLOCK_PREFIX}0."):
            for b in range(have, blocks):
                tensors[f"{BLOCK_PREFIX}{b}." + name.split(".", 2)[-1]] = tensor.clone()
    save_file(tensors, str(folder / "diffusion_pytorch_model.safetensors"))
    (folder / "config.json").write_text(json.dumps({**config, "num_visual_blocks": blocks}))
    return out


# A `k6fast generate` stand-in: the denoise bar in its log, a step every 0.6 s (the watcher samples every 0.25 s),
# and the sidecar the row is read from.
FAKE_GENERATE = """
import json, sys, time
run_dir, total = sys.argv[1], 4
for done in range(total + 1):
    sys.stderr.write(f"\\rdenoise: {100 * done // total:3d}%|{'#' * done}{' ' * (total - done)}| {done}/{total} [x]")
    sys.stderr.flush()
    time.sleep(0.6)
telemetry = {"phases_s": {"text_encode": 0.1, "denoise": 2.4}, "step_s": [0.6] * total, "dit_calls": total}
open(run_dir + "/clip.mp4.json", "w").write(json.dumps({"telemetry": telemetry}))
"""


class FakeBallast:
    def __init__(self, leave_gb: float, python: str = sys.executable):
        self.description = f"held nothing (test), leaving {leave_gb:g} GB"

    def close(self) -> None:
        pass


def test_a_ballast_row_carries_doctors_prediction_and_the_measured_figure(tiny_distill, tmp_path, monkeypatch):
    model = _deeper(tiny_distill, tmp_path / "deep", blocks=8)
    geometry = (64, 64, 5)
    wide = dit_plan(model, 64 * GiB, None, arm="reference", geometry=geometry)
    assert wide["resident_blocks"] == 8  # nothing streams at a large budget
    room = max(wide["activation_bytes"], wide["text_bytes"])
    budget_gb = (wide["fixed_bytes"] + room + wide["reserve_bytes"] + 5.5 * wide["block_bytes"]) / GiB
    # A host whose cgroup is tighter than MemAvailable, with room for about 2.5 blocks beside the process and the OS.
    cgroup = CgroupLimit("/test.slice", limit_bytes=12 * GiB, usage_bytes=2 * GiB - 5 * wide["block_bytes"] // 2)
    host = HostMemory(total_bytes=64 * GiB, available_bytes=40 * GiB, process_bytes=3 * GiB, cgroup=cgroup)
    monkeypatch.setattr(disk_prediction.memory, "host_memory", lambda: host)
    monkeypatch.setattr(acceptance, "Ballast", FakeBallast)
    monkeypatch.setattr(acceptance, "generate_command", lambda run, w, run_dir, python: [
        python, "-c", FAKE_GENERATE, str(run_dir)])  # fmt: skip
    w = acceptance.Workload(model=str(model), geometry="64x64x5", prompt="p", seed=1, steps=4, guidance=1.0)
    run = acceptance.Run("reference", budget_gb, "warm", host_ram_gb=60)
    out = tmp_path / "record"
    acceptance.run_acceptance([run], w, out=out, work=tmp_path / "work", timeout_s=60, log=lambda line: None)

    session = json.loads((out / "acceptance.json").read_text())
    speed = session["disk_read_test"]["read_gb_s"]
    assert speed > 0 and "cached pages dropped first" in session["disk_read_test"]["note"]
    (row,) = read_jsonl(out / "runs.jsonl")
    assert row["passed"], row.get("error")
    plan = dit_plan(model, int(budget_gb * GiB), (read_gpus() or [None])[0], arm="reference", geometry=geometry)
    direct = predict_disk_per_step(plan, host.available_bytes, speed, cgroup)
    predicted = row["disk_prediction"]
    assert predicted["doctor"] == direct and predicted["cgroup"]["limit_bytes"] == 12 * GiB
    assert 0 < direct["host_blocks"] < direct["streamed_blocks"] == 5  # the tier holds some, the rest is read
    assert predicted["host_cache_gb"] == "auto" and predicted["step_bytes"] == direct["with_tier_bytes"] > 0
    assert predicted["step_min_s"] == pytest.approx(direct["with_tier_bytes"] / 1e9 / speed)

    measured = row["disk_per_step"]
    assert measured["predicted_bytes"] == direct["with_tier_bytes"]
    boundaries = {int(k): v for k, v in measured["boundaries"].items()}
    assert set(boundaries) <= set(range(5)) and len([k for k in boundaries if k >= 1]) >= 2, boundaries
    k0, k1 = min(k for k in boundaries if k >= 1), max(boundaries)
    assert measured["measured"]["from_step"] == k0 and measured["measured"]["to_step"] == k1
    assert measured["measured_bytes"] == round((boundaries[k1] - boundaries[k0]) / (k1 - k0))
    assert measured["measured_s"] == pytest.approx(0.6)  # the sidecar's step_s over the same steps, per forward
    table = (out / "README.md").read_text()
    assert "| disk GB/step predicted / measured | s/step floor / measured |" in table
    assert "predict_disk_per_step" in table  # the columns' note
    assert f"- checkpoint read speed before the ballast runs: {speed:.2f} GB/s" in table


def test_the_prediction_columns_only_where_the_rows_have_them() -> None:
    plan = {"model": "m", "geometry": "864x480x121", "steps": 10, "argv": ["k6fast"]}
    old = {"run": "final @ 32 GiB, warm", "arm": "final", "passed": True, "request_s": 50.0, "disk_read_bytes": 0}
    before = render_table([old], plan)
    assert "predicted" not in before and "floor" not in before
    ballast = {**old, "run": "final @ 32 GiB, warm, 60 GB host", "disk_read_bytes": 368_500_000_000,
               "disk_per_step": {"predicted_bytes": 30_120_000_000, "predicted_min_s": 12.04,
                                 "measured_bytes": 33_480_000_000, "measured_s": 19.26}}  # fmt: skip
    unmeasured = {**ballast, "disk_per_step": {"predicted_bytes": 0, "predicted_min_s": None}}
    table = render_table([old, ballast, unmeasured], plan)
    assert "| " + " | ".join(COLUMNS + EXTRA_COLUMNS + PREDICTION_COLUMNS) + " |" in table
    rows = [line for line in table.splitlines() if line.startswith("| final")]
    assert rows[0].endswith("| 0.00 | — | — | — |")
    assert rows[1].endswith("| 30.12 / 33.48 | 12.0 / 19.3 |")
    assert rows[2].endswith("| 0.00 / — | — / — |")
    assert len({r.count(" | ") for r in rows}) == 1


def test_the_prediction_follows_an_arm_that_sets_a_tier_size(tiny_distill, tmp_path, monkeypatch) -> None:
    """An arm whose file sets K6_HOST_CACHE_GB to a size is predicted with that tier (it was left unpredicted), and
    one the host cannot spare is predicted as the refusal the run will meet."""
    model = _deeper(tiny_distill, tmp_path / "deep", blocks=8)
    geometry = (64, 64, 5)
    wide = dit_plan(model, 64 * GiB, None, arm="reference", geometry=geometry)
    room = max(wide["activation_bytes"], wide["text_bytes"])
    budget_gb = (wide["fixed_bytes"] + room + wide["reserve_bytes"] + 5.5 * wide["block_bytes"]) / GiB
    cgroup = CgroupLimit("/test.slice", limit_bytes=12 * GiB, usage_bytes=2 * GiB - 5 * wide["block_bytes"] // 2)
    host = HostMemory(total_bytes=64 * GiB, available_bytes=40 * GiB, process_bytes=3 * GiB, cgroup=cgroup)
    monkeypatch.setattr(disk_prediction.memory, "host_memory", lambda: host)
    stored = dit_plan(model, int(budget_gb * GiB), None, arm="reference", geometry=geometry)["streamed_stored_bytes"]
    sized = tmp_path / "sized.env"
    sized.write_text(f"K6_HOST_CACHE_GB={1.1 * stored[-1] / GiB:.9f}\n")  # room for the last block, not two
    predicted = disk_prediction.predict(str(model), str(sized), budget_gb, geometry, 2.0)
    doctor = predicted["doctor"]
    assert doctor["host_blocks"] == 1 and doctor["tier_refused"] is None
    assert predicted["step_bytes"] == doctor["with_tier_bytes"] > 0
    huge = tmp_path / "huge.env"
    huge.write_text("K6_HOST_CACHE_GB=1000\n")
    refused = disk_prediction.predict(str(model), str(huge), budget_gb, geometry, 2.0)
    assert refused["step_bytes"] is None and "K6_HOST_CACHE_GB=1000 is more than" in refused["doctor"]["tier_refused"]
