"""Weights from safetensors files to the device without a full host copy: the read path every DiT weight takes.

Each tensor's bytes are located by the safetensors index (`k6fast/safetensors_index.py`) and read with `os.preadv`
(from the page cache or disk; the page cache is the kernel's and can be dropped, unlike anonymous memory) straight
into host buffers; resident tensors cross to the device through two pinned staging buffers, one read while the other
is copied. Stored dtypes become torch dtypes here, and tensors that compute in another dtype are converted on the
device. On a CPU "device" (tests) the same code runs with plain buffers.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

from ..df11 import decode_blob
from ..dit.config import is_fp32_tensor, stays_as_stored
from ..dit.linear import bind_quantized
from ..safetensors_index import DF11Location, TensorLocation
from .page_locked import staging_buffers

TORCH_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F8_E4M3": torch.float8_e4m3fn,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I32": torch.int32,
    "I64": torch.int64,
}
# The dtypes a model computes in, by their safetensors names (the text phase's footprint is planned in them).
COMPUTE_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
# Parallel preads in chunks: one thread's copy out of the page cache tops out far below PCIe speed, and a
# feed-forward matrix of a Pro block (over a hundred MB) read by one thread would serialise the block behind it.
READ_THREADS = max(2, min(8, os.cpu_count() or 2))
READ_CHUNK = 16 << 20


def torch_dtype(loc: TensorLocation) -> torch.dtype:
    """The torch dtype of a stored tensor; a dtype the runtime cannot hold is refused with the file named."""
    if loc.dtype not in TORCH_DTYPES:
        raise ValueError(f"{loc.file}: tensor {loc.name} has dtype {loc.dtype}, expected one of {sorted(TORCH_DTYPES)}")
    return TORCH_DTYPES[loc.dtype]


def as_tensor(raw: Tensor, loc: TensorLocation, compute: torch.dtype, *, decoded: bool = False) -> Tensor:
    """raw: the tensor's stored bytes (uint8, on its device) → a typed tensor of its shape, in the dtype it computes
    in (see `target_dtype`). A DF11 blob is decoded (on the GPU: `k6fast/kernels/df11_decode.py`) into a new bf16
    tensor; with `decoded`, raw holds it decoded already (bf16 bytes)."""
    if isinstance(loc, DF11Location):
        stored = torch.bfloat16
        t = raw.view(stored).view(loc.layout.shape) if decoded else decode_blob(raw, loc.layout)
    else:
        stored = torch_dtype(loc)
        t = raw.view(stored).view(loc.shape)
    want = target_dtype(loc.name, stored, compute)
    return t if want == stored else t.to(want)


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


def upload(
    reader: FileReader, locations: list[TensorLocation], device: torch.device, compute: torch.dtype
) -> dict[str, Tensor]:
    """Resident tensors: each read into one of two pinned staging buffers and copied to the device while the next is
    read (no full host copy of the weights ever exists). Quantized weights come back as QuantizedWeights (see
    `bind_quantized`)."""
    out: dict[str, Tensor] = {}
    cuda = device.type == "cuda" and bool(locations)
    if cuda:
        # Two staging buffers: the next tensor is read from the file while the previous one crosses PCIe. Locked at
        # exactly the largest tensor's size and given back on return (`page_locked`: PyTorch's pinned allocator would
        # round each up to a power of two and keep it cached for the life of the process).
        memory = staging_buffers(max(loc.nbytes for loc in locations), 2, device)
        staging = memory.buffers
        copied = [torch.cuda.Event(), torch.cuda.Event()]
        stream = torch.cuda.current_stream(device)
    try:
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
            out[loc.name] = as_tensor(dev, loc, compute)
    finally:
        if cuda:
            stream.synchronize()  # no copy still reads the staging buffers when they are unlocked
            memory.close()
    return bind_quantized(out, compute)
