"""The start-up profile a `k6fast generate` process writes into its sidecar (`"process"`), and how the process ends.

The `k6fast` command itself (here `python -m k6fast.cli`) times its parts from the process's start (by the kernel's
account) to its end, each second in one part, and ends without the interpreter's teardown once every file is written
(`k6fast.entry.end_process`); a caller of `main(argv)` keeps its process, and its sidecar says no teardown was timed.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
import weakref
from pathlib import Path

from safetensors.torch import load_file

from k6fast.cli import collector_paused, main
from k6fast.media import probe_mp4
from k6fast.telemetry import StartupClock, process_age_s

GEN = ["generate", "--prompt", "A fox runs through snow", "--size", "32x32", "--frames", "9", "--steps", "2"]
# What the load of a tiny checkpoint is made of, each timed on its own (README "Start-up profile").
STARTUP_PARTS = {
    "interpreter", "checks", "checkpoint", "imports_torch", "cuda_context", "dit_start", "imports_libraries",
    "imports_k6fast",
    "imports_collect", "text_setup", "plan", "resident_upload", "staging", "dit_build", "decoders", "load_other",
    "before_request",
}  # fmt: skip
# The parts timed inside the pipeline's load, which have no processor time of their own. The DiT's (plan,
# resident_upload, staging, dit_build) are timed on the thread that builds it from "dit_start" on, beside the imports.
LOAD_PARTS = {"text_setup", "plan", "resident_upload", "staging", "dit_build", "decoders", "load_other"}
IMPORT_PARTS = ("imports_torch", "imports_libraries", "imports_k6fast")
# The kernel counts a process's start and its uptime in 10 ms ticks: the process's own age may read one tick long.
TICK_S = 0.01


DIT_PARTS = ("plan", "resident_upload", "staging", "dit_build")


def _profile_sum(process: dict) -> float:
    """The process's age by its parts: the DiT's seconds that ran beside the imports are in its parts and theirs."""
    after = [process[k] for k in ("request_s", "latents_s", "teardown_s") if process.get(k) is not None]
    return sum(process["startup_s"].values()) + sum(after) - process["load_overlapped_s"]


def test_the_command_profiles_its_start_up_and_ends_once_its_files_are_written(tiny_distill: Path, tmp_path) -> None:
    out, latents = tmp_path / "fox.mp4", tmp_path / "fox.safetensors"
    args = [*GEN, "--model", str(tiny_distill), "--out", str(out), "--save-latents", str(latents)]
    environ = {k: v for k, v in os.environ.items() if not k.startswith("K6_")}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "k6fast.cli", *args], capture_output=True, text=True, cwd=tmp_path,
                          env=environ, timeout=600)  # fmt: skip
    wall = time.perf_counter() - start
    assert done.returncode == 0, done.stderr[-3000:]
    # The last line printed before the process ended reached the pipe: its buffers were flushed.
    assert done.stderr.rstrip().endswith(f"wrote {out} and {out}.json"), done.stderr[-500:]
    record = json.loads((tmp_path / "fox.mp4.json").read_text())
    process = record["process"]
    assert process["origin"] == "process start"
    assert set(process["startup_s"]) == STARTUP_PARTS
    seconds = [*process["startup_s"].values(), process["request_s"], process["latents_s"], process["teardown_s"]]
    assert all(s >= 0 for s in seconds), process
    assert all(process["startup_s"][k] > 0 for k in IMPORT_PARTS) and process["request_s"] > 0
    # Processor time for each part lapped whole, the request's and the teardown's included.
    assert set(process["cpu_s"]) == STARTUP_PARTS - LOAD_PARTS | {"request", "latents", "teardown"}
    assert all(process["cpu_s"][k] > 0 for k in IMPORT_PARTS), process["cpu_s"]
    assert process["cuda_initialized_before_context"] is False  # importing PyTorch starts no CUDA context
    assert process["gc_frozen"] > 100_000  # the imports' objects frozen, not collected: the process ends with them
    bytecode = process["bytecode"]
    assert 0 <= bytecode["compiled"] <= bytecode["source_modules"] and bytecode["source_modules"] > 1000, bytecode
    # The DiT's build ran beside the imports for at most its own seconds, which its parts keep whole.
    assert 0 <= process["load_overlapped_s"] <= sum(process["startup_s"][k] for k in DIT_PARTS) + 1e-3, process
    # Parts each second counted once but those: together the process's age when it ended, no more than its wall time.
    assert abs(_profile_sum(process) - process["ended_at_s"]) < 1e-3 * len(seconds)
    assert process["ended_at_s"] <= wall + TICK_S, (process, wall)
    # The DiT's parts and the decoders are the load's own seconds (`load_s`), beside the imports or not.
    inside = ("plan", "resident_upload", "staging", "dit_build", "decoders")
    assert sum(process["startup_s"][k] for k in inside) <= record["load_s"] + 1e-3
    # Every file is whole although the interpreter never tore down: the clip, its latents, the sidecar.
    assert probe_mp4(out).frame_count == 9
    assert set(load_file(latents)) == {"video", "audio"}
    assert record["telemetry"]["phases_s"]["denoise"] <= process["request_s"]


def test_a_caller_of_main_keeps_its_process_and_no_teardown_is_timed(tiny_distill: Path, tmp_path) -> None:
    out, frozen = tmp_path / "fox.mp4", gc.get_freeze_count()
    assert main([*GEN, "--model", str(tiny_distill), "--out", str(out)]) == 0
    assert gc.isenabled()  # the garbage collector, paused for the imports, is back
    process = json.loads((tmp_path / "fox.mp4.json").read_text())["process"]
    assert process["gc_frozen"] == gc.get_freeze_count() == frozen  # a caller's objects are not frozen
    assert process["origin"] == "clock"  # timed from the call, not from the start of the test's process
    assert process["teardown_s"] is None and process["ended_at_s"] is None and "latents_s" not in process
    assert set(process["startup_s"]) == STARTUP_PARTS and process["request_s"] > 0


class _Node:
    next: _Node | None = None


def test_the_collector_is_paused_inside_and_left_as_it_was_found() -> None:
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        cycle = _Node()
        cycle.next = cycle
        freed = weakref.finalize(cycle, lambda: None)  # alive while the cycle is
        del cycle
        assert freed.alive  # paused: nothing collects the cycle inside
    assert gc.isenabled() and not freed.alive  # collected on the way out
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # a caller that had it off keeps it off
    finally:
        gc.enable()


def test_a_process_that_ends_with_the_command_freezes_the_imports_objects() -> None:
    frozen = gc.get_freeze_count()
    try:
        with collector_paused(freeze=True):
            assert not gc.isenabled()
            cycle = _Node()
            cycle.next = cycle
            kept = weakref.finalize(cycle, lambda: None)
            del cycle
        assert gc.isenabled() and gc.get_freeze_count() > frozen
        gc.collect()
        assert kept.alive  # frozen: no collection scans it again
    finally:
        gc.unfreeze()  # this test's process goes on: its objects back where the collector sees them
    gc.collect()
    assert not kept.alive


def test_laps_split_a_span_into_its_own_parts_and_the_rest() -> None:
    clock = StartupClock(from_process_start=False)
    time.sleep(0.02)
    clock.lap("a")
    time.sleep(0.03)
    clock.lap_split({"inner": 0.01}, "rest")
    parts = clock.as_dict()["startup_s"]
    assert list(parts) == ["a", "rest", "inner"] and parts["inner"] == 0.01
    assert parts["a"] >= 0.02 and parts["rest"] + parts["inner"] >= 0.03
    assert list(clock.as_dict()["cpu_s"]) == ["a"]  # a split span's parts have no processor time of their own


def test_a_split_spans_parts_that_ran_before_it_are_counted_once_in_the_age() -> None:
    """A part timed on another thread that began before the span (the DiT's build, beside the imports): it keeps its
    whole seconds, the span's remainder only what the span held besides it, and the process's age is the parts' sum
    less what ran beside the earlier laps."""
    clock = StartupClock(from_process_start=False)
    began = time.perf_counter()
    time.sleep(0.05)
    clock.lap("imports")  # the other thread's build running beside it
    beside = time.perf_counter() - began
    time.sleep(0.03)
    build = time.perf_counter() - began  # the build ends in the span
    clock.lap_split({"build": build}, "rest", overlapped=beside)
    clock.lap("teardown")
    clock.ended = True
    out = clock.as_dict()
    assert out["load_overlapped_s"] == round(beside, 4) and out["startup_s"]["build"] == round(build, 4)
    assert 0 <= out["startup_s"]["rest"] < 0.005  # the span held the build's last seconds and nothing else
    age = sum(out["startup_s"].values()) + out["teardown_s"] - out["load_overlapped_s"]
    assert abs(out["ended_at_s"] - age) < 1e-3
    assert build - 1e-3 <= out["ended_at_s"] <= time.perf_counter() - began + 1e-3  # its age, not more


def test_laps_count_the_processor_time_spent_in_them() -> None:
    clock = StartupClock(from_process_start=False)
    time.sleep(0.05)
    clock.lap("asleep")
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    clock.lap("busy")
    cpu, seconds = clock.as_dict()["cpu_s"], clock.as_dict()["startup_s"]
    assert cpu["asleep"] < 0.03 and seconds["asleep"] >= 0.05
    assert cpu["busy"] >= 0.04


def _bytecode_in_child(tmp_path: Path, prefix: Path, write: bool) -> dict:
    """bytecode_compiled in a fresh process that imports `probe` from tmp_path, its bytecode kept under `prefix`
    (PYTHONPYCACHEPREFIX), written there unless `write` is False (PYTHONDONTWRITEBYTECODE)."""
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    environ |= {"PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path]), "PYTHONPYCACHEPREFIX": str(prefix)}
    if not write:
        environ["PYTHONDONTWRITEBYTECODE"] = "1"
    code = ("import json, probe; from k6fast.telemetry import StartupClock, bytecode_compiled; "
            "print(json.dumps(bytecode_compiled(StartupClock().started)))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_bytecode_compiled_counts_the_modules_a_process_compiled_itself(tmp_path) -> None:
    # A package of more modules than any the interpreter starts with, so that it leads `compiled_by_package`.
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / "__init__.py").write_text("".join(f"from . import m{i}\n" for i in range(11)))
    for i in range(11):
        (tmp_path / "probe" / f"m{i}.py").write_text(f"VALUE = {i}\n")
    first = _bytecode_in_child(tmp_path, tmp_path / "pyc", write=True)  # compiles and writes its bytecode
    again = _bytecode_in_child(tmp_path, tmp_path / "pyc", write=True)  # reads what the first wrote
    unwritten = _bytecode_in_child(tmp_path, tmp_path / "none", write=False)  # compiles and writes nothing
    assert first["compiled_by_package"]["probe"] == 12 and first["writes_bytecode"] is True
    assert "probe" not in again["compiled_by_package"] and again["compiled"] < first["compiled"]
    assert unwritten["compiled_by_package"]["probe"] == 12 and unwritten["writes_bytecode"] is False
    assert not (tmp_path / "none").exists()
    # Without bytecode to read, every module imported from source was compiled (the interpreter's own included).
    assert unwritten["compiled"] == unwritten["source_modules"] > 1


def test_process_age_is_the_kernels_account_of_this_process() -> None:
    age = process_age_s()
    started = subprocess.run(
        [sys.executable, "-c", "import time; from k6fast.telemetry import process_age_s; t = time.perf_counter(); "
         "time.sleep(0.3); print(process_age_s(), time.perf_counter() - t)"],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout.split()  # fmt: skip
    child_age, slept = float(started[0]), float(started[1])
    assert age is not None and age > child_age  # this test's process started before the child
    assert slept - TICK_S <= child_age  # the child is at least as old as the time it slept
