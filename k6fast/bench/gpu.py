"""The GPU as a shared resource during a bench session: wait until it is idle, and notice when someone else used it.

Everything goes through `nvidia-smi` (the only view that sees other processes, other containers included), behind
the small `Smi` protocol so the logic can be tested with a scripted fake. A machine without `nvidia-smi` is
recorded as "no GPU" and nothing waits.

Attributing a compute process to the visit: a pid reported by nvidia-smi is the visit's own when it is the visit
process or one of its descendants in /proc. Inside a container nvidia-smi may report pids of the host's namespace,
so the visit never sees itself; then the judgement falls back to counting: the GPU was idle when the visit began,
so a second distinct compute process during the visit is a foreign one.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

NO_GPU = "no GPU"
_SMI_TIMEOUT_S = 10.0


class Smi(Protocol):
    """What the session needs from nvidia-smi."""

    def available(self) -> bool: ...

    def utilization(self) -> list[int]:
        """GPU utilisation in percent, one value per GPU."""
        ...

    def compute_pids(self) -> list[int]:
        """Pids of the processes holding a compute context on any GPU."""
        ...


class NvidiaSmi:
    """The real nvidia-smi. Every query has a timeout: a hung driver must not hang the session."""

    def __init__(self, executable: str | None = None):
        self.executable = executable or shutil.which("nvidia-smi")

    def available(self) -> bool:
        return self.executable is not None

    def _query(self, args: list[str]) -> list[str]:
        if self.executable is None:
            raise RuntimeError("nvidia-smi is not on PATH")
        done = subprocess.run(
            [self.executable, *args], capture_output=True, text=True, timeout=_SMI_TIMEOUT_S, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"nvidia-smi {' '.join(args)} exited with {done.returncode}: {done.stderr.strip()}")
        return [line.strip() for line in done.stdout.splitlines() if line.strip()]

    def utilization(self) -> list[int]:
        lines = self._query(["--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"])
        return [int(line) for line in lines if line.isdigit()]

    def compute_pids(self) -> list[int]:
        lines = self._query(["--query-compute-apps=pid", "--format=csv,noheader"])
        return [int(line) for line in lines if line.isdigit()]


def gpu_inventory(smi: NvidiaSmi | None = None) -> list[dict[str, str]]:
    """Name, driver and memory of each GPU as nvidia-smi reports them; [] without nvidia-smi."""
    smi = smi or NvidiaSmi()
    if not smi.available():
        return []
    try:
        lines = smi._query(["--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    except (RuntimeError, OSError, subprocess.SubprocessError):
        return []
    out = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3:
            out.append({"name": parts[0], "driver": parts[1], "memory": parts[2]})
    return out


@dataclass(frozen=True)
class IdleWait:
    """What happened before a visit: how long it waited and whether the GPU was idle when the visit began."""

    gpu: bool
    idle: bool
    waited_s: float
    last_utilization: list[int] = field(default_factory=list)
    last_pids: list[int] = field(default_factory=list)
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        if not self.gpu:
            return {"gpu": NO_GPU}
        return {
            "gpu": "nvidia-smi",
            "idle": self.idle,
            "waited_s": round(self.waited_s, 3),
            "last_utilization": self.last_utilization,
            "last_pids": self.last_pids,
            "error": self.error,
        }


def wait_for_idle(
    smi: Smi,
    *,
    timeout_s: float,
    max_utilization: int = 5,
    settle_polls: int = 2,
    poll_s: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> IdleWait:
    """Poll until every GPU is at or below `max_utilization` percent with no compute process, `settle_polls` times
    in a row, or until `timeout_s` has passed (then the visit runs anyway and the record says it was not idle)."""
    if not smi.available():
        return IdleWait(gpu=False, idle=False, waited_s=0.0)
    start = clock()
    calm = 0
    util: list[int] = []
    pids: list[int] = []
    while True:
        try:
            util, pids = smi.utilization(), smi.compute_pids()
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            return IdleWait(True, False, clock() - start, util, pids, error=str(exc))
        calm = calm + 1 if not pids and all(u <= max_utilization for u in util) else 0
        if calm >= settle_polls:
            return IdleWait(True, True, clock() - start, util, pids)
        if clock() - start >= timeout_s:
            return IdleWait(True, False, clock() - start, util, pids)
        sleep(poll_s)


def _parent_pid(pid: int, proc: Path) -> int | None:
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses; the fields after its closing ')' do not.
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[1])


def pid_relation(pid: int, root: int, proc: Path = Path("/proc")) -> str:
    """'own' when `pid` is `root` or a descendant of it, 'foreign' when it is another process in this pid
    namespace, 'unknown' when /proc has no such process (another namespace, or it has exited)."""
    if pid == root:
        return "own"
    if not (proc / str(pid)).exists():
        return "unknown"
    seen: set[int] = set()
    current: int | None = pid
    while current is not None and current > 1 and current not in seen:
        if current == root:
            return "own"
        seen.add(current)
        current = _parent_pid(current, proc)
    return "foreign"


@dataclass(frozen=True)
class Contamination:
    """The verdict on one visit from the compute processes seen while it ran."""

    contaminated: bool
    attribution: str  # "by pid" when the visit saw itself in nvidia-smi, "by count" otherwise, or NO_GPU
    foreign_pids: list[int]
    polls: int
    max_processes: int
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "contaminated": self.contaminated,
            "attribution": self.attribution,
            "foreign_pids": self.foreign_pids,
            "polls": self.polls,
            "max_processes": self.max_processes,
            "reason": self.reason,
        }


def judge(samples: list[dict[int, str]], errors: int = 0) -> Contamination:
    """Judge a visit from its polls: each sample maps the pids nvidia-smi listed to their `pid_relation`."""
    max_processes = max((len(s) for s in samples), default=0)
    if errors and not samples:
        return Contamination(False, "by count", [], 0, 0, f"nvidia-smi failed on all {errors} polls; not judged")
    own_seen = any(rel == "own" for s in samples for rel in s.values())
    if own_seen:
        foreign = sorted({pid for s in samples for pid, rel in s.items() if rel != "own"})
        reason = f"foreign compute processes {foreign}" if foreign else "only the visit's own processes"
        return Contamination(bool(foreign), "by pid", foreign, len(samples), max_processes, reason)
    # The visit never saw itself: nvidia-smi reports another pid namespace (or the visit did not use the GPU). The
    # GPU was idle when the visit started and a visit is one process, so a second distinct pid is someone else's.
    distinct = sorted({pid for s in samples for pid in s})
    if len(distinct) > 1:
        reason = f"{len(distinct)} distinct compute processes {distinct}; the visit's pid is not visible to nvidia-smi"
        return Contamination(True, "by count", distinct, len(samples), max_processes, reason)
    return Contamination(False, "by count", [], len(samples), max_processes, "at most one compute process seen")


class GpuWatch:
    """Polls nvidia-smi's compute processes in a background thread while a visit runs.

    Use: `watch = GpuWatch(smi); watch.start(pid)` right after the visit process starts, `watch.stop()` when it
    has exited; `stop` returns the Contamination verdict.
    """

    def __init__(self, smi: Smi, interval_s: float = 0.5, proc: Path = Path("/proc")):
        self.smi = smi
        self.interval_s = interval_s
        self.proc = proc
        self.samples: list[dict[int, str]] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._root = 0

    def poll_once(self) -> None:
        try:
            pids = self.smi.compute_pids()
        except (RuntimeError, OSError, subprocess.SubprocessError):
            self.errors += 1
            return
        self.samples.append({pid: pid_relation(pid, self._root, self.proc) for pid in pids})

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            self._stop.wait(self.interval_s)

    def start(self, root_pid: int) -> None:
        self._root = root_pid
        if not self.smi.available():
            return
        self._thread = threading.Thread(target=self._run, name="k6fast-bench-gpu-watch", daemon=True)
        self._thread.start()

    def stop(self) -> Contamination:
        if self._thread is None:
            return Contamination(False, NO_GPU, [], 0, 0, NO_GPU)
        self._stop.set()
        self._thread.join()
        return judge(self.samples, self.errors)
