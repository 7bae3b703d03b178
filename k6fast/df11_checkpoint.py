"""`k6fast quantize --format df11 SRC DST`: a copy of a BF16 checkpoint whose transformer tensors are stored DF11
(`k6fast/df11.py`): lossless, about two thirds of the bytes.

What DST holds: every file of SRC outside the transformer's weights and config, hard-linked as `k6fast quantize` does
for the lossy formats, and a transformer whose shards (one per source shard, same names) store every BF16 tensor of
at least `df11.MIN_ELEMENTS` elements as one U8 tensor of the same name holding its DF11 blob (the blob's header
gives the original shape; dtype BF16), and every other tensor as it was. Blobs come first in a shard (each a
multiple of 16 bytes long, so every section stays aligned), then the raw tensors by descending item size; the
safetensors header is written last into room reserved for it and padded with spaces. The shard's `__metadata__`
and `transformer/config.json` carry `"k6fast_compression"` ({"format": "df11", "version": 1} in the config), which
`open_checkpoint` validates: every blob's header against its stored length, and the shapes against the config.

Every blob is decoded with the reference decoder right after encoding and compared with the source tensor bit for
bit before it is written (`df11.encode(check=True)`), on `device` (cuda: the packing and the check on the GPU).
Imports PyTorch only to write: `check_compress` is what the command line runs first.
"""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import Checkpoint
from .df11_header import ALIGN, COMPRESSION_KEY, COMPRESSION_VERSION, Layout
from .dit.config import BLOCK_PREFIX
from .memory import GiB
from .safetensors_index import ITEMSIZE, TensorLocation

FORMAT = "df11"


@dataclass
class CompressReport:
    """Bytes of the transformer's weights before and after; `block_*` counts the fused blocks (what a streamed block
    moves)."""

    tensors: int = 0
    compressed: int = 0
    total_before: int = 0
    total_after: int = 0
    block_before: int = 0
    block_after: int = 0
    seconds: float = 0.0

    def lines(self) -> list[str]:
        gb = self.total_before / 1e9
        return [
            f"df11: {self.compressed} of {self.tensors} transformer tensors compressed, each decoded and compared "
            "bit for bit before it was written",
            f"fused blocks: {self.block_before / GiB:.3f} GiB -> {self.block_after / GiB:.3f} GiB "
            f"({self.block_after / max(self.block_before, 1):.4f}x)",
            f"transformer weights: {self.total_before / GiB:.3f} GiB -> {self.total_after / GiB:.3f} GiB "
            f"({self.total_after / max(self.total_before, 1):.4f}x) in {self.seconds:.1f} s "
            f"({gb / max(self.seconds, 1e-9):.3f} GB/s)",
        ]


def check_compress(src: str | Path, dst: str | Path) -> tuple[Checkpoint, Path]:
    """(SRC opened, DST as a path) after the checks `k6fast quantize` makes for every format
    (`quantize_check.check_source_and_destination`). Imports no PyTorch."""
    from .quantize_check import check_source_and_destination

    return check_source_and_destination(src, dst)


def _blob_bound(loc: TensorLocation) -> int:
    """The most bytes a DF11 blob of this tensor can take (every code CODE_BITS long)."""
    df11 = _df11()
    chunk = df11.chunk_for(loc.elements)
    most = Layout(loc.shape, chunk, df11.LANES, 0, 0).max_bits
    return Layout(loc.shape, chunk, df11.LANES, most, 0).nbytes


def _df11():
    from . import df11

    return df11


def _header_bytes(entries: dict[str, dict], reserve: int = 0) -> bytes:
    """The safetensors header (8-byte length + JSON padded with spaces) of `entries`, at least `reserve` bytes long,
    its length such that the data starts 16-byte aligned."""
    meta = {"__metadata__": {"format": "pt", COMPRESSION_KEY: FORMAT}}
    raw = json.dumps({**meta, **dict(sorted(entries.items()))}, separators=(",", ":")).encode()
    length = max(len(raw), reserve - 8)
    length += -(8 + length) % ALIGN
    return struct.pack("<Q", length) + raw + b" " * (length - len(raw))


