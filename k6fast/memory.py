"""One memory budget: every reserve k6fast keeps inside the VRAM budget, decided here and nowhere else.

The budget (K6_VRAM_BUDGET_GB, or the card's free memory) caps PyTorch's caching allocator. Inside it:
- what CUDA adds outside the allocator once work starts (cuBLAS/cuDNN handles, kernel images of Triton and
  flash-attn-4): taken off the card's free memory when the budget is chosen (`allocator.device_budget`);
- the residency planner's reserve beside the DiT's weights and activations: the allocator's rounding and the
  workspaces of the DiT phase (`stream.plan`);
- the video decode's reserve and workspace inside the room it is given (`video_decode.plan`);
- the text phase's peak, planned beside the DiT's weights while the activation room is free (`text_plan`).

Host memory has one reader (`host_memory`, from /proc and the process's cgroup) and one reserve: what the page cache
and the host tier of streamed blocks (`stream.plan.plan_host_cache`) leave to the OS and to the process's own growth
(`HostMemory.cache_room_bytes`), out of the host's MemAvailable or, where it is tighter, the cgroup's room.

Plain arithmetic and /proc and /sys reads, no PyTorch: `k6fast doctor` plans with the same figures as the runtime.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

GiB = 2**30

# What CUDA adds outside PyTorch's caching allocator. The full-size acceptance run saw nvidia-smi's use exceed the
# allocator's reserved peak by the CUDA context plus this much (measurements/sessions/2026-12-01_acceptance-full).
OUTSIDE_ALLOCATOR_BYTES = GiB // 2

# Beside the DiT's weights and activations: the allocator's rounding, cuBLAS/cuDNN workspaces.
PLANNER_RESERVE_BYTES = 2 * GiB

# The video decode keeps this share of its room for cuDNN's workspace and the allocator's rounding, within bounds:
# workspaces and rounding do not grow with the budget (an unbudgeted CPU run has 2^62 B).
DECODE_RESERVE_FRACTION = 0.08
DECODE_RESERVE_MIN_BYTES = 256 << 20
DECODE_RESERVE_MAX_BYTES = 4 << 30


def decode_reserve(room_bytes: int) -> int:
    """What the video decode leaves unplanned inside `room_bytes`."""
    return min(DECODE_RESERVE_MAX_BYTES, max(DECODE_RESERVE_MIN_BYTES, int(room_bytes * DECODE_RESERVE_FRACTION)))


def decode_workspace(room_bytes: int) -> int:
    """The cuDNN workspace one decode convolution is assumed to take inside `room_bytes`."""
    return max(64 << 20, min(1 << 30, room_bytes // 16))


# The DiT process's own anonymous memory beside the page cache: text encoders' activations, pinned staging, the
# decoders (the full-size acceptance run's peak host RSS, measurements/sessions/2026-12-01_acceptance-full, with a
# margin on top).
PROCESS_HOST_BYTES = 8 * GiB
# Beside the process: the kernel's own growth (slab, page tables of the pinned memory) and other processes' growth.
# MemAvailable already leaves out the kernel's watermarks, so this covers change after the reading only.
HOST_OS_BYTES = 2 * GiB


@dataclass(frozen=True)
class CgroupLimit:
    """The memory limit of a cgroup this process runs in (a container's, a systemd slice's): the one with the least
    room left when several nested ones set a limit. Past it the kernel OOM-kills the process rather than fail an
    allocation, so the host tier must fit inside it as well as inside MemAvailable."""

    path: str  # the cgroup whose limit it is, as /proc/self/cgroup names it
    limit_bytes: int  # memory.max (v2) or memory.limit_in_bytes (v1)
    usage_bytes: int  # memory.current or memory.usage_in_bytes: everything charged to it, its page cache included
    # Its page cache on the file LRUs (memory.stat): the kernel drops it before it OOM-kills, as MemAvailable counts
    # the host's cached pages in. Without it a container that has just read the checkpoint would look full.
    cached_bytes: int = 0

    @property
    def available_bytes(self) -> int:
        """The cgroup's counterpart of MemAvailable: its limit less what is charged to it and cannot be dropped."""
        return max(0, self.limit_bytes - self.usage_bytes + min(self.cached_bytes, self.usage_bytes))


