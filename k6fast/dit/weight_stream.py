"""Weights from safetensors files to the device without a full host copy, and fused blocks streamed one ahead.

Read path: each tensor's bytes are located from the safetensors headers and read with `os.preadv` (from the page
cache or disk; the page cache is the kernel's and can be dropped, unlike anonymous memory) straight into a small
ring of pinned staging buffers allocated once; a copy stream moves them into device slots. A reader thread runs
ahead of compute; CUDA events order everything on the GPU (slot ready → compute; compute done → slot reusable), so
the compute thread never synchronises the device per block.

On a CPU "device" (tests) the same code runs with plain buffers and no streams.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .config import is_fp32_tensor, stays_as_stored
from .linear import bind_quantized

_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F8_E4M3": torch.float8_e4m3fn,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I32": torch.int32,
    "I64": torch.int64,
}
ALIGN = 256  # device slot offsets: every tensor view starts on a 256-byte boundary
# Parallel preads in chunks: one thread's copy out of the page cache tops out far below PCIe speed (≈ 16 GB/s with
# 4 threads reading whole tensors, measured on the H200 host), and a 134 MB feed-forward matrix read by one
# thread would serialise the block behind it.
READ_THREADS = max(2, min(8, os.cpu_count() or 2))
READ_CHUNK = 16 << 20


@dataclass(frozen=True)
class TensorLocation:
    name: str
    file: Path
    offset: int  # absolute byte offset in the file
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def index_safetensors(files: list[Path] | tuple[Path, ...]) -> dict[str, TensorLocation]:
    """Where every tensor's bytes are, from the files' headers alone."""
    index: dict[str, TensorLocation] = {}
    for file in files:
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        base = 8 + header_len
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            if meta["dtype"] not in _DTYPES:
                raise ValueError(f"{file}: tensor {name} has dtype {meta['dtype']}, expected one of {sorted(_DTYPES)}")
            start, end = meta["data_offsets"]
            index[name] = TensorLocation(name, Path(file), base + start, end - start, _DTYPES[meta["dtype"]],
                                         tuple(meta["shape"]))  # fmt: skip
    return index


def target_dtype(name: str, stored: torch.dtype, compute: torch.dtype) -> torch.dtype:
    """Modulation and time-embedding layers run in fp32, other floating tensors in the compute dtype. Quantized
    weights (e4m3, packed uint8) and their scales stay as stored: the stored form is what their GEMM reads."""
    if stays_as_stored(name, stored.itemsize, stored.is_floating_point):
        return stored
    return torch.float32 if is_fp32_tensor(name) else compute


class FileReader:
    """Positional reads from a set of files into host buffers, on a small thread pool (preadv releases the GIL)."""

    def __init__(self, files: set[Path]):
        self._fds = {f: os.open(f, os.O_RDONLY) for f in files}
        self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="k6-read")

    def read_into(self, buffer: Tensor, pieces: list[tuple[TensorLocation, int]]) -> None:
        """buffer: uint8 host tensor; pieces: (location, offset in buffer). Blocks until every piece is read."""
        view = memoryview(buffer.numpy())

        def read(loc: TensorLocation, at: int, start: int, end: int) -> None:
            done = start
            while done < end:
                n = os.preadv(self._fds[loc.file], [view[at + done : at + end]], loc.offset + done)
                if n <= 0:
                    raise OSError(f"{loc.file}: short read of {loc.name} at byte {loc.offset + done}")
                done += n

        futures = [
            self._pool.submit(read, loc, at, start, min(start + READ_CHUNK, loc.nbytes))
            for loc, at in pieces
            for start in range(0, max(loc.nbytes, 1), READ_CHUNK)
        ]
        for future in futures:
            future.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@dataclass(frozen=True)
class BlockLayout:
    """Where each tensor of one block sits in a flat slot buffer (stored dtype, aligned offsets)."""

    pieces: tuple[tuple[str, TensorLocation, int], ...]  # (relative name, location, offset in slot)
    nbytes: int

    @classmethod
    def of(cls, index: Mapping[str, TensorLocation], prefix: str) -> BlockLayout:
        pieces, at = [], 0
        for name in sorted(n for n in index if n.startswith(prefix)):
            pieces.append((name[len(prefix) :], index[name], at))
            at += (index[name].nbytes + ALIGN - 1) // ALIGN * ALIGN
        if not pieces:
            raise ValueError(f"no tensors under {prefix!r} in the checkpoint")
        return cls(tuple(pieces), at)

    def views(self, slot: Tensor, compute: torch.dtype) -> dict[str, Tensor]:
        """Typed tensors over a filled slot; tensors that compute in another dtype are converted (on device), and
        quantized weights become QuantizedWeights over the slot's bytes."""
        out = {}
        for name, loc, at in self.pieces:
            t = slot[at : at + loc.nbytes].view(loc.dtype).view(loc.shape)
            want = target_dtype(name, loc.dtype, compute)
            out[name] = t if want == loc.dtype else t.to(want)
        return bind_quantized(out, compute)


