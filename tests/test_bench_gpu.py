"""GPU-idle wait and contamination, with a scripted nvidia-smi and real processes in /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from k6fast.bench.gpu import GpuWatch, NvidiaSmi, judge, pid_relation, wait_for_idle


class ScriptedSmi:
    """nvidia-smi that answers from scripts: each call takes the next entry (the last one repeats)."""

    def __init__(self, utilization=None, pids=None, available=True, fail=False):
        self._util = list(utilization or [[0]])
        self._pids = list(pids or [[]])
        self._available = available
        self._fail = fail

    def available(self) -> bool:
        return self._available

    @staticmethod
    def _next(script: list):
        return script.pop(0) if len(script) > 1 else script[0]

    def utilization(self) -> list[int]:
        if self._fail:
            raise RuntimeError("nvidia-smi exited with 9: driver gone")
        return self._next(self._util)

    def compute_pids(self) -> list[int]:
        if self._fail:
            raise RuntimeError("nvidia-smi exited with 9: driver gone")
        return self._next(self._pids)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_wait_ends_once_the_gpu_stays_idle() -> None:
    clock = FakeClock()
    smi = ScriptedSmi(utilization=[[97], [40], [2], [0]], pids=[[123], [123], [], []])
    idle = wait_for_idle(smi, timeout_s=60, settle_polls=2, poll_s=1.0, clock=clock, sleep=clock.sleep)
    assert idle.gpu and idle.idle
    assert idle.waited_s == 3.0  # busy, busy, idle, idle (second idle poll ends it)
    assert idle.as_dict()["idle"] is True


def test_wait_is_bounded_and_says_the_gpu_was_busy() -> None:
    clock = FakeClock()
    smi = ScriptedSmi(utilization=[[100]], pids=[[42]])
    idle = wait_for_idle(smi, timeout_s=10, poll_s=2.0, clock=clock, sleep=clock.sleep)
    assert idle.gpu and not idle.idle
    assert 10.0 <= idle.waited_s <= 12.0
    assert idle.last_pids == [42] and idle.last_utilization == [100]


def test_a_compute_process_at_zero_utilisation_is_not_idle() -> None:
    clock = FakeClock()
    smi = ScriptedSmi(utilization=[[0]], pids=[[42]])
    assert not wait_for_idle(smi, timeout_s=5, clock=clock, sleep=clock.sleep).idle


def test_no_nvidia_smi_means_no_wait_and_no_gpu(monkeypatch) -> None:
    monkeypatch.setattr("shutil.which", lambda name: None)
    real = NvidiaSmi()
    assert not real.available()
    idle = wait_for_idle(real, timeout_s=60)
    assert not idle.gpu and idle.as_dict() == {"gpu": "no GPU"}


def test_a_failing_nvidia_smi_is_recorded_not_raised() -> None:
    idle = wait_for_idle(ScriptedSmi(fail=True), timeout_s=60)
    assert not idle.idle and "driver gone" in idle.error


def _fake_proc(root: Path, parents: dict[int, int]) -> Path:
    for pid, ppid in parents.items():
        (root / str(pid)).mkdir(parents=True)
        # The command name may hold spaces and parentheses; the parser must take the fields after the last ')'.
        (root / str(pid) / "stat").write_text(f"{pid} (py (worker) x) S {ppid} 1 1 0 -1\n")
    return root


def test_pid_relation_follows_the_parent_chain(tmp_path) -> None:
    proc = _fake_proc(tmp_path, {100: 1, 200: 100, 300: 200, 400: 1})
    assert pid_relation(100, root=100, proc=proc) == "own"
    assert pid_relation(300, root=100, proc=proc) == "own"  # grandchild
    assert pid_relation(400, root=100, proc=proc) == "foreign"
    assert pid_relation(999, root=100, proc=proc) == "unknown"


def test_judge_by_pid() -> None:
    clean = judge([{10: "own"}, {10: "own", 11: "own"}])
    assert not clean.contaminated and clean.attribution == "by pid"
    dirty = judge([{10: "own"}, {10: "own", 77: "foreign"}, {10: "own", 88: "unknown"}])
    assert dirty.contaminated and dirty.foreign_pids == [77, 88] and dirty.max_processes == 2


def test_judge_by_count_when_the_visit_never_sees_itself() -> None:
    # nvidia-smi in a container lists host-namespace pids: none resolves in our /proc.
    assert not judge([{5001: "unknown"}, {5001: "unknown"}]).contaminated
    other = judge([{5001: "unknown"}, {5001: "unknown", 6002: "unknown"}])
    assert other.contaminated and other.attribution == "by count"
    came_and_went = judge([{6002: "unknown"}, {}, {5001: "unknown"}])
    assert came_and_went.contaminated
    assert not judge([]).contaminated
    assert not judge([], errors=3).contaminated and "not judged" in judge([], errors=3).reason


def _children_of(parent: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == parent:
                out.append(int(entry.name))
    return out


def test_watch_flags_a_foreign_process_during_a_real_visit() -> None:
    # The "visit" is a real child process that starts a grandchild; nvidia-smi (scripted) lists the child, the
    # grandchild, and after a while this test process, which is not part of the visit.
    child = subprocess.Popen([sys.executable, "-c", "import subprocess,sys; subprocess.run(['sleep','1.0'])"])
    try:
        deadline = time.monotonic() + 10
        while not (grandchildren := _children_of(child.pid)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert grandchildren, "the child did not start its own process"
        smi = ScriptedSmi(pids=[[child.pid], [child.pid, grandchildren[0]], [child.pid, os.getpid()]])
        watch = GpuWatch(smi, interval_s=0.05)
        watch.start(child.pid)
        child.wait(timeout=20)
        verdict = watch.stop()
    finally:
        child.kill()
        child.wait()
    assert verdict.contaminated and verdict.attribution == "by pid"
    assert verdict.foreign_pids == [os.getpid()]
    assert verdict.polls >= 3


def test_watch_with_only_the_visit_is_clean() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.4)"])
    smi = ScriptedSmi(pids=[[], [child.pid]])
    watch = GpuWatch(smi, interval_s=0.05)
    watch.start(child.pid)
    child.wait(timeout=20)
    verdict = watch.stop()
    assert not verdict.contaminated and verdict.attribution == "by pid"


def test_watch_without_nvidia_smi_records_no_gpu() -> None:
    watch = GpuWatch(ScriptedSmi(available=False))
    watch.start(os.getpid())
    verdict = watch.stop()
    assert not verdict.contaminated and verdict.attribution == "no GPU" and verdict.polls == 0
