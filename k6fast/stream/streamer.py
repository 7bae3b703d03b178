"""Fused blocks streamed through a few device slots, one or more ahead of the block computing.

A reader thread runs ahead of compute: it reads the next streamed block's tensors (`FileReader`) into one of two
pinned staging buffers, and a copy stream moves them into a device slot. Blocks of the host tier (`host_cache.py`)
are read once into their own host buffer, the copy's source on every later cycle. CUDA events order everything on
the GPU (slot ready → compute; compute done → slot reusable), so the compute thread never synchronises the device per
block. On a CPU "device" (tests) the same code runs with plain buffers and no streams.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from ..df11 import decode_blob
from ..dit.config import block_prefix
from ..dit.linear import bind_quantized
from ..safetensors_index import DF11Location, TensorLocation
from .host_cache import HostBlockCache
from .page_locked import staging_buffers
from .plan import slot_aligned
from .reader import FileReader, as_tensor


@dataclass(frozen=True)
class BlockLayout:
    """Where each tensor of one block sits in a flat buffer of its stored bytes (staging; aligned offsets), and, for a
    block with DF11 blobs, where each sits in its slot, which holds the blobs decoded (`held`)."""

    pieces: tuple[tuple[str, TensorLocation, int], ...]  # (relative name, location, offset in the stored bytes)
    nbytes: int  # the stored bytes
    held: tuple[int, ...] | None = None  # each piece's offset in the slot; None: the slot holds the stored bytes
    held_nbytes: int = 0

    @classmethod
    def of(cls, index: Mapping[str, TensorLocation], prefix: str) -> BlockLayout:
        pieces, at, held, held_at = [], 0, [], 0
        for name in sorted(n for n in index if n.startswith(prefix)):
            loc = index[name]
            pieces.append((name[len(prefix) :], loc, at))
            held.append(held_at)
            at += slot_aligned(loc.nbytes)
            held_at += slot_aligned(loc.elements * loc.itemsize)  # a blob's decoded bytes, else its stored ones
        if not pieces:
            raise ValueError(f"no tensors under {prefix!r} in the checkpoint")
        if not any(isinstance(loc, DF11Location) for _, loc, _ in pieces):
            return cls(tuple(pieces), at)
        return cls(tuple(pieces), at, tuple(held), held_at)

    @property
    def slot_nbytes(self) -> int:
        return self.nbytes if self.held is None else self.held_nbytes

    def fill(self, slot: Tensor, stored: Tensor) -> None:
        """A block with DF11 blobs: decode them from `stored` (its stored bytes, on the slot's device) into `slot`, and
        copy the other tensors there; on the current stream."""
        for (_, loc, at), to in zip(self.pieces, self.held, strict=True):
            dst = slot[to : to + loc.elements * loc.itemsize]
            if isinstance(loc, DF11Location):
                decode_blob(stored[at : at + loc.nbytes], loc.layout, dst.view(torch.bfloat16).view(loc.layout.shape))
            else:
                dst.copy_(stored[at : at + loc.nbytes], non_blocking=True)

    def views(self, slot: Tensor, compute: torch.dtype) -> dict[str, Tensor]:
        """Typed tensors over a filled slot; tensors that compute in another dtype are converted (on device), and
        quantized weights become QuantizedWeights over the slot's bytes."""
        out = {}
        for i, (name, loc, at) in enumerate(self.pieces):
            if self.held is None:
                out[name] = as_tensor(slot[at : at + loc.nbytes], loc, compute)
            else:
                at = self.held[i]
                out[name] = as_tensor(slot[at : at + loc.elements * loc.itemsize], loc, compute, decoded=True)
        return bind_quantized(out, compute)


@dataclass
class BlockTiming:
    """Per streamed block per forward (seconds): copy (and DF11 decode) on the copy stream, compute on the compute
    stream, and how
    long compute waited for the copy (exposed)."""

    block: int
    copy_s: float
    compute_s: float
    exposed_s: float


class BlockStreamer:
    """Streams fused blocks `first_streamed..num_blocks-1` through `slots` device buffers, `slots - 1` ahead.

    Every DiT forward visits blocks in order, so the reader cycles through the streamed blocks forever; a forward
    that stops early (cancellation, error) resets the cycle at the next `begin_forward`.
    """

    def __init__(
        self,
        index: Mapping[str, TensorLocation],
        reader: FileReader,
        num_blocks: int,
        first_streamed: int,
        slots: int,
        device: torch.device,
        compute: torch.dtype,
        host_cache: HostBlockCache | None = None,
    ):
        if slots < 1:
            raise ValueError(f"streaming needs at least one device slot, found {slots}")
        self.streamed = list(range(first_streamed, num_blocks))
        self.layouts = {i: BlockLayout.of(index, block_prefix(i)) for i in self.streamed}
        self.slot_bytes = max(layout.slot_nbytes for layout in self.layouts.values())
        stored_bytes = max(layout.nbytes for layout in self.layouts.values())
        self.device, self.compute, self.reader = device, compute, reader
        self.host_cache = host_cache  # owned by the runtime: it outlives this streamer across `fit`
        self.cuda = device.type == "cuda"
        n_slots = min(slots, len(self.streamed))
        self._slots = [torch.empty(self.slot_bytes, dtype=torch.uint8, device=device) for _ in range(n_slots)]
        # Two staging buffers: the reader fills one while the copy engine drains the other. Locked at exactly the
        # largest block's size (`page_locked`: PyTorch's pinned allocator would round each up to a power of two).
        self._staging_memory = staging_buffers(stored_bytes, 2 if self.cuda else 1, device)
        self._staging = self._staging_memory.buffers
        # DF11 blocks: the stored bytes land here and are decoded into the slot on the copy stream (the next block's
        # copy lands after this block's decode, in stream order), overlapping the previous block's compute.
        compressed = self.cuda and any(layout.held is not None for layout in self.layouts.values())
        self._landing = torch.empty(stored_bytes, dtype=torch.uint8, device=device) if compressed else None
        if self.cuda:
            self._copy_stream = torch.cuda.Stream(device)
            self._slot_free = [torch.cuda.Event() for _ in self._slots]  # compute finished with the slot
            self._staging_free = [torch.cuda.Event() for _ in self._staging]  # H2D finished reading staging
            self._ready = [torch.cuda.Event() for _ in self._slots]
            self._copy_events: list[tuple | None] = [None] * len(self._slots)  # (start, end) of the slot's last H2D
        self._cond = threading.Condition()
        self._issued = 0  # loads issued so far (a running count over the cycle)
        self._consumed = 0  # blocks handed to compute so far
        self._generation = 0
        self._error: BaseException | None = None
        self._stop = False
        self._pending: list[tuple] = []  # released blocks of the forwards since the last collect_timings
        self._in_flight: tuple | None = None  # the block handed out by `get`, not yet released
        self._thread = threading.Thread(target=self._run, name="k6-stream", daemon=True)
        self._thread.start()

    @property
    def staging(self) -> list[Tensor]:
        """The host buffers the reader fills (page-locked on CUDA, at the largest block's exact size)."""
        return list(self._staging)

    # -- reader side ---------------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            load = 0
            generation = 0
            while True:
                with self._cond:
                    # Stay at most len(slots) loads ahead of compute: slot (load % n) must have been handed out.
                    self._cond.wait_for(
                        lambda g=generation, n=load: (
                            self._stop or self._generation != g or n - self._consumed < len(self._slots)
                        )
                    )
                    if self._stop:
                        return
                    if self._generation != generation:
                        generation, load = self._generation, self._issued
                self._load(load)
                with self._cond:
                    if self._generation == generation:
                        self._issued = load + 1
                        self._cond.notify_all()
                load += 1
        except BaseException as exc:  # surfaced to the compute thread at its next get()
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _load(self, load: int) -> None:
        block = self.streamed[load % len(self.streamed)]
        layout = self.layouts[block]
        slot_i = load % len(self._slots)
        source, stage_i = self._read(load, block, layout)
        if not self.cuda:
            if layout.held is None:
                self._slots[slot_i][: layout.nbytes].copy_(source[: layout.nbytes])
            else:
                layout.fill(self._slots[slot_i], source)
            return
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(self._slot_free[slot_i])
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self._copy_stream)
            if layout.held is None:
                self._slots[slot_i][: layout.nbytes].copy_(source[: layout.nbytes], non_blocking=True)
            else:
                self._landing[: layout.nbytes].copy_(source[: layout.nbytes], non_blocking=True)
                layout.fill(self._slots[slot_i], self._landing)
            end.record(self._copy_stream)
            if stage_i is not None:
                self._staging_free[stage_i].record(self._copy_stream)
            self._ready[slot_i].record(self._copy_stream)
        self._copy_events[slot_i] = (start, end)

    def _read(self, load: int, block: int, layout: BlockLayout) -> tuple[Tensor, int | None]:
        """The host buffer holding the block's stored bytes for this load, and the staging buffer's index (None for
        a host-tier block). A tier block is read from its files on its first load only; nothing writes its buffer
        after that, so a copy out of it needs no event before the next one."""
        pieces = [(loc, at) for _, loc, at in layout.pieces]
        held = self.host_cache.buffer(block) if self.host_cache is not None else None
        if held is not None:
            if not self.host_cache.filled(block):
                self.reader.read_into(held, pieces)
                self.host_cache.mark_filled(block)
            return held, None
        stage_i = load % len(self._staging)
        if self.cuda:
            self._staging_free[stage_i].synchronize()  # the previous H2D out of this staging buffer is done
        self.reader.read_into(self._staging[stage_i], pieces)
        return self._staging[stage_i], stage_i

    # -- compute side --------------------------------------------------------------------------------------------
    def begin_forward(self) -> None:
        """Called before block 0 of each forward: if the last forward stopped mid-cycle, restart the cycle."""
        if self._consumed % len(self.streamed) == 0:
            return
        with self._cond:
            self._generation += 1
            # Round up to the next cycle start; the reader re-issues from there.
            self._consumed = self._issued = -(-self._consumed // len(self.streamed)) * len(self.streamed)
            self._cond.notify_all()

    def get(self, block: int) -> dict[str, Tensor]:
        load = self._consumed
        expected = self.streamed[load % len(self.streamed)]
        if block != expected:
            raise RuntimeError(f"block {block} requested, the stream holds block {expected} next")
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None or self._issued > load)
            if self._error is not None:
                raise RuntimeError("the weight reader failed") from self._error
        slot_i = load % len(self._slots)
        if self.cuda:
            copy_timing = self._copy_events[slot_i]
            stream = torch.cuda.current_stream(self.device)
            before, after, done = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            before.record(stream)
            stream.wait_event(self._ready[slot_i])
            after.record(stream)
            # Held apart until `release` records `done`: a block whose compute raised never gets there, and an
            # unrecorded event in `_pending` would fail every later `collect_timings`.
            self._in_flight = (block, slot_i, before, after, done, copy_timing)
        return self.layouts[block].views(self._slots[slot_i], self.compute)

    def release(self, block: int) -> None:
        """Called after the block's compute was issued: the slot may be refilled once that compute finishes."""
        slot_i = self._consumed % len(self._slots)
        if self.cuda:
            stream = torch.cuda.current_stream(self.device)
            self._slot_free[slot_i].record(stream)
            if self._in_flight is not None:
                self._in_flight[4].record(stream)
                self._pending.append(self._in_flight)
                self._in_flight = None
        with self._cond:
            self._consumed += 1
            self._cond.notify_all()

    def abort_forward(self) -> None:
        """A forward raised between `get` and `release` (an OOM inside a block, a cancellation): forget its timings.
        The slot it held is reused as soon as the next forward's `begin_forward` restarts the cycle."""
        if self.cuda and self._in_flight is not None:
            # Kernels of the failed block already queued may still read its slot: the next copy into it waits.
            self._slot_free[self._in_flight[1]].record(torch.cuda.current_stream(self.device))
        self._in_flight = None
        self._pending.clear()

    def collect_timings(self) -> list[BlockTiming]:
        """Resolve the events of the forwards since the last call (synchronises the device once). Nothing is kept
        here: the caller's per-request telemetry owns them, so a server that runs for weeks does not grow."""
        if not self.cuda or not self._pending:
            return []
        torch.cuda.synchronize(self.device)
        out = []
        for block, _, before, after, done, copy in self._pending:
            copy_s = copy[0].elapsed_time(copy[1]) / 1e3 if copy is not None else 0.0
            out.append(BlockTiming(block, copy_s, after.elapsed_time(done) / 1e3, before.elapsed_time(after) / 1e3))
        self._pending.clear()
        return out

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        if self.cuda:
            # Copies already queued into the slots and out of the staging buffers must finish before their memory
            # can go back to the allocator and the staging's lock to the driver.
            self._copy_stream.synchronize()
        self._staging_memory.close()


class MixedBlocks:
    """Blocks below `resident` from device memory, the others from the streamer."""

    def __init__(self, resident: dict[int, Mapping[str, Tensor]], streamer: BlockStreamer | None):
        self.resident = resident
        self.streamer = streamer

    def begin_forward(self) -> None:
        if self.streamer is not None:
            self.streamer.begin_forward()

    def get(self, block: int) -> Mapping[str, Tensor]:
        if block in self.resident:
            return self.resident[block]
        return self.streamer.get(block)

    def release(self, block: int) -> None:
        if block not in self.resident:
            self.streamer.release(block)

    def abort_forward(self) -> None:
        if self.streamer is not None:
            self.streamer.abort_forward()
