"""Per-channel moments of an activation, for the GroupNorm statistics of the HunyuanVideo VAE decoder: x read once in
its own dtype, fp32 mean and squared deviations per tile of positions, for the caller's float64 merge per group
(k6fast.video_decode.norm_stats).

What it holds:
- `channel_moments_triton(x)`: x [B, C, T, H, W] → (span, mean [P, B, C], m2 [P, B, C]), both fp32: tile p covers
  positions [p * span, (p + 1) * span) of the flattened T·H·W (the last tile fewer), m2 is the sum of squared
  deviations about the tile's own mean. Inside a tile the kernel reduces sub-tiles of BLOCK_P positions two-pass
  (mean, then deviations) and merges them as Chan et al., in fp32; the caller merges tiles in float64. PyTorch's
  path (`norm_stats`: an fp32 copy of each 64 MiB block, then Welford `var_mean`) reads and writes about 10 bytes per
  bf16 element in two kernels and reduces a channels-last block slowly; this reads 2.
- `positions_stride(x)`: the one stride of T·H·W flattened, or None where they do not flatten (then the caller keeps
  PyTorch's path).

Check: `pytest tests/test_groupnorm_stats.py` (interpreter; `-m gpu` on a GPU machine).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# Enough programs to fill a large GPU several times over; past that each program walks more sub-tiles, so the
# per-tile outputs stay small (a 12.8 GB W1 activation: ≈ 1 MB of them).
_TARGET_PROGRAMS = 4096
_TILE_ELEMENTS = 4096  # elements of one sub-tile (BLOCK_P x BLOCK_C)


def positions_stride(x: Tensor) -> int | None:
    """The stride between consecutive positions of x [B, C, T, H, W] when T, H and W flatten into one strided dim
    (any tensor contiguous in NCDHW or NDHWC, and any slice of one along T); else None."""
    dims = [(n, s) for n, s in zip(x.shape[2:], x.stride()[2:], strict=True) if n != 1]
    for (_, outer), (n_inner, inner) in zip(dims, dims[1:], strict=False):
        if outer != inner * n_inner:
            return None
    return dims[-1][1] if dims else 1


@triton.jit
def _channel_moments_kernel(
    x_ptr,  # element (b, c, p) at b * stride_b + c * stride_c + p * stride_p
    mean_ptr,  # fp32 [P, B, C]
    m2_ptr,
    n_pos,
    n_ch,
    n_batch,
    stride_b,
    stride_c,
    stride_p,
    span,  # positions per program (a multiple of BLOCK_P)
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    tile = tl.program_id(0)
    b = tl.program_id(2)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ch_ok = ch < n_ch
    # Whole-clip activations pass 2**31 elements (12.8 GB at W1): offsets in int64.
    base = x_ptr + b.to(tl.int64) * stride_b + ch.to(tl.int64)[None, :] * stride_c
    start = tile.to(tl.int64) * span
    count = 0.0
    mean = tl.zeros([BLOCK_C], dtype=tl.float32)
    m2 = tl.zeros([BLOCK_C], dtype=tl.float32)
    for k in range(0, span, BLOCK_P):
        p = start + k + tl.arange(0, BLOCK_P)
        p_ok = p < n_pos
        mask = p_ok[:, None] & ch_ok[None, :]
        v = tl.load(base + p[:, None] * stride_p, mask=mask, other=0.0).to(tl.float32)
        n_k = tl.sum(p_ok.to(tl.float32), axis=0)
        mean_k = tl.sum(v, axis=0) / tl.maximum(n_k, 1.0)
        d = tl.where(mask, v - mean_k[None, :], 0.0)
        m2_k = tl.sum(d * d, axis=0)
        # Chan et al.: a sub-tile past the last position has n_k = 0 and changes nothing.
        total = count + n_k
        share = n_k / tl.maximum(total, 1.0)
        delta = mean_k - mean
        mean = mean + delta * share
        m2 = m2 + m2_k + delta * delta * (count * share)
        count = total
    out = (tile * n_batch + b) * n_ch + ch
    tl.store(mean_ptr + out, mean, mask=ch_ok)
    tl.store(m2_ptr + out, m2, mask=ch_ok)


def _blocks(stride_c: int, n_ch: int) -> tuple[int, int]:
    """(BLOCK_P, BLOCK_C): wide along whichever of positions and channels is unit-stride, so loads coalesce."""
    if stride_c == 1:
        block_c = min(triton.next_power_of_2(n_ch), 128)
        return max(16, _TILE_ELEMENTS // block_c), block_c
    return _TILE_ELEMENTS // 8, 8


def channel_moments_triton(x: Tensor, *, programs: int = _TARGET_PROGRAMS) -> tuple[int, Tensor, Tensor]:
    """x [B, C, T, H, W] (positions flattening, see `positions_stride`) on whatever device it is on (CUDA, or CPU
    under TRITON_INTERPRET=1) → (span, mean, m2): fp32 [P, B, C] per tile of `span` positions, the last tile
    covering the rest (T·H·W - (P - 1) * span positions). `programs`: about how many programs to launch (fewer:
    longer tiles, each walked in more sub-tiles)."""
    if x.ndim != 5 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"channel_moments: expected bf16, fp16 or fp32 x [B, C, T, H, W], found {x.dtype} {x.shape}")
    stride_p = positions_stride(x)
    if stride_p is None:
        raise ValueError(f"channel_moments: expected T, H, W of x to flatten into one dim, found strides {x.stride()}")
    b, c = x.shape[:2]
    n_pos = x.shape[2] * x.shape[3] * x.shape[4]
    if n_pos == 0 or b * c == 0:
        raise ValueError(f"channel_moments: expected a non-empty x, found {tuple(x.shape)}")
    block_p, block_c = _blocks(x.stride(1), c)
    per_tile = b * triton.cdiv(c, block_c)
    sub_tiles = triton.cdiv(n_pos, block_p)
    span = block_p * max(1, sub_tiles * per_tile // max(1, programs))
    tiles = triton.cdiv(n_pos, span)
    mean = torch.empty((tiles, b, c), dtype=torch.float32, device=x.device)
    m2 = torch.empty_like(mean)
    grid = (tiles, triton.cdiv(c, block_c), b)
    _channel_moments_kernel[grid](
        x, mean, m2, n_pos, c, b, x.stride(0), x.stride(1), stride_p, span,
        BLOCK_P=block_p, BLOCK_C=block_c, num_warps=8,
    )  # fmt: skip
    return span, mean, m2
