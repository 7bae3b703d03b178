"""k6fast/df11.py: the lossless DF11 format: exact round trips, the length-limited code, the header checks at load.

CPU only: blobs are decoded with the PyTorch reference (`decode_ref`); the Triton kernel's own tests are in
test_df11_decode.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from k6fast import df11


def _roundtrip(t: torch.Tensor, **kw) -> np.ndarray:
    blob = df11.encode(t, **kw)
    layout = df11.parse_header(blob, blob.size)
    out = df11.decode_blob_ref(torch.from_numpy(blob), layout)
    assert out.shape == t.shape and out.dtype == torch.bfloat16
    assert torch.equal(out.view(torch.int16), t.view(torch.int16)), "not bit-exact"
    assert df11.crc32_matches(out, layout)
    return blob


def _bits(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.int32).to(torch.int16).view(torch.bfloat16)


@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 45), (2, 3, 5, 7), (df11.LANES * df11.CHUNK + 1,)])
def test_gaussian_round_trips_at_odd_shapes(shape):
    g = torch.Generator().manual_seed(0)
    _roundtrip((torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16))


def test_every_bit_pattern_round_trips():
    """All 65,536 bf16 values: every exponent 0..255, both zeros, infinities, NaNs, subnormals."""
    t = _bits(torch.arange(-32768, 32768)).view(256, 256)
    _roundtrip(t)
    _roundtrip(t, chunk=3, lanes=5)


def test_one_exponent_gets_a_one_bit_code():
    g = torch.Generator().manual_seed(1)
    t = _bits(127 << 7 | torch.randint(0, 128, (5000,), generator=g) | torch.randint(0, 2, (5000,), generator=g) << 15)
    blob = _roundtrip(t)
    layout = df11.parse_header(blob, blob.size)
    assert layout.total_bits == layout.groups * layout.lanes * layout.chunk  # one bit a code, padding too


def test_skewed_exponents_stay_within_twelve_bits_and_round_trip():
    # Counts halving from symbol to symbol: plain Huffman would give the two rarest symbols 17-bit codes.
    counts = np.zeros(256, dtype=np.int64)
    counts[100:118] = 2 ** np.arange(17, -1, -1)
    lengths = df11.code_lengths(counts)
    assert lengths.max() == df11.CODE_BITS and (lengths[100:118] > 0).all() and lengths[118:].max() == 0
    assert (2.0 ** -lengths[lengths > 0].astype(float)).sum() <= 1.0  # Kraft: a prefix code
    g = torch.Generator().manual_seed(2)
    exps = torch.from_numpy(np.repeat(np.arange(100, 118), counts[100:118]))
    _roundtrip(_bits(exps[torch.randperm(exps.numel(), generator=g)] << 7))


def test_ratio_close_to_the_entropy_bound_on_gaussian_weights():
    g = torch.Generator().manual_seed(3)
    t = (torch.randn(1024, 1024, generator=g) / (3 * 1024) ** 0.5).to(torch.bfloat16)
    blob = df11.encode(t, chunk=df11.CHUNK)  # the longest lanes: the fewest lane bit counts stored
    code_bits = df11.parse_header(blob, blob.size).total_bits / t.numel()
    entropy = df11.exponent_entropy_bits(t)
    assert 2.3 < entropy < 2.8
    assert entropy <= code_bits < entropy + 0.1
    assert blob.size / (2 * t.numel()) < (8 + entropy + 0.2) / 16  # lane bit counts and the table: < 0.2 bit


def test_encoder_refuses_what_it_cannot_store():
    with pytest.raises(ValueError, match="expected a non-empty bfloat16 tensor"):
        df11.encode(torch.zeros(4))
    with pytest.raises(ValueError, match="expected a non-empty bfloat16 tensor"):
        df11.encode(torch.zeros(0, dtype=torch.bfloat16))


def test_small_tensors_get_shorter_lanes_for_more_of_them():
    assert df11.chunk_for(df11.TARGET_GROUPS * df11.LANES * df11.CHUNK) == df11.CHUNK
    assert df11.chunk_for((df11.TARGET_GROUPS - 1) * df11.LANES * df11.CHUNK) == df11.CHUNK // 2
    assert df11.chunk_for(1) == df11.MIN_CHUNK


def test_compressible_is_large_bf16_only():
    assert df11.compressible(torch.empty(df11.MIN_ELEMENTS, dtype=torch.bfloat16))
    assert not df11.compressible(torch.empty(df11.MIN_ELEMENTS - 1, dtype=torch.bfloat16))
    assert not df11.compressible(torch.empty(df11.MIN_ELEMENTS, dtype=torch.float32))


def test_header_checks_name_what_is_wrong():
    blob = df11.encode((torch.randn(300) * 0.02).to(torch.bfloat16))
    with pytest.raises(df11.DF11Error, match="w: DF11 blob of .* bytes, its header describes"):
        df11.parse_header(blob, blob.size - 16, name="w")
    bad = blob.copy()
    bad[0] ^= 1
    with pytest.raises(df11.DF11Error, match="not a DF11 blob"):
        df11.parse_header(bad, bad.size)
    bad = blob.copy()
    bad[8] = 9  # version
    with pytest.raises(df11.DF11Error, match="expected DF11 version 1"):
        df11.parse_header(bad, bad.size)
    bad = blob.copy()
    bad[28] ^= 4  # element count
    with pytest.raises(df11.DF11Error, match="corrupt DF11 header"):
        df11.parse_header(bad, bad.size)
