"""One memory budget: every reserve k6fast keeps inside the VRAM budget, decided here and nowhere else.

The budget (K6_VRAM_BUDGET_GB, or the card's free memory) caps PyTorch's caching allocator. Inside it:
- what CUDA adds outside the allocator once work starts (cuBLAS/cuDNN handles, kernel images of Triton and
  flash-attn-4): taken off the card's free memory when the budget is chosen (`allocator.device_budget`);
- the residency planner's reserve beside the DiT's weights and activations: the allocator's rounding and the
  workspaces of the DiT phase (`stream.plan`);
- the video decode's reserve and workspace inside the room it is given (`video_decode.plan`);
- the text phase's peak, planned beside the DiT's weights while the activation room is free (`text_plan`).

Host memory has one reader (`host_memory`, from /proc) and one reserve: what the page cache and the host tier of
streamed blocks (`stream.plan.plan_host_cache`) leave to the OS and to the process's own growth
(`HostMemory.cache_room_bytes`).

Plain arithmetic and /proc reads, no PyTorch: `k6fast doctor` plans with the same figures as the runtime.
"""

from __future__ import annotations

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
class HostMemory:
    """The host as k6fast plans for it: MemTotal and MemAvailable (bytes), and this process's anonymous memory
    (RssAnon: 0 when planning for a process not yet started, as `k6fast doctor` does)."""

    total_bytes: int
    available_bytes: int
    process_bytes: int = 0

    @property
    def cache_room_bytes(self) -> int:
        """What the page cache and the host tier may take: MemAvailable less the process's growth still to come (its
        whole expected size, less what it already holds and MemAvailable already counts out) and HOST_OS_BYTES."""
        growth = max(0, PROCESS_HOST_BYTES - self.process_bytes)
        return max(0, self.available_bytes - growth - HOST_OS_BYTES)


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


def host_memory(meminfo_path: str = "/proc/meminfo", status_path: str = "/proc/self/status") -> HostMemory:
    """This host and process now."""
    total, available = meminfo(meminfo_path)
    return HostMemory(total, available, process_anon_bytes(status_path))
