"""The text encoders' weights through the device in one pass: each unit (a Qwen decoder layer, CLIP) read from the
safetensors files into a pinned staging buffer (`FileReader`'s parallel preads), copied to a device slot on a copy
stream, used, and its slot refilled with a later unit.

The DiT's `BlockStreamer` cycles through its blocks forever, every denoising step; a text encode visits each unit
once, so this stream is finite and stops reading after its last unit. The ordering is the same: a reader thread runs
`slots - 1` units ahead of compute, and CUDA events order the GPU work (staging drained → staging refilled; slot
copied → compute; compute done → slot refilled) so the compute thread never synchronises the device per unit. On a
CPU "device" (tests) units are read straight into the slots.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from .safetensors_index import TensorLocation
from .stream.plan import slot_aligned
from .stream.reader import FileReader, torch_dtype


@dataclass(frozen=True)
class UnitLayout:
    """Where each tensor of one unit sits in a flat slot buffer (stored dtype, at `stream.plan.SLOT_ALIGN` offsets, as
    `text_plan.unit_bytes` counts them)."""

    pieces: tuple[tuple[str, TensorLocation, int], ...]  # (name, location, offset in slot)
    nbytes: int

    @classmethod
    def of(cls, tensors: Mapping[str, TensorLocation]) -> UnitLayout:
        pieces, at = [], 0
        for name in sorted(tensors):
            pieces.append((name, tensors[name], at))
            at += slot_aligned(tensors[name].nbytes)
        return cls(tuple(pieces), at)

    def views(self, slot: Tensor, compute: torch.dtype) -> dict[str, Tensor]:
        """Typed tensors over a filled slot; floating tensors stored in another dtype are converted (on the device),
        as `from_pretrained(dtype=compute)` converts them."""
        out = {}
        for name, loc, at in self.pieces:
            t = slot[at : at + loc.nbytes].view(torch_dtype(loc)).view(loc.shape)
            out[name] = t.to(compute) if t.is_floating_point() and t.dtype != compute else t
        return out


class UnitStream:
    """Units `0..len(layouts)-1` through `slots` device buffers, once, in order. `get(u)` waits for unit u and returns
    its tensors; `release(u)` after its compute was issued lets its slot be refilled; `close()` stops the reader."""

    def __init__(
        self,
        layouts: list[UnitLayout],
        reader: FileReader,
        slots: int,
        device: torch.device,
        compute: torch.dtype,
        staging: list[Tensor] | None = None,
    ):
        """staging: pinned host buffers of at least the largest unit (two: one read while the other is copied),
        owned by the caller so that they outlive one pass; needed on CUDA only."""
        if slots < 1:
            raise ValueError(f"the text stream needs at least one device slot, found {slots}")
        self.layouts, self.reader, self.device, self.compute = layouts, reader, device, compute
        self.cuda = device.type == "cuda"
        size = max(layout.nbytes for layout in layouts)
        self._slots = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(min(slots, len(layouts)))]
        if self.cuda:
            if not staging or min(s.numel() for s in staging) < size:
                raise ValueError(f"the text stream needs pinned staging buffers of {size} bytes on a CUDA device")
            self._staging = staging
            self._copy_stream = torch.cuda.Stream(device)
            self._slot_free = [torch.cuda.Event() for _ in self._slots]
            self._staging_free = [torch.cuda.Event() for _ in staging]
            self._ready = [torch.cuda.Event() for _ in self._slots]
        self._cond = threading.Condition()
        self._issued = 0  # units whose copy has been issued
        self._consumed = 0  # units released by compute
        self._error: BaseException | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="k6-text-stream", daemon=True)
        self._thread.start()

    @property
    def bytes_streamed(self) -> int:
        return sum(sum(loc.nbytes for _, loc, _ in self.layouts[u].pieces) for u in range(self._issued))

    def _run(self) -> None:
        try:
            for unit in range(len(self.layouts)):
                with self._cond:
                    self._cond.wait_for(lambda u=unit: self._stop or u - self._consumed < len(self._slots))
                    if self._stop:
                        return
                self._load(unit)
                with self._cond:
                    self._issued = unit + 1
                    self._cond.notify_all()
        except BaseException as exc:  # surfaced to the compute thread at its next get()
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _load(self, unit: int) -> None:
        layout = self.layouts[unit]
        slot = self._slots[unit % len(self._slots)]
        pieces = [(loc, at) for _, loc, at in layout.pieces]
        if not self.cuda:
            self.reader.read_into(slot, pieces)
            return
        slot_i, stage_i = unit % len(self._slots), unit % len(self._staging)
        self._staging_free[stage_i].synchronize()  # the copy that last read this staging buffer has finished
        self.reader.read_into(self._staging[stage_i], pieces)
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(self._slot_free[slot_i])
            slot[: layout.nbytes].copy_(self._staging[stage_i][: layout.nbytes], non_blocking=True)
            self._staging_free[stage_i].record(self._copy_stream)
            self._ready[slot_i].record(self._copy_stream)

    def get(self, unit: int) -> dict[str, Tensor]:
        if unit != self._consumed:
            raise RuntimeError(f"unit {unit} requested, the text stream holds unit {self._consumed} next")
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None or self._issued > unit)
            if self._error is not None:
                raise RuntimeError("the text encoder weight reader failed") from self._error
        slot_i = unit % len(self._slots)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self._ready[slot_i])
        return self.layouts[unit].views(self._slots[slot_i], self.compute)

    def release(self, unit: int) -> None:
        """Called once unit's compute is issued: its slot is refilled after that compute finishes."""
        if self.cuda:
            self._slot_free[unit % len(self._slots)].record(torch.cuda.current_stream(self.device))
        with self._cond:
            self._consumed = unit + 1
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()
        if self.cuda:
            # Copies already queued into the slots and out of the staging buffers finish before either is reused.
            self._copy_stream.synchronize()
        self._slots.clear()
