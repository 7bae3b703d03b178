"""Block masks for training-free sparse video self-attention: the 3-D tiled token order and the kept-block rule.

Published training-free methods and what is taken from each:
- Sliding Tile Attention (Zhang et al., 2025, arXiv 2502.04507) and NABLA (Mikhailov et al., 2025, arXiv 2507.13546,
  the block-sparse attention of Kandinsky 5, diffusers' `nablaT_v2` with `fast_sta_nabla`): tokens reordered into
  3-D tiles so that a block of consecutive tokens is a compact box of the video; a fixed 3-D neighbourhood window of
  tiles (STA; NABLA's "add_sta" with a 3 x 3 x 3 window of 1 x 8 x 8 tiles) is always kept.
- NABLA: the rest of the mask comes from an inexpensive pass over mean-pooled queries and keys per block
  (softmax(mean(q)·mean(k)ᵀ/sqrt(D)) per head), keeping the highest-scoring blocks. NABLA keeps blocks until a
  cumulative-probability threshold; here a fixed count (the density) is kept, so that every query tile does the same
  work (no tail programs) and the speed of an arm is known before it runs.
- Sparse VideoGen 2 (Yang et al., 2025, arXiv 2505.18875) permutes tokens by k-means clusters of their keys, per
  layer and step: more accurate blocks, but a clustering pass per call and a permutation per attention call. For a
  10-step distilled model the positional tiles are permuted once per forward instead (below).
- Radial Attention (Li et al., 2025, arXiv 2506.19852): a static mask whose spatial window shrinks with temporal
  distance, with dense layers and dense timesteps at the start; the dense first/last blocks and first steps of
  k6fast's policy (K6_EXACT_ATTN_BLOCKS / K6_EXACT_ATTN_STEPS) play that role.

The token order. A block is BLOCK = 128 consecutive tokens of the order (the key tile flash-attn-4 uses on sm_90), and
the order makes blocks compact boxes of the video. The (T, H, W) grid is cut into strips of 2 frames x 8 rows; strips
are visited in a snake (consecutive strips share a face) and each strip column by column, also in a snake, a column
being its 2 x 8 tokens. Eight consecutive columns are 128 tokens, so a block is a 2 x 8 x 8 tile (TILE) of the video;
a block that turns at a strip's end covers two pieces stacked in h (or in t), still compact. Frames are ordered by
their temporal RoPE position (stably): the image-conditioning tail frame, which reuses position 0, shares the first
strip row with frame 0 instead of pairing with the last frame. Grids the strip does not divide (W1: 32 x 30 x 54 with
the tail frame, 30 = 3·8 + 6; 31 frames without it) get ragged strips (6 rows, or 1 frame), not padding: the order
holds for the whole forward, so padding tokens would go through every linear layer of every block (about 7 % more
GEMM work at W1) only to make kept blocks exact tiles, while a ragged strip only makes its blocks wider boxes
(2 x 6 x 11 instead of 2 x 8 x 8). The mask rule therefore works on each block's actual bounding box, never on an
assumed shape (at W1 the mean box is 2.0 x 8.4 x 8.3 tokens against 2 x 8 x 8; tests/test_tile_mask.py checks it).

Everything here is PyTorch on whatever device the inputs are on; nothing imports the runtime.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

TILE = (2, 8, 8)  # frames, rows, columns of a block in the interior of the order (128 tokens); the window's unit
STRIP = (2, 8)  # frames, rows of a strip of the order
BLOCK = 128  # tokens per attention block, queries and keys alike
_WINDOW_PRIORITY = 2.0  # added to a window block's pooled score (scores are probabilities, <= 1): window first
_DIAGONAL_PRIORITY = 4.0  # a query block's own block ranks above the rest of its window


@dataclass(frozen=True)
class TokenOrder:
    """The tiled order of a video token grid and the bounding box of each of its BLOCK-token blocks.

    perm: int64 [N], position i of the tiled order holds token perm[i] of the (t, h, w) row-major order.
    inverse: int64 [N], the inverse permutation.
    lo, hi: int64 [num_blocks, 3], per block the smallest and largest (temporal position, row, column) of its tokens.
    """

    perm: Tensor
    inverse: Tensor
    lo: Tensor
    hi: Tensor
    grid: tuple[int, int, int]
    block: int = BLOCK

    @property
    def num_tokens(self) -> int:
        return int(self.perm.shape[0])

    @property
    def num_blocks(self) -> int:
        return int(self.lo.shape[0])

    def apply(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """Video tokens and their RoPE tables into the tiled order. x: [B, N, D]; rope: (cos, sin) [N, D/2]."""
        self._check(x)
        perm = self.perm.to(x.device)
        return x[:, perm], (rope[0][perm], rope[1][perm])

    def undo(self, x: Tensor) -> Tensor:
        """x: [B, N, D] in the tiled order -> the (t, h, w) row-major order."""
        self._check(x)
        return x[:, self.inverse.to(x.device)]

    def _check(self, x: Tensor) -> None:
        if x.ndim != 3 or x.shape[1] != self.num_tokens:
            raise ValueError(
                f"expected [B, {self.num_tokens}, D] video tokens of grid {self.grid}, found {tuple(x.shape)}"
            )


def _runs(n: int, size: int) -> list[range]:
    """[0, n) cut into consecutive runs of `size` (the last one ragged)."""
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


def tile_order(
    grid: Sequence[int],
    t_positions: Sequence[int] | None = None,
    *,
    strip: Sequence[int] = STRIP,
    block: int = BLOCK,
) -> TokenOrder:
    """The tiled order of a (T, H, W) grid (see the module docstring). t_positions: each frame's temporal RoPE
    position (default 0..T-1); frames are ordered stably by position. Built on the CPU."""
    t, h, w = (int(n) for n in grid)
    if min(t, h, w) < 1 or len(strip) != 2 or min(strip) < 1 or block < 1:
        raise ValueError(
            f"expected a grid of three sizes >= 1, a strip of two >= 1, block >= 1; found {grid}, {strip}, {block}"
        )
    positions = list(range(t)) if t_positions is None else [int(p) for p in t_positions]
    if len(positions) != t:
        raise ValueError(f"expected {t} temporal positions (one per frame), found {len(positions)}")
    frames = torch.tensor(sorted(range(t), key=lambda f: positions[f]))  # stable: the tail frame follows frame 0
    pieces = []
    turn = 0
    for a, t_run in enumerate(_runs(t, strip[0])):
        for h_run in _runs(h, strip[1])[:: 1 if a % 2 == 0 else -1]:  # snake: consecutive strips share a face
            columns = range(w) if turn % 2 == 0 else range(w - 1, -1, -1)
            turn += 1
            ti = frames[t_run.start : t_run.stop][None, :, None]
            hi = torch.arange(h_run.start, h_run.stop)[None, None, :]
            wi = torch.tensor(list(columns))[:, None, None]
            pieces.append(((ti * h + hi) * w + wi).flatten())  # column by column, each column (t, h) row-major
    perm = torch.cat(pieces)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel())
    coords = torch.stack(
        (torch.tensor(positions)[perm // (h * w)], (perm // w) % h, perm % w), dim=1
    )  # [N, 3]: (temporal position, row, column) of each token in the tiled order
    nb = math.ceil(perm.numel() / block)
    padded = torch.cat((coords, coords[-1:].expand(nb * block - perm.numel(), 3)))  # repeats never move a min/max
    lo = padded.view(nb, block, 3).amin(dim=1)
    hi = padded.view(nb, block, 3).amax(dim=1)
    return TokenOrder(perm, inverse, lo, hi, (t, h, w), block)


def window_blocks(order: TokenOrder, radius: int, tile: Sequence[int] = TILE) -> Tensor:
    """bool [num_blocks, num_blocks]: key block j is in query block i's window when the gap between their bounding
    boxes is at most `radius` tiles along every axis (radius 1: the 3 x 3 x 3 tiles around a tile, as STA's and
    NABLA's default window; 0: only blocks whose box overlaps the query block's). Adjacent tiles have a gap of 1
    (position 7 to 8), the next ones over a gap of one tile plus 1."""
    if radius < 0:
        raise ValueError(f"expected a window radius >= 0 tiles, found {radius}")
    reach = torch.tensor([radius * s for s in tile])
    lo, hi = order.lo, order.hi
    gap = torch.maximum(lo[None, :, :] - hi[:, None, :], lo[:, None, :] - hi[None, :, :]).clamp_min(0)
    return (gap <= reach).all(dim=-1)


def keep_count(density: float, num_blocks: int) -> int:
    """Key blocks kept per query block at `density` (0 < density <= 1): round(density · num_blocks), at least 1."""
    if not 0.0 < density <= 1.0:
        raise ValueError(f"expected a density in (0, 1], found {density}")
    return min(num_blocks, max(1, round(density * num_blocks)))


def _block_means(x: Tensor, block: int) -> Tensor:
    """x: [B, N, H, D] -> fp32 [B, H, ceil(N / block), D], the mean of each block's tokens (a ragged last block
    averages only the tokens it has)."""
    b, n, h, d = x.shape
    full = n // block
    parts = []
    if full:
        parts.append(torch.sum(x[:, : full * block].view(b, full, block, h, d), dim=2, dtype=torch.float32) / block)
    if n % block:
        parts.append(torch.sum(x[:, full * block :], dim=1, keepdim=True, dtype=torch.float32) / (n % block))
    return torch.cat(parts, dim=1).transpose(1, 2)


def pooled_scores(q: Tensor, k: Tensor, block: int = BLOCK, sm_scale: float | None = None) -> Tensor:
    """NABLA's map estimate: softmax over key blocks of mean-pooled q · mean-pooled k, per head.
    q: [B, M, H, D], k: [B, N, H, D] -> fp32 [B, H, ceil(M / block), ceil(N / block)]."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    qm, km = _block_means(q, block), _block_means(k, block)
    return torch.softmax(torch.matmul(qm, km.transpose(-1, -2)) * scale, dim=-1)


