"""The host tier of streamed blocks: the stored bytes of a fixed run of streamed blocks kept in host memory the
process owns, so that the page cache no longer has to hold every streamed block.

Each block has its own buffer. The streamer reads a block from its files into it once, the first time the block
streams, and from then on copies to the device straight out of it: no pread and no staging. Which blocks and how
many bytes is `stream.plan.plan_host_cache`'s arithmetic; this module holds the memory. On CUDA the buffers are
page-locked, so that the copy engine reads them while the host runs ahead; on a CPU device (tests) they are plain.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from torch import Tensor

from .page_locked import Lock, LockedBuffers, Unlock

logger = logging.getLogger(__name__)


class HostBlockCache:
    """Host buffers for `sizes` ({block: stored bytes}, blocks in streaming order), filled lazily by the streamer.

    On CUDA each buffer is page-locked plain memory of exactly the block's size (`page_locked.LockedBuffers`: not
    PyTorch's pinned allocator, which would round a 1.1 GB block up to 2 GiB and keep freed memory). A lock that
    fails (a locked-memory limit, a cgroup) leaves out that block and every earlier one, with one warning naming the
    sizes: the tier stays a run at the end of the cycle, as planned, only shorter.

    Bounded: the buffers are allocated here once and only ever refilled by the first forward; nothing grows per
    request. The reader thread is the only writer and the filled set only grows, so it needs no lock.
    """

    def __init__(self, sizes: Mapping[int, int], device: torch.device, lock: Lock | None = None,
                 unlock: Unlock | None = None):  # fmt: skip
        """lock/unlock: page-lock a buffer (True when it worked) and undo it; by default cudaHostRegister and
        cudaHostUnregister on CUDA, nothing on a CPU device (tests pass their own to take the fallback path)."""
        self.device = device
        self._filled: set[int] = set()
        order = list(sizes)
        self._memory = LockedBuffers([sizes[b] for b in order], device, lock, unlock)
        first = max(self._memory.refused, default=-1) + 1  # order[first:]: the run at the end every lock took
        self._memory.drop(range(first))
        self._buffers = dict(zip(order[first:], self._memory.buffers, strict=True))
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
        self._memory.close()
        self._buffers.clear()
        self._filled.clear()
