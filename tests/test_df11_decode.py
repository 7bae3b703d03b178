"""k6fast/kernels/df11_decode.py: the DF11 decoder, bit-exact against the tensor that was encoded.

CPU tests of the public op's CPU path (the reference); `interpret` tests of the Triton kernel at tiny shapes and
small lanes x chunk (a subprocess with TRITON_INTERPRET=1); `gpu` tests at the Pro block's weight shapes and odd
ones (1 element, sizes that leave the last group and the last lane partial, one exponent value throughout, every
bf16 bit pattern: all 256 exponents with infinities, NaNs and subnormals).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_testing import interpreter_suite, needs_cuda, needs_interpreter

from k6fast import df11
from k6fast.dit.config import DiTConfig
from k6fast.kernels.df11_decode import decode, decode_ref, decode_triton


def _gaussian(shape, std=0.02, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * std).to(torch.bfloat16)


def _every_bit_pattern(repeat: int = 1, seed: int = 0) -> torch.Tensor:
    """All 65,536 bf16 bit patterns (every exponent 0..255, both signs, inf, NaNs, subnormals), shuffled."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).repeat(repeat)
    g = torch.Generator().manual_seed(seed)
    return bits[torch.randperm(bits.numel(), generator=g)].view(torch.bfloat16)


def _one_exponent(n: int, seed: int = 0) -> torch.Tensor:
    """n values of one binade, [1, 2) and (-2, -1] (random sign and mantissa): one exponent symbol, a 1-bit code."""
    g = torch.Generator().manual_seed(seed)
    sign = torch.randint(0, 2, (n,), generator=g, dtype=torch.int32) << 15
    mantissa = torch.randint(0, 128, (n,), generator=g, dtype=torch.int32)
    return (sign | (127 << 7) | mantissa).to(torch.int16).view(torch.bfloat16)


def _operands(blob, layout, device):
    s = df11.sections(torch.from_numpy(blob).to(device), layout)
    return s["words"], s["sm"], s["lane_bits"], s["group_base"], s["lut"]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    differ = (a.view(torch.int16) != b.view(torch.int16)).sum().item()
    assert differ == 0, f"{differ} of {a.numel()} elements differ in their bits"


def test_public_op_on_cpu_is_the_reference():
    t = _gaussian((37, 41))
    blob = df11.encode(t, chunk=8, lanes=32)
    layout = df11.parse_header(blob, blob.size)
    ops = _operands(blob, layout, "cpu")
    out = decode(*ops, torch.empty_like(t), chunk=layout.chunk)
    _same_bits(out, t)
    _same_bits(decode_ref(*ops, torch.empty_like(t), chunk=layout.chunk), t)


def test_wrong_operands_say_what_was_expected():
    t = _gaussian((100,))
    blob = df11.encode(t, chunk=4, lanes=32)
    layout = df11.parse_header(blob, blob.size)
    words, sm, lane_bits, group_base, lut = _operands(blob, layout, "cpu")
    with pytest.raises(ValueError, match="expected out a contiguous bfloat16"):
        decode(words, sm, lane_bits, group_base, lut, torch.empty(100), chunk=4)
    with pytest.raises(ValueError, match="need 101 sign/mantissa bytes"):
        decode(words, sm, lane_bits, group_base, lut, torch.empty(101, dtype=torch.bfloat16), chunk=4)
    with pytest.raises(ValueError, match="expected words contiguous 1-d torch.int32"):
        decode(words.long(), sm, lane_bits, group_base, lut, torch.empty_like(t), chunk=4)
    with pytest.raises(ValueError, match="lanes a power of two >= 32"):
        blob16 = df11.encode(t, chunk=4, lanes=16)
        decode_triton(*_operands(blob16, df11.parse_header(blob16, blob16.size), "cpu"), torch.empty_like(t), chunk=4)


# ---------------------------------------------------------------------------------------------------------------
# Interpreter: the kernel at tiny shapes, 32 lanes of a few codes each.
# ---------------------------------------------------------------------------------------------------------------

test_triton_kernel_under_interpreter = interpreter_suite(__file__)

TINY = {  # case → (tensor, codes a lane decodes)
    "one element": (lambda: _gaussian((1,)), 4),
    "partial last group and lane": (lambda: _gaussian((3, 45), seed=1), 4),
    "odd codes a lane": (lambda: _gaussian((333,), seed=2), 5),
    "one exponent": (lambda: _one_exponent(200), 4),
    "every bit pattern": (lambda: _every_bit_pattern(), 64),
}


@pytest.mark.interpret
@needs_interpreter
@pytest.mark.parametrize("case", TINY)
def test_kernel_interpreted(case):
    make, chunk = TINY[case]
    t = make()
    blob = df11.encode(t, chunk=chunk, lanes=32)
    layout = df11.parse_header(blob, blob.size)
    out = torch.full_like(t, float("nan"))
    decode_triton(*_operands(blob, layout, "cpu"), out, chunk=chunk)
    _same_bits(out, t)


# ---------------------------------------------------------------------------------------------------------------
# GPU: the Pro block's weights (model dim x model dim, FF in and out) and the odd cases, default lanes x chunk.
# ---------------------------------------------------------------------------------------------------------------

_PRO = DiTConfig.from_dict({})
GPU_CASES = {
    "attention [4096, 4096]": lambda: _gaussian((_PRO.model_dim, _PRO.model_dim)),
    "ff in [16384, 4096]": lambda: _gaussian((_PRO.ff_dim, _PRO.model_dim), seed=1),
    "ff out [4096, 16384]": lambda: _gaussian((_PRO.model_dim, _PRO.ff_dim), std=0.01, seed=2),
    "norm [4096]": lambda: (1 + _gaussian((_PRO.model_dim,), std=0.1, seed=3).float()).bfloat16(),
    "one element": lambda: _gaussian((1,)),
    "group + 1": lambda: _gaussian((df11.LANES * df11.CHUNK + 1,), seed=4),
    "odd 2-d [4097, 333]": lambda: _gaussian((4097, 333), seed=5),
    "one exponent": lambda: _one_exponent(100_003),
    "every bit pattern x 5": lambda: _every_bit_pattern(5),
}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", GPU_CASES)
def test_kernel_bit_exact_on_gpu(case):
    t = GPU_CASES[case]()
    assert _PRO.model_dim == 4096 and _PRO.ff_dim == 16384, "the Pro preset changed: update the case names"
    blob = df11.encode(t, device="cuda")  # packed on the GPU and checked there with decode_ref
    assert np.array_equal(blob, df11.encode(t, check=False, device="cpu")), "the GPU and CPU encoders differ"
    layout = df11.parse_header(blob, blob.size)
    ops = _operands(blob, layout, "cuda")
    out = torch.full(t.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    decode(*ops, out, chunk=layout.chunk)
    _same_bits(out.cpu(), t)
    _same_bits(decode_ref(*ops, torch.empty_like(out), chunk=layout.chunk).cpu(), t)
    assert df11.crc32_matches(out, layout)
