"""The DF11 blob's header and section layout, without PyTorch: what `open_checkpoint` reads to validate a compressed
checkpoint (128 bytes a tensor) and what the encoder and decoders address the sections by (`k6fast/df11.py` holds
the format's description; `k6fast/kernels/df11_decode.py` the decoder).

A blob, little-endian, each section starting at a multiple of 16 bytes and the blob's length a multiple of 16 (so
blobs laid back to back in a file keep every section aligned):
  header      128 bytes     MAGIC, version, dtype (BF16), ndim, chunk, lanes, n, total bits, CRC-32 of the
                            original bytes, shape (up to 8 dims)
  lut         int16 [4096]  symbol | code length << 8 for every 12-bit window
  group_base  int64 [G]     first bit of each group of lanes · chunk elements
  lane_bits   int16 [G·L]   bits each lane's codes take
  sm          uint8 [n]     sign | mantissa
  words       int32 [W]     the bitstream, PAD_WORDS words of padding at its end
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

# transformer/config.json of a checkpoint written by `k6fast quantize --format df11`: {"format": "df11", "version": 1}
COMPRESSION_KEY = "k6fast_compression"
COMPRESSION_FORMATS = ("df11",)
COMPRESSION_VERSION = 1
MAGIC = b"K6DF11\x00\x00"
VERSION = 1
DTYPE_BF16 = 1
CODE_BITS = 12  # the longest code: one lookup of a 2**12-entry table decodes any symbol
LUT_SIZE = 1 << CODE_BITS
PAD_WORDS = 2  # a lane reads the word after the one its next code starts in
MAX_DIMS = 8
HEADER_BYTES = 128
ALIGN = 16
_HEADER = struct.Struct(f"<8sIIIIIQQI{MAX_DIMS}Q")
# section name → (item size, dtype name as in torch)
SECTIONS = {"lut": (2, "int16"), "group_base": (8, "int64"), "lane_bits": (2, "int16"), "sm": (1, "uint8"),
            "words": (4, "int32")}  # fmt: skip


class DF11Error(ValueError):
    """A blob that is not a DF11 tensor, or whose header and sizes disagree with its length."""


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Layout:
    """What a blob decodes to and where its sections lie (byte offsets into the blob)."""

    shape: tuple[int, ...]
    chunk: int
    lanes: int
    total_bits: int
    crc32: int

    @property
    def n(self) -> int:
        return math.prod(self.shape)

    @property
    def groups(self) -> int:
        return -(-self.n // (self.lanes * self.chunk))

    @property
    def n_words(self) -> int:
        return -(-self.total_bits // 32) + PAD_WORDS

    def sections(self) -> dict[str, tuple[int, int]]:
        """name → (byte offset, element count), in blob order."""
        counts = {"lut": LUT_SIZE, "group_base": self.groups, "lane_bits": self.groups * self.lanes, "sm": self.n,
                  "words": self.n_words}  # fmt: skip
        out, at = {}, HEADER_BYTES
        for name, (itemsize, _) in SECTIONS.items():
            out[name] = (at, counts[name])
            at += _aligned(counts[name] * itemsize)
        return out

    @property
    def nbytes(self) -> int:
        at, count = self.sections()["words"]
        return at + _aligned(count * SECTIONS["words"][0])

    @property
    def max_bits(self) -> int:
        """The most bits any tensor of this shape can take: every code CODE_BITS long, padding included."""
        return self.groups * self.lanes * self.chunk * CODE_BITS

    def header(self) -> bytes:
        shape = list(self.shape) + [0] * (MAX_DIMS - len(self.shape))
        raw = _HEADER.pack(MAGIC, VERSION, DTYPE_BF16, len(self.shape), self.chunk, self.lanes, self.n,
                           self.total_bits, self.crc32, *shape)  # fmt: skip
        return raw + bytes(HEADER_BYTES - len(raw))


def parse_header(head: bytes | memoryview, nbytes: int, *, name: str = "tensor") -> Layout:
    """The layout of a blob of `nbytes` bytes from its first HEADER_BYTES (any buffer: bytes, a NumPy array), after
    checking magic, version, dtype and that the sections fill exactly `nbytes`. Raises DF11Error naming `name`."""
    head = bytes(memoryview(head).cast("B")[:HEADER_BYTES])
    if len(head) < _HEADER.size or head[:8] != MAGIC:
        raise DF11Error(f"{name}: not a DF11 blob (expected magic {MAGIC!r}, found {head[:8]!r})")
    _, version, dtype, ndim, chunk, lanes, n, total_bits, crc, *dims = _HEADER.unpack(head[: _HEADER.size])
    if version != VERSION or dtype != DTYPE_BF16:
        raise DF11Error(f"{name}: expected DF11 version {VERSION} of BF16, found version {version} dtype {dtype}")
    if not 0 <= ndim <= MAX_DIMS or chunk < 1 or lanes < 1 or any(dims[ndim:]):
        raise DF11Error(f"{name}: corrupt DF11 header (ndim {ndim}, chunk {chunk}, lanes {lanes}, dims {dims})")
    layout = Layout(tuple(dims[:ndim]), chunk, lanes, total_bits, crc)
    if layout.n != n or n < 1 or total_bits > layout.max_bits:
        raise DF11Error(f"{name}: corrupt DF11 header ({n} elements for shape {layout.shape}, {total_bits} bits)")
    if layout.nbytes != nbytes:
        raise DF11Error(f"{name}: DF11 blob of {nbytes} bytes, its header describes {layout.nbytes}")
    return layout


def read_layout(path: Path, offset: int, nbytes: int, name: str) -> Layout:
    """The layout of the blob stored at `offset` (nbytes long) in the file `path`, from its header alone."""
    fd = os.open(path, os.O_RDONLY)
    try:
        head = os.pread(fd, HEADER_BYTES, offset)
    finally:
        os.close(fd)
    return parse_header(head, nbytes, name=f"{path}: tensor {name}")