def select_blocks(scores: Tensor, window: Tensor | None, keep: int) -> tuple[Tensor, Tensor]:
    """The kept key blocks per query block and head: the window first (a block's own block before the rest of it),
    then the highest pooled scores, `keep` in all. scores: fp32 [B, H, Mb, Nb]; window: bool [Mb, Nb] or None ->
    (kv_idx int32 [B, H, Mb, keep], ascending along the last axis; kv_cnt int32 [B, H, Mb], all `keep`)."""
    b, h, mb, nb = scores.shape
    if not 1 <= keep <= nb:
        raise ValueError(f"expected 1 <= keep <= {nb} key blocks, found {keep}")
    priority = scores
    if window is not None:
        if window.shape != (mb, nb):
            raise ValueError(f"expected a window of shape {(mb, nb)}, found {tuple(window.shape)}")
        boost = window.to(device=scores.device, dtype=scores.dtype) * _WINDOW_PRIORITY
        if mb == nb:
            boost = boost + torch.eye(nb, device=scores.device, dtype=scores.dtype) * _DIAGONAL_PRIORITY
        priority = scores + boost
    idx = torch.topk(priority, keep, dim=-1, sorted=False).indices
    # Ascending: both kernels treat the last kept block of a row as the only one that may be ragged.
    idx = torch.sort(idx, dim=-1).values.to(torch.int32)
    return idx, torch.full((b, h, mb), keep, dtype=torch.int32, device=scores.device)


