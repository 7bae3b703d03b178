"""DF11: a BF16 tensor stored losslessly in about 11 bits a weight, laid out for decoding on the GPU in parallel.

The exponent byte of trained or Gaussian-initialised BF16 weights carries 2-3 bits of information (DFloat11, arXiv
2504.11651). The sign and mantissa are stored raw, one byte an element; the exponents are Huffman-coded with codes of
at most 12 bits (so one table lookup decodes a symbol) and dealt to lanes that decode independently (see
`k6fast/kernels/df11_decode.py` for the order). Every tensor is one uint8 blob; `df11_header.py` gives its sections.

`encode` builds a blob with vectorised PyTorch (no per-symbol Python) on the CPU or a GPU and checks it: decoded with
`decode_ref`, it must give the tensor back bit for bit. `parse_header` checks a blob's header and section sizes
against its length (cheap, at every load); `crc32_matches` checks decoded bytes against the stored CRC (a full read).
"""

from __future__ import annotations

import heapq
import zlib

import numpy as np
import torch
from torch import Tensor

from .df11_header import (  # noqa: F401 (the format's API, re-exported)
    CODE_BITS,
    HEADER_BYTES,
    LUT_SIZE,
    MAX_DIMS,
    PAD_WORDS,
    SECTIONS,
    DF11Error,
    Layout,
    parse_header,
)
from .kernels import df11_decode
from .kernels.df11_decode import decode, decode_ref

CHUNK = 256  # the most codes one lane decodes: fewer lanes' bit lengths to store against more lanes running at once
MIN_CHUNK = 32
LANES = 128  # lanes of a group (one Triton program)
# Groups (programs) a tensor's decode should launch where its size allows: each lane's decode is a serial chain, so
# a tensor of a few hundred programs leaves most of a GPU's SMs idle (an H200 holds 16 such programs on each of 132).
TARGET_GROUPS = 1024
MIN_ELEMENTS = 1 << 20  # smaller bf16 tensors stay raw in a checkpoint (`compressible`)
if (df11_decode.CODE_BITS, df11_decode.PAD_WORDS) != (CODE_BITS, PAD_WORDS):
    raise ImportError("k6fast/kernels/df11_decode.py and k6fast/df11_header.py disagree on the DF11 format's constants")


def code_lengths(counts: np.ndarray, max_len: int = CODE_BITS) -> np.ndarray:
    """Huffman code lengths (uint8 [256], 0 for absent symbols) of symbol counts [256], none longer than `max_len`:
    where Huffman's are longer, the counts are halved (keeping every present symbol at least 1) and the code rebuilt,
    which flattens the rare tail at a cost of a small fraction of a bit per symbol."""
    counts = counts.astype(np.int64)
    present = np.flatnonzero(counts)
    lengths = np.zeros(256, dtype=np.uint8)
    if len(present) == 1:
        lengths[present] = 1
        return lengths
    while True:
        heap = [(int(counts[s]), int(s), [int(s)]) for s in present]
        heapq.heapify(heap)
        depth = dict.fromkeys((int(s) for s in present), 0)
        while len(heap) > 1:
            c1, t1, a = heapq.heappop(heap)
            c2, t2, b = heapq.heappop(heap)
            for s in a + b:
                depth[s] += 1
            heapq.heappush(heap, (c1 + c2, min(t1, t2), a + b))
        if max(depth.values()) <= max_len:
            for s, d in depth.items():
                lengths[s] = d
            return lengths
        counts = np.where(counts > 0, np.maximum(counts >> 1, 1), 0)