def _write_shard(src: Path, dst: Path, device, min_elements: int, report: CompressReport) -> dict[str, str]:
    """Write the compressed copy of one shard; returns its weight map (tensor name → file name)."""
    import torch

    from .quantize import COPY_CHUNK, _pread_exact, _pwrite_all, _sources

    df11 = _df11()
    sources = _sources(src)
    compress = [s for s in sources if s.dtype == "BF16" and s.elements >= min_elements]
    raw = sorted((s for s in sources if s not in compress), key=lambda s: (-ITEMSIZE[s.dtype], s.name))
    # Room for the header: every offset at its largest (all blobs at their bound), so the real one fits.
    bound = sum(_blob_bound(s) for s in compress) + sum(s.nbytes for s in raw)
    worst = {s.name: {"dtype": "U8" if s in compress else s.dtype, "shape": [bound] if s in compress else
                      list(s.shape), "data_offsets": [bound, bound]} for s in sources}  # fmt: skip
    base = len(_header_bytes(worst))
    entries: dict[str, dict] = {}
    at = 0
    src_fd = os.open(src, os.O_RDONLY)
    dst_fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        for s in compress:
            buf = bytearray(s.nbytes)
            _pread_exact(src_fd, memoryview(buf), s.offset)
            t = torch.frombuffer(buf, dtype=torch.bfloat16).view(s.shape)
            blob = df11.encode(t, device=device, check=True)
            _pwrite_all(dst_fd, memoryview(blob), base + at)
            entries[s.name] = {"dtype": "U8", "shape": [blob.size], "data_offsets": [at, at + blob.size]}
            at += blob.size
            _count(report, s, blob.size, compressed=True)
        for s in raw:
            buf = bytearray(min(COPY_CHUNK, max(s.nbytes, 1)))
            for pos in range(0, s.nbytes, COPY_CHUNK):
                chunk = memoryview(buf)[: min(COPY_CHUNK, s.nbytes - pos)]
                _pread_exact(src_fd, chunk, s.offset + pos)
                _pwrite_all(dst_fd, chunk, base + at + pos)
            entries[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [at, at + s.nbytes]}
            at += s.nbytes
            _count(report, s, s.nbytes, compressed=False)
        header = _header_bytes(entries, reserve=base)
        if len(header) != base:
            raise RuntimeError(f"{dst}: header of {len(header)} bytes, {base} reserved")
        _pwrite_all(dst_fd, memoryview(header), 0)
        os.ftruncate(dst_fd, base + at)
        os.fsync(dst_fd)
    finally:
        os.close(src_fd)
        os.close(dst_fd)
    return dict.fromkeys(entries, dst.name)


def _count(report: CompressReport, s: TensorLocation, after: int, *, compressed: bool) -> None:
    in_block = s.name.startswith(BLOCK_PREFIX)
    report.tensors += 1
    report.compressed += compressed
    report.total_before += s.nbytes
    report.total_after += after
    report.block_before += s.nbytes if in_block else 0
    report.block_after += after if in_block else 0


def compress_checkpoint(
    src: str | Path,
    dst: str | Path,
    *,
    device: str = "cpu",
    min_elements: int | None = None,
    log: Callable[[str], None] = print,
) -> CompressReport:
    """Write DST = SRC with its transformer stored DF11 (see the module docstring). `device` packs and checks the
    blobs (cuda is much faster; the bytes are the same). `min_elements` (default `df11.MIN_ELEMENTS`): the smallest
    BF16 tensor compressed. Raises as `check_compress`; DST is built beside it and renamed into place."""
    from .quantize import write_transformer_copy

    ckpt, dst = check_compress(src, dst)
    min_elements = _df11().MIN_ELEMENTS if min_elements is None else min_elements
    import torch

    if torch.device(device).type == "cpu" and torch.cuda.is_available():
        log("df11: packing and checking on the CPU; --device cuda does the same several times faster")
    report = CompressReport()
    start = time.perf_counter()
    write_transformer_copy(
        ckpt.root, dst, lambda shard, out: _write_shard(shard, out, device, min_elements, report),
        (COMPRESSION_KEY, {"format": FORMAT, "version": COMPRESSION_VERSION}), lambda: report.total_after, log,
    )  # fmt: skip
    report.seconds = time.perf_counter() - start
    for line in report.lines():
        log(line)
    log(f"wrote {dst}")
    return report