def build_block_mask(
    q: Tensor, k: Tensor, window: Tensor | None, density: float, block: int = BLOCK
) -> tuple[Tensor, Tensor]:
    """The sparse arm's mask for one self-attention call on tokens in the tiled order. q, k: [B, N, H, D];
    window: bool [Nb, Nb] (`window_blocks`) or None -> (kv_idx, kv_cnt) as `select_blocks`."""
    scores = pooled_scores(q, k, block)
    return select_blocks(scores, window, keep_count(density, scores.shape[-1]))


def token_mask(kv_idx: Tensor, kv_cnt: Tensor, m: int, n: int, block: int = BLOCK) -> Tensor:
    """The dense token mask of a block list: bool [B, H, m, n], True where query i may attend to key j. For tests
    and references at small sizes."""
    b, h, mb, width = kv_idx.shape
    nb = math.ceil(n / block)
    valid = torch.arange(width, device=kv_idx.device) < kv_cnt[..., None].long()
    kept = torch.zeros(b, h, mb, nb + 1, dtype=torch.bool, device=kv_idx.device)
    kept.scatter_(-1, torch.where(valid, kv_idx.long(), nb), True)  # invalid entries land in the spare column
    kept = kept[..., :nb]
    return kept.repeat_interleave(block, dim=2)[:, :, :m].repeat_interleave(block, dim=3)[..., :n]