def canonical_codes(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes int64 [256], lut int16 [4096]) of the canonical prefix code with these lengths: codes assigned in
    (length, symbol) order; the table maps every 12-bit window starting with a code to symbol | length << 8."""
    codes = np.zeros(256, dtype=np.int64)
    lut = np.zeros(LUT_SIZE, dtype=np.int16)
    code, prev = 0, 0
    for s in sorted(np.flatnonzero(lengths), key=lambda s: (lengths[s], s)):
        length = int(lengths[s])
        code <<= length - prev
        prev = length
        codes[s] = code
        span = CODE_BITS - length
        lut[code << span : (code + 1) << span] = s | (length << 8)
        code += 1
    if code > 1 << prev:
        raise AssertionError(f"code lengths {lengths[lengths > 0]} violate Kraft's inequality")
    return codes, lut


def split_bf16(t: Tensor) -> tuple[Tensor, Tensor]:
    """(exponents int32 [n], sign | mantissa uint8 [n]) of a bf16 tensor, flattened, on its device."""
    bits = t.detach().contiguous().reshape(-1).view(torch.int16).to(torch.int32) & 0xFFFF
    return bits >> 7 & 0xFF, ((bits >> 8 & 0x80) | (bits & 0x7F)).to(torch.uint8)


def compressible(t: Tensor) -> bool:
    """Whether the checkpoint writer stores `t` as DF11: bf16 of at least MIN_ELEMENTS elements. Smaller tensors
    (biases, norms) stay raw: their bytes are a fraction of a percent of a block, and a one-group tensor decodes at
    one lane's serial speed."""
    return t.dtype == torch.bfloat16 and t.numel() >= MIN_ELEMENTS and t.ndim <= MAX_DIMS


