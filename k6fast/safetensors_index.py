"""Where every tensor of a set of safetensors files is, from their headers alone: the one reader of the format's
header for the checkpoint check, the weight streamer, `k6fast quantize` and `k6fast doctor`.

A safetensors file is an 8-byte little-endian header length, a JSON header (per tensor: dtype string, shape, data
offsets relative to the end of the header; an optional `__metadata__`), then the data. The header is checked against
the file's size, so a truncated download is named here, before any weight is read. No PyTorch: the doctor plans from
these entries without importing it; the streamer maps dtype strings to torch dtypes itself.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .df11_header import COMPRESSION_FORMATS, COMPRESSION_KEY, DF11Error, Layout, read_layout

# Bytes per element of each safetensors dtype string k6fast may meet (packed formats are stored as U8).
ITEMSIZE = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "U8": 1, "I8": 1, "BOOL": 1}
FLOATING = frozenset({"F64", "F32", "BF16", "F16", "F8_E4M3"})
METADATA = "__metadata__"


class CheckpointError(ValueError):
    """The checkpoint is missing, incomplete or inconsistent; the message names the file and what was expected."""


@dataclass(frozen=True)
class TensorLocation:
    """One tensor's bytes: `nbytes` from absolute byte `offset` of `file`, stored as `dtype` (a safetensors string)."""

    name: str
    file: Path
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def floating(self) -> bool:
        return self.dtype in FLOATING

    @property
    def elements(self) -> int:
        return self.nbytes // self.itemsize


@dataclass(frozen=True)
class DF11Location(TensorLocation):
    """A BF16 tensor stored as a DF11 blob (`k6fast quantize --format df11`; every U8 tensor of a shard whose
    metadata says so): `offset`, `nbytes`, `dtype` and `shape` are the blob's (what is read and copied), `elements`,
    `itemsize` and `floating` the decoded tensor's (what the device holds once it is decoded), `layout` its header."""

    layout: Layout

    @property
    def itemsize(self) -> int:
        return ITEMSIZE["BF16"]

    @property
    def floating(self) -> bool:
        return True

    @property
    def elements(self) -> int:
        return self.layout.n


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """(the JSON header without `__metadata__`, absolute offset of the data), after checking that the file holds every
    byte the header promises."""
    header, base, _ = _read_header(path)
    return header, base


def _read_header(path: Path) -> tuple[dict[str, Any], int, dict[str, Any]]:
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > size - 8:
            raise CheckpointError(f"{path}: truncated safetensors file (header of {header_len} bytes, file {size})")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: corrupt safetensors header ({exc})") from exc
    metadata = header.pop(METADATA, None) or {}
    data_end = max((meta["data_offsets"][1] for meta in header.values()), default=0)
    expected = 8 + header_len + data_end
    if size < expected:
        raise CheckpointError(f"{path}: truncated safetensors file: {size} bytes, the header describes {expected}")
    return header, 8 + header_len, metadata if isinstance(metadata, dict) else {}


def file_tensors(path: Path) -> list[TensorLocation]:
    """The tensors of one file, in header order; DF11 blobs as DF11Location, their headers checked against their
    stored lengths (128 bytes read each)."""
    header, base, metadata = _read_header(path)
    compressed = metadata.get(COMPRESSION_KEY) in COMPRESSION_FORMATS
    out: list[TensorLocation] = []
    for name, meta in header.items():
        start, end = meta["data_offsets"]
        where = (name, Path(path), base + start, end - start, meta["dtype"], tuple(meta["shape"]))
        if compressed and meta["dtype"] == "U8":
            try:
                out.append(DF11Location(*where, read_layout(Path(path), base + start, end - start, name)))
            except DF11Error as exc:
                raise CheckpointError(str(exc)) from exc
        else:
            out.append(TensorLocation(*where))
    return out


def index_safetensors(files: Iterable[Path]) -> dict[str, TensorLocation]:
    """Where every tensor's bytes are across `files` (a sharded checkpoint's shards), by tensor name."""
    return {loc.name: loc for file in files for loc in file_tensors(file)}