def upload(
    reader: FileReader, locations: list[TensorLocation], device: torch.device, compute: torch.dtype
) -> dict[str, Tensor]:
    """Resident tensors: each read into one of two pinned staging buffers and copied to the device while the next is
    read (no full host copy of the weights ever exists). Quantized weights come back as QuantizedWeights (see
    `bind_quantized`)."""
    out: dict[str, Tensor] = {}
    cuda = device.type == "cuda"
    if cuda:
        # Two staging buffers: the next tensor is read from the file while the previous one crosses PCIe.
        size = max((loc.nbytes for loc in locations), default=0)
        staging = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        copied = [torch.cuda.Event(), torch.cuda.Event()]
        stream = torch.cuda.current_stream(device)
    for i, loc in enumerate(locations):
        if cuda:
            buf = staging[i % 2]
            copied[i % 2].synchronize()  # the copy that last read this buffer has finished
            reader.read_into(buf, [(loc, 0)])
            dev = torch.empty(loc.nbytes, dtype=torch.uint8, device=device)
            dev.copy_(buf[: loc.nbytes], non_blocking=True)
            copied[i % 2].record(stream)
        else:
            dev = torch.empty(loc.nbytes, dtype=torch.uint8)
            reader.read_into(dev, [(loc, 0)])
        t = dev.view(loc.dtype).view(loc.shape)
        want = target_dtype(loc.name, loc.dtype, compute)
        out[loc.name] = t if want == loc.dtype else t.to(want)
    if cuda:
        stream.synchronize()  # the staging buffers are freed on return
    return bind_quantized(out, compute)


@dataclass
class BlockTiming:
    """Per streamed block per forward (seconds): copy on the copy stream, compute on the compute stream, and how
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
    ):
        if slots < 1:
            raise ValueError(f"streaming needs at least one device slot, found {slots}")
        self.streamed = list(range(first_streamed, num_blocks))
        self.layouts = {i: BlockLayout.of(index, f"visual_transformer_blocks.{i}.") for i in self.streamed}
        self.slot_bytes = max(layout.nbytes for layout in self.layouts.values())
        self.device, self.compute, self.reader = device, compute, reader
        self.cuda = device.type == "cuda"
        n_slots = min(slots, len(self.streamed))
        self._slots = [torch.empty(self.slot_bytes, dtype=torch.uint8, device=device) for _ in range(n_slots)]
        # Two staging buffers: the reader fills one while the copy engine drains the other.
        self._staging = [
            torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=self.cuda) for _ in range(2 if self.cuda else 1)
        ]
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
        self.timings: list[BlockTiming] = []
        self._pending: list[tuple] = []  # released blocks of the forwards since the last collect_timings
        self._in_flight: tuple | None = None  # the block handed out by `get`, not yet released
        self._thread = threading.Thread(target=self._run, name="k6-stream", daemon=True)
        self._thread.start()

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
        slot_i, stage_i = load % len(self._slots), load % len(self._staging)
        staging = self._staging[stage_i]
        if self.cuda:
            self._staging_free[stage_i].synchronize()  # the previous H2D out of this staging buffer is done
        self.reader.read_into(staging, [(loc, at) for _, loc, at in layout.pieces])
        if not self.cuda:
            self._slots[slot_i][: layout.nbytes].copy_(staging[: layout.nbytes])
            return
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(self._slot_free[slot_i])
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self._copy_stream)
            self._slots[slot_i][: layout.nbytes].copy_(staging[: layout.nbytes], non_blocking=True)
            end.record(self._copy_stream)
            self._staging_free[stage_i].record(self._copy_stream)
            self._ready[slot_i].record(self._copy_stream)
        self._copy_events[slot_i] = (start, end)

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
        """Resolve the events of the forwards since the last call (synchronises the device once)."""
        if not self.cuda or not self._pending:
            return []
        torch.cuda.synchronize(self.device)
        out = []
        for block, _, before, after, done, copy in self._pending:
            copy_s = copy[0].elapsed_time(copy[1]) / 1e3 if copy is not None else 0.0
            out.append(BlockTiming(block, copy_s, after.elapsed_time(done) / 1e3, before.elapsed_time(after) / 1e3))
        self._pending.clear()
        self.timings.extend(out)
        return out

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        if self.cuda:
            # Copies already queued into the slots must finish before their memory can go back to the allocator.
            self._copy_stream.synchronize()


def iter_prefix(index: Mapping[str, TensorLocation], prefixes: tuple[str, ...]) -> Iterator[TensorLocation]:
    return (loc for name, loc in sorted(index.items()) if name.startswith(prefixes))
