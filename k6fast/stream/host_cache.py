"""The host tier of streamed blocks: the stored bytes of a fixed run of streamed blocks kept in host memory the
process owns, so that the page cache no longer has to hold every streamed block.

Each block has its own buffer. The streamer reads a block from its files into it once, the first time the block
streams, and from then on copies to the device straight out of it: no pread and no staging. Which blocks and how
many bytes is `stream.plan.plan_host_cache`'s arithmetic; this module holds the memory. On CUDA the buffers are
page-locked, so that the copy engine reads them while the host runs ahead; on a CPU device (tests) they are plain.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

PAGE = 4096
# cudaHostRegisterPortable: the pages are locked for every CUDA context of the process, not only the current one.
_REGISTER_PORTABLE = 1
# Locking touches every page (the kernel zero-fills them first): a few threads spread the work of tens of GB.
_PIN_THREADS = 4


class HostBlockCache:
    """Host buffers for `sizes` ({block: stored bytes}, blocks in streaming order), filled lazily by the streamer.

    On CUDA each buffer is plain host memory registered with the driver (cudaHostRegister) rather than taken from
    PyTorch's pinned allocator, which rounds every allocation up to a power of two (a 1.1 GB block would lock
    2 GiB) and keeps freed memory for reuse (the tier's memory would outlive the tier). A registration that fails
    (a locked-memory limit, a cgroup) leaves out that block and every earlier one, with one warning naming the sizes:
    the tier stays a run at the end of the cycle, as planned, only shorter.

    Bounded: the buffers are allocated here once and only ever refilled by the first forward; nothing grows per
    request. The reader thread is the only writer and the filled set only grows, so it needs no lock.
    """

    def __init__(
        self,
        sizes: Mapping[int, int],
        device: torch.device,
        lock: Callable[[Tensor], bool] | None = None,
        unlock: Callable[[Tensor], None] | None = None,
    ):
        """lock/unlock: page-lock a buffer (True when it worked) and undo it; by default cudaHostRegister and
        cudaHostUnregister on CUDA, nothing on a CPU device (tests pass their own to take the fallback path)."""
        self.device = device
        self._buffers: dict[int, Tensor] = {}
        self._locked: list[Tensor] = []
        self._filled: set[int] = set()
        if device.type == "cuda" and lock is None:
            lock, unlock = partial(_register, device=device), _unregister
        self._unlock = unlock
        order = list(sizes)
        if lock is None:
            self._buffers = {b: torch.empty(sizes[b], dtype=torch.uint8) for b in order}
            return
        raw = {b: torch.empty(sizes[b] + PAGE, dtype=torch.uint8) for b in order}
        # Page-aligned views: the driver locks whole pages, and no page is then shared with another allocation.
        views = {b: t[-t.data_ptr() % PAGE :][: sizes[b]] for b, t in raw.items()}
        with ThreadPoolExecutor(_PIN_THREADS, thread_name_prefix="k6-pin") as pool:
            # Registered on the pool's threads: a failed CUDA runtime call sets its thread's last error, which the
            # next kernel launch on that thread would raise; these threads launch nothing and end here.
            ok = dict(zip(order, pool.map(lambda b: lock(views[b]), order), strict=True))
        first = len(order)  # order[first:]: the run at the end of the cycle whose every registration succeeded
        while first and ok[order[first - 1]]:
            first -= 1
        for b in order[:first]:
            if ok[b]:
                unlock(views[b])
        for b in order[first:]:
            self._buffers[b] = views[b]
            self._locked.append(views[b])
        if first:
            asked = sum(sizes.values())
            logger.warning(
                "the host tier could lock only %.2f of the %.2f GiB asked (%d of %d blocks): the locked-memory limit "
                "or the cgroup refused the rest; those blocks stream through the page cache",
                self.nbytes / 2**30, asked / 2**30, len(self._buffers), len(order),
            )  # fmt: skip

    @property
    def blocks(self) -> tuple[int, ...]:
        return tuple(self._buffers)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self._buffers.values())

    def buffer(self, block: int) -> Tensor | None:
        """The block's host buffer (uint8, its stored bytes), or None when the tier does not hold the block."""
        return self._buffers.get(block)

    def filled(self, block: int) -> bool:
        return block in self._filled

    def mark_filled(self, block: int) -> None:
        self._filled.add(block)

    def close(self) -> None:
        """Give the memory back. Every copy out of the buffers must have finished (the streamer's `close` waits)."""
        for view in self._locked:
            self._unlock(view)
        self._locked.clear()
        self._buffers.clear()
        self._filled.clear()


def _register(view: Tensor, device: torch.device) -> bool:
    with torch.cuda.device(device):  # this thread's current device: no context is made on another GPU
        return int(torch.cuda.cudart().cudaHostRegister(view.data_ptr(), view.numel(), _REGISTER_PORTABLE)) == 0


def _unregister(view: Tensor) -> None:
    err = int(torch.cuda.cudart().cudaHostUnregister(view.data_ptr()))
    if err != 0:
        raise RuntimeError(f"cudaHostUnregister of a {view.numel()}-byte host-tier buffer failed with CUDA error {err}")
