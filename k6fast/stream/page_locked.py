"""Host buffers of exactly the size asked, page-locked for the copy engine: the host tier's blocks and the staging
buffers every stream reads its files into (the DiT's streamed blocks, the text encoders' layers).

Each buffer is plain host memory, page-aligned, registered with the driver (cudaHostRegister) rather than taken from
PyTorch's pinned allocator (`torch.empty(..., pin_memory=True)`). That allocator (CachingHostAllocator) rounds each
request up to a power of two by default (c10::llvm::PowerOf2Ceil in aten/src/ATen/core/CachingHostAllocator.h;
PYTORCH_CUDA_ALLOC_CONF's pinned_max_round_threshold_mb, where a release has it, is an opt-in), so a 1.1 GB block's
staging would lock 2 GiB, and it keeps freed blocks cached for reuse, so the locked memory outlives its owner.
Registered memory is exactly the bytes asked, and `close` gives it back.
"""

from __future__ import annotations

import mmap
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch
from torch import Tensor

# cudaHostRegisterPortable: the pages are locked for every CUDA context of the process, not only the current one.
_REGISTER_PORTABLE = 1
# Locking touches every page (the kernel zero-fills them first): a few threads spread the work of tens of GB.
_PIN_THREADS = 4

Lock = Callable[[Tensor], bool]
Unlock = Callable[[Tensor], None]


class LockedBuffers:
    """uint8 host buffers of exactly `sizes` bytes. On CUDA each is page-aligned plain memory locked with
    cudaHostRegister (`lock`/`unlock` stand in for it in tests); on a CPU device they are plain and nothing is locked.

    `refused` lists the buffers whose lock failed when they were made (a locked-memory limit, a cgroup): they stay
    plain memory, and the owner decides (the host tier shortens itself, staging refuses to start). `close` unlocks the
    others; so does the object's collection when an owner never closed it, so that no freed memory stays registered
    with the driver.
    """

    def __init__(self, sizes: Sequence[int], device: torch.device, lock: Lock | None = None,
                 unlock: Unlock | None = None):  # fmt: skip
        if device.type == "cuda" and lock is None:
            lock, unlock = partial(_register, device=device), _unregister
        self.refused: list[int] = []
        self._locked: list[Tensor] = []
        self._unlock = unlock
        if lock is None:
            self.buffers = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        else:
            self.buffers = [_page_aligned(n) for n in sizes]
            with ThreadPoolExecutor(_PIN_THREADS, thread_name_prefix="k6-pin") as pool:
                # Registered on the pool's threads: a failed CUDA runtime call sets its thread's last error, which
                # the next kernel launch on that thread would raise; these threads launch nothing and end here.
                ok = list(pool.map(lock, self.buffers))
            self.refused = [i for i, done in enumerate(ok) if not done]
            self._locked = [b for b, done in zip(self.buffers, ok, strict=True) if done]
        # Holds the locked views (and so their memory) until it runs: at `close`, or when this object is collected.
        self._release = weakref.finalize(self, _unlock_all, self._locked, unlock)
        self._release.atexit = False  # at exit the process's memory and its registrations go together

    def drop(self, indices: Iterable[int]) -> None:
        """Unlock the buffers at `indices` (those that were locked) and let their memory go; the others keep their
        order. The host tier gives back what it does not keep this way."""
        gone = set(indices)
        dropped = {id(b) for i, b in enumerate(self.buffers) if i in gone}
        self.buffers = [b for i, b in enumerate(self.buffers) if i not in gone]
        for view in self._locked:
            if id(view) in dropped:
                self._unlock(view)
        self._locked[:] = [v for v in self._locked if id(v) not in dropped]  # in place: the finalizer holds the list

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def close(self) -> None:
        """Unlock every buffer. Every copy out of them must have finished (their owner's `close` waits for it)."""
        self._release()
        self.buffers = []


def staging_buffers(nbytes: int, count: int, device: torch.device, lock: Lock | None = None,
                    unlock: Unlock | None = None) -> LockedBuffers:  # fmt: skip
    """`count` staging buffers of exactly `nbytes` each, locked on CUDA (lock/unlock: as `LockedBuffers`): a file
    read fills one while the copy engine reads another. A refused lock raises: staging is small beside the weights,
    and an unlocked source would make every asynchronous copy out of it synchronous."""
    buffers = LockedBuffers([nbytes] * count, device, lock, unlock)
    if buffers.refused:
        buffers.close()
        raise RuntimeError(f"could not page-lock {count} staging buffers of {nbytes / 2**20:.1f} MiB for {device} "
                           "(cudaHostRegister refused: the locked-memory limit, ulimit -l, or the cgroup)")  # fmt: skip
    return buffers


def _page_aligned(nbytes: int) -> Tensor:
    """A plain uint8 host buffer of exactly `nbytes` whose storage starts on a page boundary (an anonymous mapping):
    the driver locks whole pages, no page of it is shared with another allocation, and, the storage being the buffer
    itself, `Tensor.is_pinned()` (which asks about the storage's first byte) tells the truth once it is locked. A
    view into a larger tensor was locked just as well, but is_pinned answered False for it."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    # Private: the pages count as the process's own anonymous memory (RssAnon, what k6fast.memory plans the host
    # with). mmap's default, MAP_SHARED, would make them shared memory (RssShmem), outside that count.
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=torch.uint8)


def _unlock_all(views: list[Tensor], unlock: Unlock | None) -> None:
    for view in views:
        unlock(view)
    views.clear()


def _register(view: Tensor, device: torch.device) -> bool:
    with torch.cuda.device(device):  # this thread's current device: no context is made on another GPU
        return int(torch.cuda.cudart().cudaHostRegister(view.data_ptr(), view.numel(), _REGISTER_PORTABLE)) == 0


def _unregister(view: Tensor) -> None:
    err = int(torch.cuda.cudart().cudaHostUnregister(view.data_ptr()))
    if err != 0:
        raise RuntimeError(f"cudaHostUnregister of a {view.numel()}-byte host buffer failed with CUDA error {err}")
