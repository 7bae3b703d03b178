"""Decoding a DF11-compressed BF16 tensor (the lossless format of `k6fast/df11.py`) into a BF16 buffer, bit-exact.

A BF16 value is sign (1 bit), exponent (8) and mantissa (7). The format stores the sign and mantissa as one raw byte
per element (`sm`: sign in bit 7, mantissa in bits 0-6) and the exponents as canonical Huffman codes of at most
`CODE_BITS` (12) bits, so one 4096-entry table lookup decodes a symbol. For parallel decoding the elements are dealt
to lanes: a group holds `lanes` x `chunk` elements, and lane i of group g decodes the `chunk` exponents of elements
g·lanes·chunk + j·lanes + i (j = 0..chunk-1), whose codes lie one after another in the bitstream. Consecutive lanes
therefore write consecutive elements at every step (coalesced stores), and each lane only needs its start bit:
`group_base[g]` (int64, the group's first bit) plus the bit lengths of the lanes before it (`lane_bits`, int16,
summed in the kernel).

Operands (all on one device, contiguous):
  words       int32 [W]            the bitstream as 32-bit words, first bit in a word's most significant bit, with
                                   two words of padding past the last code (a lane reads the word after its own)
  sm          uint8 [n]            sign | mantissa of every element, in element order
  lane_bits   int16 [G * lanes]    bits each lane's `chunk` codes take
  group_base  int64 [G]            bit offset of each group's first code
  lut         int16 [4096]         for each 12-bit window: symbol | code length << 8
  out         bf16 [...]           n elements, written in full; G = ceil(n / (lanes · chunk)) (the last group's
                                   lanes past n decode padding codes and write nothing)

What it holds: `decode(...)` (the op: the Triton kernel on CUDA, the reference elsewhere, logged once),
`decode_ref(...)` (vectorised PyTorch, any device: the lanes decode in lock-step, one step per element of a chunk)
and the private `_df11_decode_kernel`.

Check: `pytest tests/test_df11_decode.py` (CPU + interpreter; `-m gpu` on a GPU machine).
Benchmark: `python measurements/bench_df11.py --out df11.json` (correctness first, then decode GB/s).
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl
from torch import Tensor

from .fallback import cuda_at_least, kernel_runs

logger = logging.getLogger(__name__)

CODE_BITS = 12  # the longest code: one lookup of a 2**12-entry table decodes any symbol
LUT_SIZE = 1 << CODE_BITS
PAD_WORDS = 2


def _check(words: Tensor, sm: Tensor, lane_bits: Tensor, group_base: Tensor, lut: Tensor, out: Tensor, chunk: int):
    want = {"words": torch.int32, "sm": torch.uint8, "lane_bits": torch.int16, "group_base": torch.int64}
    for name, t in (("words", words), ("sm", sm), ("lane_bits", lane_bits), ("group_base", group_base)):
        if t.dtype != want[name] or t.ndim != 1 or not t.is_contiguous() or t.device != out.device:
            raise ValueError(
                f"df11 decode: expected {name} contiguous 1-d {want[name]} on {out.device}, found {t.dtype} "
                f"{tuple(t.shape)} on {t.device}"
            )
    if lut.dtype != torch.int16 or lut.shape != (LUT_SIZE,) or lut.device != out.device or not lut.is_contiguous():
        raise ValueError(f"df11 decode: expected lut int16 [{LUT_SIZE}], found {lut.dtype} {tuple(lut.shape)}")
    if out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"df11 decode: expected out a contiguous bfloat16 tensor, found {out.dtype}")
    n, groups = out.numel(), group_base.numel()
    if chunk < 1 or groups < 1 or lane_bits.numel() % groups:
        raise ValueError(f"df11 decode: expected chunk >= 1 and lanes x groups lane_bits, found chunk {chunk}, "
                         f"{lane_bits.numel()} lane_bits for {groups} groups")  # fmt: skip
    lanes = lane_bits.numel() // groups
    if sm.numel() != n or groups != -(-n // (lanes * chunk)):
        raise ValueError(
            f"df11 decode: {n} elements need {n} sign/mantissa bytes and {-(-n // (lanes * chunk))} groups of "
            f"{lanes} x {chunk}, found {sm.numel()} bytes and {groups} groups"
        )
    return lanes


def decode_ref(
    words: Tensor, sm: Tensor, lane_bits: Tensor, group_base: Tensor, lut: Tensor, out: Tensor, *, chunk: int
) -> Tensor:
    """Decode into `out` (bf16, n elements) with PyTorch ops on the operands' device; returns out. Shapes as in the
    module docstring. Every lane advances one code per step, so the loop runs `chunk` times over all lanes at once."""
    lanes = _check(words, sm, lane_bits, group_base, lut, out, chunk)
    groups = group_base.numel()
    w64 = words.to(torch.int64) & 0xFFFFFFFF
    bits = lane_bits.to(torch.int64).view(groups, lanes)
    pos = (group_base.view(groups, 1) + bits.cumsum(1) - bits).reshape(-1)  # [G * lanes] each lane's next bit
    table = lut.to(torch.int64)
    exps = torch.empty(groups, chunk, lanes, dtype=torch.int64, device=out.device)
    for j in range(chunk):
        word = pos >> 5
        window = (w64.index_select(0, word) << 32) | w64.index_select(0, word + 1)  # >= 33 bits ahead of pos
        entry = table.index_select(0, (window >> (64 - CODE_BITS - (pos & 31))) & (LUT_SIZE - 1))
        exps[:, j, :] = (entry & 0xFF).view(groups, lanes)
        pos += entry >> 8
    n = out.numel()
    s = sm.to(torch.int32)
    value = ((s & 0x80) << 8) | (exps.reshape(-1)[:n].to(torch.int32) << 7) | (s & 0x7F)
    out.view(-1).view(torch.int16).copy_(value.to(torch.int16))
    return out


@triton.jit
def _df11_decode_kernel(
    words_ptr,  # int32 [W]
    sm_ptr,  # uint8 [n]
    lane_bits_ptr,  # int16 [G * LANES]
    group_base_ptr,  # int64 [G]
    lut_ptr,  # int16 [2**CODE_BITS]
    out_ptr,  # int16 view of the bf16 output [n]
    n,
    CHUNK: tl.constexpr,
    LANES: tl.constexpr,
    CODE_BITS: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, LANES)
    bits = tl.load(lane_bits_ptr + g * LANES + lane).to(tl.int64)
    pos = tl.load(group_base_ptr + g) + tl.cumsum(bits, 0) - bits
    first = g * (LANES * CHUNK) + lane
    for j in tl.range(0, CHUNK // 2):
        # The time-critical chain: a 64-bit window from the lane's word (at least 33 bits ahead of pos, so two codes
        # of <= 12 bits), two table lookups, advance.
        word = pos >> 5
        hi = tl.load(words_ptr + word).to(tl.uint32, bitcast=True).to(tl.uint64)
        lo = tl.load(words_ptr + word + 1).to(tl.uint32, bitcast=True).to(tl.uint64)
        window = (hi << 32) | lo
        used = pos & 31
        entry = tl.load(lut_ptr + _code(window, used, CODE_BITS)).to(tl.int32)
        used += (entry >> 8).to(tl.int64)
        entry2 = tl.load(lut_ptr + _code(window, used, CODE_BITS)).to(tl.int32)
        pos += (entry >> 8).to(tl.int64) + (entry2 >> 8).to(tl.int64)
        _put(sm_ptr, out_ptr, first + (2 * j) * LANES, n, entry)
        _put(sm_ptr, out_ptr, first + (2 * j + 1) * LANES, n, entry2)
    if CHUNK % 2 == 1:
        word = pos >> 5
        hi = tl.load(words_ptr + word).to(tl.uint32, bitcast=True).to(tl.uint64)
        lo = tl.load(words_ptr + word + 1).to(tl.uint32, bitcast=True).to(tl.uint64)
        entry = tl.load(lut_ptr + _code((hi << 32) | lo, pos & 31, CODE_BITS)).to(tl.int32)
        _put(sm_ptr, out_ptr, first + (CHUNK - 1) * LANES, n, entry)


@triton.jit
def _code(window, used, CODE_BITS: tl.constexpr):
    """The CODE_BITS bits of a 64-bit window after its first `used` bits (used <= 64 - CODE_BITS)."""
    return ((window >> (64 - CODE_BITS - used).to(tl.uint64)) & ((1 << CODE_BITS) - 1)).to(tl.int32)


@triton.jit
def _put(sm_ptr, out_ptr, e, n, entry):
    """Element e (masked past n): its sign | mantissa byte around the decoded exponent (entry's low byte)."""
    mask = e < n
    s = tl.load(sm_ptr + e, mask=mask, other=0).to(tl.int32)
    value = ((s & 0x80) << 8) | ((entry & 0xFF) << 7) | (s & 0x7F)
    tl.store(out_ptr + e, value.to(tl.int16), mask=mask)


# ---------------------------------------------------------------------------------------------------------------
# Dispatch:   CUDA sm_80+   Triton
#             CPU, older    reference (logged once)
# ---------------------------------------------------------------------------------------------------------------


def decode_triton(
    words: Tensor, sm: Tensor, lane_bits: Tensor, group_base: Tensor, lut: Tensor, out: Tensor, *, chunk: int
) -> Tensor:
    """The Triton kernel whatever the device (the interpreter runs it on CPU tensors); returns out."""
    lanes = _check(words, sm, lane_bits, group_base, lut, out, chunk)
    if lanes & (lanes - 1) or lanes < 32:
        raise ValueError(f"df11 decode: the kernel needs lanes a power of two >= 32, found {lanes}")
    grid = (group_base.numel(),)
    _df11_decode_kernel[grid](
        words, sm, lane_bits, group_base, lut, out.view(torch.int16), out.numel(),
        CHUNK=chunk, LANES=lanes, CODE_BITS=CODE_BITS, num_warps=max(1, lanes // 32),
    )  # fmt: skip
    return out


def decode(
    words: Tensor, sm: Tensor, lane_bits: Tensor, group_base: Tensor, lut: Tensor, out: Tensor, *, chunk: int
) -> Tensor:
    """Decode a DF11 tensor into `out` (bf16, contiguous, on the operands' device), bit-exact; returns out. Shapes
    as in the module docstring. The Triton kernel on CUDA sm_80+, else `decode_ref`."""
    runs = kernel_runs(logger, "df11 decode", out.device, cuda_at_least(out.device, (8, 0)), "needs sm_80+")
    if runs:
        return decode_triton(words, sm, lane_bits, group_base, lut, out, chunk=chunk)
    return decode_ref(words, sm, lane_bits, group_base, lut, out, chunk=chunk)