@dataclass(frozen=True)
class HostMemory:
    """The host as k6fast plans for it: MemTotal and MemAvailable (bytes), this process's anonymous memory
    (RssAnon: 0 when planning for a process not yet started, as `k6fast doctor` does), and the cgroup limit it runs
    under (None: none, or planning for another host)."""

    total_bytes: int
    available_bytes: int
    process_bytes: int = 0
    cgroup: CgroupLimit | None = None

    @property
    def room_source(self) -> str:
        """Where the room comes from, for messages: the host's MemAvailable or the cgroup limit when it is tighter."""
        if self.cgroup is not None and self.cgroup.available_bytes < self.available_bytes:
            c = self.cgroup
            return (f"the memory limit {c.limit_bytes / GiB:.1f} GiB of cgroup {c.path}, "
                    f"{(c.limit_bytes - c.available_bytes) / GiB:.1f} GiB of it in use")  # fmt: skip
        return f"MemAvailable {self.available_bytes / GiB:.1f} GiB"

    @property
    def cache_room_bytes(self) -> int:
        """What the page cache and the host tier may take: MemAvailable (or the cgroup's room when it is tighter)
        less the process's growth still to come (its whole expected size, less what it already holds and both
        figures already count out) and HOST_OS_BYTES."""
        available = self.available_bytes
        if self.cgroup is not None:
            available = min(available, self.cgroup.available_bytes)
        growth = max(0, PROCESS_HOST_BYTES - self.process_bytes)
        return max(0, available - growth - HOST_OS_BYTES)


def meminfo(path: str = "/proc/meminfo") -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes."""
    values = {}
    with open(path) as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                values[key] = int(rest.split()[0]) * 1024
    return values.get("MemTotal", 0), values.get("MemAvailable", 0)


def process_anon_bytes(path: str = "/proc/self/status") -> int:
    """This process's anonymous resident memory (RssAnon) in bytes; 0 where the kernel does not report it."""
    with open(path) as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key == "RssAnon":
                return int(rest.split()[0]) * 1024
    return 0


# cgroup v1 writes "no limit" as the largest page count times the page size (9223372036854771712 with 4 KiB pages).
_V1_UNLIMITED = 1 << 60
# (limit file, usage file, memory.stat keys of the page cache) per cgroup version. v1's total_* count the cgroup's
# children too, as its usage does.
_V2_FILES = ("memory.max", "memory.current", ("active_file", "inactive_file"))
_V1_FILES = ("memory.limit_in_bytes", "memory.usage_in_bytes", ("total_active_file", "total_inactive_file"))


def cgroup_limit(cgroup_path: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> CgroupLimit | None:
    """The limit of the process's cgroups with the least room left, walking from its own cgroup up to the root: each
    level's usage counts its children's, and any level's limit can OOM-kill. cgroup v2 (the `0::/path` line, files
    under `root`/path) and v1's memory controller (`N:memory:/path`, files under `root`/memory/path). None when
    no level sets one or the files are not there (no cgroup file system mounted, a host's root cgroup)."""
    try:
        with open(cgroup_path) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            found += _walk(root, path, *_V2_FILES)
        elif "memory" in controllers.split(","):
            found += _walk(os.path.join(root, "memory"), path, *_V1_FILES)
    return min(found, key=lambda c: c.available_bytes, default=None)


def _walk(root: str, path: str, limit_file: str, usage_file: str, cache_keys: tuple[str, ...]) -> list[CgroupLimit]:
    """The levels from `path` up to the root of the hierarchy mounted at `root` that set a limit. A level whose
    folder is missing is passed over: in a container the mount is often the container's own cgroup, not the root
    that /proc/self/cgroup's path starts from."""
    out = []
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        folder = os.path.join(root, *parts[:depth])
        limit, usage = _read_int(os.path.join(folder, limit_file)), _read_int(os.path.join(folder, usage_file))
        if limit is None or usage is None or limit >= _V1_UNLIMITED:
            continue
        stat = _read_stat(os.path.join(folder, "memory.stat"))
        out.append(CgroupLimit("/" + "/".join(parts[:depth]), limit, usage, sum(stat.get(k, 0) for k in cache_keys)))
    return out


def _read_int(path: str) -> int | None:
    """The number in a cgroup file; None when the file is missing or reads "max" (v2: no limit)."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _read_stat(path: str) -> dict[str, int]:
    """memory.stat's "key value" lines; empty when the file is missing."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    pairs = (line.partition(" ") for line in lines)
    return {key: int(value) for key, _, value in pairs if value.strip().isdigit()}


def host_memory(
    meminfo_path: str = "/proc/meminfo",
    status_path: str = "/proc/self/status",
    cgroup_path: str = "/proc/self/cgroup",
    cgroup_root: str = "/sys/fs/cgroup",
) -> HostMemory:
    """This host, process and cgroup now."""
    total, available = meminfo(meminfo_path)
    return HostMemory(total, available, process_anon_bytes(status_path), cgroup_limit(cgroup_path, cgroup_root))