def chunk_for(n: int) -> int:
    """Codes a lane decodes in a tensor of n elements: CHUNK, halved (down to MIN_CHUNK) until the tensor has
    TARGET_GROUPS groups of LANES lanes."""
    chunk = CHUNK
    while chunk > MIN_CHUNK and -(-n // (LANES * chunk)) < TARGET_GROUPS:
        chunk //= 2
    return chunk


def encode(t: Tensor, *, chunk: int | None = None, lanes: int = LANES, check: bool = True, device=None) -> np.ndarray:
    """A bf16 tensor [...] (1 element or more) → its DF11 blob (uint8 [nbytes], host memory); chunk None:
    `chunk_for(t.numel())`. The bit packing runs in PyTorch on `device` (default: t's; a GPU does it in
    milliseconds). With `check`, the blob is decoded there with `decode_ref` and compared with `t` bit for bit, else
    AssertionError."""
    if t.dtype != torch.bfloat16 or t.numel() < 1 or t.ndim > MAX_DIMS:
        raise ValueError(f"df11: expected a non-empty bfloat16 tensor of <= {MAX_DIMS} dims, found {t.dtype} "
                         f"{tuple(t.shape)}")  # fmt: skip
    device = torch.device(device) if device is not None else t.device
    chunk = chunk_for(t.numel()) if chunk is None else chunk
    host = t.detach().contiguous().cpu()
    crc = zlib.crc32(host.reshape(-1).view(torch.int16).numpy())
    x = host.to(device)
    exps, sm = split_bf16(x)
    n = exps.numel()
    counts = torch.bincount(exps, minlength=256)
    lengths = code_lengths(counts.cpu().numpy())
    codes, lut = canonical_codes(lengths)
    group = lanes * chunk
    groups = -(-n // group)
    # Pad with the most frequent symbol (the shortest code), then deal: stream order is (group, lane, step).
    padded = torch.full((groups * group,), int(counts.argmax()), dtype=torch.int32, device=device)
    padded[:n] = exps
    stream = padded.view(groups, chunk, lanes).transpose(1, 2).reshape(-1)
    table = torch.from_numpy(codes << 8 | lengths.astype(np.int64)).to(device)
    entry = table.index_select(0, stream)  # [groups · lanes · chunk] code << 8 | length
    del padded, stream
    length = entry & 0xFF
    end = torch.cumsum(length, 0)
    start = end - length
    layout = Layout(tuple(t.shape), chunk, lanes, int(end[-1]), crc)
    words = _pack_bits(entry >> 8, length, start, layout.n_words)
    parts = {
        "lut": torch.from_numpy(lut),
        "group_base": start.view(groups, group)[:, 0],
        "lane_bits": length.view(-1, chunk).sum(1).to(torch.int16),
        "sm": sm,
        "words": words,
    }
    blob = np.zeros(layout.nbytes, dtype=np.uint8)
    blob[:HEADER_BYTES] = np.frombuffer(layout.header(), dtype=np.uint8)
    for name, (at, _) in layout.sections().items():
        raw = parts[name].contiguous().cpu().numpy().view(np.uint8)
        blob[at : at + raw.size] = raw
    if check:
        decoded = decode_blob_ref(torch.from_numpy(blob).to(device), layout)
        if not torch.equal(decoded.view(torch.int16), x.view(torch.int16)):
            raise AssertionError(f"df11: a {tuple(t.shape)} tensor did not decode to itself")
    return blob


def _pack_bits(code: Tensor, length: Tensor, start: Tensor, n_words: int) -> Tensor:
    """The bitstream (int32 [n_words], first bit in each word's most significant bit) of codes (int64 [N]) of
    `length` bits at ascending bit offsets `start`. A code of <= 12 bits spans at most two words, and every word
    holds the start of a code (a spilled tail has at most 11 bits); the parts landing in one word occupy disjoint
    bits, so their sum is their OR: a word is a difference of a running sum at the last code that starts in it."""
    word = start >> 5
    end = (start & 31) + length
    spill = torch.nonzero(end > 32).squeeze(1)
    head = code << (32 - end).clamp_min(0)
    head[spill] = code[spill] >> (end[spill] - 32)
    last = torch.nonzero(word[1:] != word[:-1]).squeeze(1)
    last = torch.cat([last, torch.tensor([word.numel() - 1], device=word.device)])
    sums = torch.cumsum(head, 0)[last]
    acc = torch.zeros(n_words, dtype=torch.int64, device=code.device)
    acc[word[last]] = torch.diff(sums, prepend=sums.new_zeros(1))
    acc[word[spill] + 1] += (code[spill] << (64 - end[spill])) & 0xFFFFFFFF  # at most one spill into a word
    return torch.where(acc >= 1 << 31, acc - (1 << 32), acc).to(torch.int32)


def sections(blob: Tensor, layout: Layout) -> dict[str, Tensor]:
    """Views of a blob's sections (uint8 blob [nbytes], CPU or GPU): lut, group_base, lane_bits, sm, words."""
    out = {}
    for name, (at, count) in layout.sections().items():
        itemsize, dtype = SECTIONS[name]
        out[name] = blob[at : at + count * itemsize].view(getattr(torch, dtype))
    return out


def decode_blob(blob: Tensor, layout: Layout, out: Tensor | None = None) -> Tensor:
    """Decode a blob (uint8 [nbytes] on the target device) into `out` (bf16 [layout.shape], allocated if None) with
    the op (`kernels.df11_decode.decode`: Triton on CUDA)."""
    if out is None:
        out = torch.empty(layout.shape, dtype=torch.bfloat16, device=blob.device)
    s = sections(blob, layout)
    return decode(s["words"], s["sm"], s["lane_bits"], s["group_base"], s["lut"], out, chunk=layout.chunk)


def decode_blob_ref(blob: Tensor, layout: Layout, out: Tensor | None = None) -> Tensor:
    """`decode_blob` with the PyTorch reference decoder, on the blob's device."""
    if out is None:
        out = torch.empty(layout.shape, dtype=torch.bfloat16, device=blob.device)
    s = sections(blob, layout)
    return decode_ref(s["words"], s["sm"], s["lane_bits"], s["group_base"], s["lut"], out, chunk=layout.chunk)


def crc32_matches(decoded: Tensor, layout: Layout) -> bool:
    """Whether a decoded bf16 tensor's bytes have the CRC-32 its header stores (reads the tensor on the CPU)."""
    raw = decoded.detach().contiguous().reshape(-1).view(torch.int16).cpu().numpy()
    return zlib.crc32(raw) == layout.crc32


def exponent_entropy_bits(t: Tensor) -> float:
    """Shannon entropy of a bf16 tensor's exponent bytes, in bits a symbol: the bound for any exponent coder."""
    p = torch.bincount(split_bf16(t)[0], minlength=256).double().cpu().numpy()
    p = p[p > 0] / p.sum()
    return float(-(p * np.log2(p)).sum())
