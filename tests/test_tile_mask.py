"""The sparse arm's mask builder (k6fast/kernels/tile_mask.py), on CPU: the tiled token order (a permutation, its
inverse, compact blocks, the tail frame beside frame 0, ragged strips), block bounding boxes, the 3-D window, the
pooled-score pass, the kept-block selection (window first, density accounting, ascending rows) and the dense token
mask."""

from __future__ import annotations

import math

import pytest
import torch

from k6fast.kernels import tile_mask as tm

W1 = (32, 30, 54)  # with the image tail frame
W1_POSITIONS = list(range(31)) + [0]


def _coords(grid, positions=None):
    t, h, w = grid
    positions = list(range(t)) if positions is None else positions
    idx = torch.arange(t * h * w)
    return torch.stack((torch.tensor(positions)[idx // (h * w)], (idx // w) % h, idx % w), dim=1)


@pytest.mark.parametrize(
    ("grid", "positions"), [(W1, W1_POSITIONS), ((31, 30, 54), None), ((3, 5, 7), None), ((1, 1, 1), None)]
)
def test_order_is_a_permutation_with_its_inverse(grid, positions):
    order = tm.tile_order(grid, positions)
    n = math.prod(grid)
    assert order.num_tokens == n and order.num_blocks == math.ceil(n / tm.BLOCK)
    assert torch.equal(torch.sort(order.perm).values, torch.arange(n))
    assert torch.equal(order.perm[order.inverse], torch.arange(n))
    x = torch.randn(2, n, 3)
    rope = (torch.randn(n, 4), torch.randn(n, 4))
    moved, (cos, sin) = order.apply(x, rope)
    assert torch.equal(order.undo(moved), x)  # round trip, bit for bit
    assert torch.equal(cos, rope[0][order.perm]) and torch.equal(sin, rope[1][order.perm])
    i = n // 2
    assert torch.equal(moved[:, i], x[:, order.perm[i]])  # the RoPE row travels with its token


def test_boxes_are_the_blocks_true_extents():
    grid = (5, 11, 13)
    order = tm.tile_order(grid)
    coords = _coords(grid)[order.perm]
    for i in range(order.num_blocks):
        block = coords[i * tm.BLOCK : (i + 1) * tm.BLOCK]
        assert torch.equal(order.lo[i], block.amin(0)) and torch.equal(order.hi[i], block.amax(0)), i


def test_w1_blocks_are_compact_2x8x8_tiles():
    order = tm.tile_order(W1, W1_POSITIONS)
    extent = (order.hi - order.lo + 1).float()
    mean = extent.mean(0)
    # The interior blocks are exact 2 x 8 x 8 tiles; ragged 6-row strips and strip turns widen a few.
    assert mean[0] <= 2.1 and mean[1] <= 8.5 and mean[2] <= 8.5, mean
    exact = (extent == torch.tensor([2.0, 8.0, 8.0])).all(dim=1).float().mean()
    assert exact >= 0.6, exact
    assert extent.prod(dim=1).max() <= 2 * 16 * 9  # the widest: a strip turn, two 8-row pieces


def test_consecutive_tokens_are_neighbours():
    # The snake: consecutive columns of a strip, consecutive strips, consecutive frame pairs all touch.
    grid = (5, 19, 7)
    order = tm.tile_order(grid)
    coords = _coords(grid)[order.perm]
    t, h, w = grid
    column = coords.view(-1, 3)
    jumps = (column[1:] - column[:-1]).abs()
    # Inside a column tokens step through (t, h); from column to column w moves by one, or, at a strip's end, the next
    # strip (rows or frames) starts in the same column.
    assert (jumps[:, 2] <= 1).all() and (jumps[:, 1] <= 15).all() and (jumps[:, 0] <= 2).all()
    assert ((jumps[:, 2] == 1) & (jumps[:, 0] + jumps[:, 1] > 8)).sum() == 0  # a w step never also jumps far


def test_tail_frame_shares_the_first_strip_with_frame_0():
    grid = (4, 8, 16)  # three frames and the tail, one strip row of 8
    order = tm.tile_order(grid, [0, 1, 2, 0])
    frames = order.perm // (8 * 16)
    first_strip = frames[: 2 * 8 * 16]
    assert set(first_strip.tolist()) == {0, 3}  # frame 0 and the tail frame (position 0)
    assert order.lo[0, 0] == 0 and order.hi[0, 0] == 0  # the block's temporal extent is position 0 only
    with pytest.raises(ValueError, match="expected 4 temporal positions"):
        tm.tile_order(grid, [0, 1, 2])


def test_ragged_strips_widen_their_blocks_without_padding():
    grid = (3, 14, 20)  # a 6-row strip under an 8-row one, a single-frame strip after a pair
    order = tm.tile_order(grid)
    assert order.num_tokens == 3 * 14 * 20  # no padding tokens
    extent = order.hi - order.lo + 1
    # A block that turns from one strip to the next covers two pieces stacked in h (two strips of rows) or in t (the
    # last frame pair, then the single frame).
    assert (extent[:, 1] <= 16).all() and (extent[:, 0] <= 3).all() and (extent[:, 2] <= 20).all()
    assert (extent.prod(dim=1) <= 2 * 14 * 20).all()


def test_window_radius_counts_tiles():
    grid = (8, 16, 32)  # 4 frame pairs x 2 strips x 4 tiles of 8 columns: every block an exact 2 x 8 x 8 tile
    order = tm.tile_order(grid)
    assert ((order.hi - order.lo + 1) == torch.tensor([2, 8, 8])).all()
    win1 = tm.window_blocks(order, 1)
    assert torch.equal(win1, win1.T) and win1.diagonal().all()
    corner = int(((order.lo == 0).all(dim=1)).nonzero()[0])  # the tile at t 0, h 0, w 0
    neighbours = order.lo[win1[corner]]
    assert len(neighbours) == 2 * 2 * 2  # (t, h, w) tiles 0..1 each: the corner of the 3 x 3 x 3 window
    middle = int(((order.lo == torch.tensor([2, 8, 8])).all(dim=1)).nonzero()[0])
    assert win1[middle].sum() == 3 * 2 * 3  # t 0..2, h 0..1 (two strips), w 0..2
    assert torch.equal(tm.window_blocks(order, 0), torch.eye(order.num_blocks, dtype=torch.bool))  # overlap only
    full = tm.window_blocks(order, 8)
    assert full.all()
    with pytest.raises(ValueError, match="radius >= 0"):
        tm.window_blocks(order, -1)


@pytest.mark.parametrize(
    ("density", "nb", "keep"), [(1.0, 405, 405), (0.25, 405, 101), (0.125, 393, 49), (1e-6, 10, 1)]
)
def test_keep_count(density, nb, keep):
    assert tm.keep_count(density, nb) == keep
    assert keep == 1 or abs(keep / nb - density) <= 0.5 / nb


def test_keep_count_refuses_densities_outside_0_1():
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="density in \\(0, 1\\]"):
            tm.keep_count(bad, 10)


def test_pooled_scores_average_each_blocks_own_tokens():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 300, 3, 16, generator=g), torch.randn(2, 200, 3, 16, generator=g)
    scores = tm.pooled_scores(q, k)
    assert scores.shape == (2, 3, 3, 2)
    qm = torch.stack([q[:, i : i + 128].mean(1) for i in (0, 128, 256)], dim=2)  # the last block has 44 tokens
    km = torch.stack([k[:, i : i + 128].mean(1) for i in (0, 128)], dim=2)
    want = torch.softmax(torch.einsum("bmhd,bnhd->bhmn", qm.permute(0, 2, 1, 3), km.permute(0, 2, 1, 3)) / 4.0, dim=-1)
    torch.testing.assert_close(scores, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scores.sum(-1), torch.ones(2, 3, 3))


def test_selection_keeps_the_window_first_then_the_best_scores():
    g = torch.Generator().manual_seed(1)
    scores = torch.softmax(torch.randn(1, 2, 6, 6, generator=g), dim=-1)
    window = torch.zeros(6, 6, dtype=torch.bool)
    window[0, 5] = window[3, 0] = window[3, 1] = True
    idx, cnt = tm.select_blocks(scores, window, keep=3)
    assert idx.dtype == cnt.dtype == torch.int32 and idx.shape == (1, 2, 6, 3) and (cnt == 3).all()
    assert (idx[..., 1:] > idx[..., :-1]).all()  # ascending, no repeats
    for h in range(2):
        for i in range(6):
            kept = set(idx[0, h, i].tolist())
            assert i in kept  # a query block's own block first
            assert set(window[i].nonzero().flatten().tolist()) <= kept  # then its window
            rest = [j for j in range(6) if j != i and not window[i, j]]
            best = sorted(rest, key=lambda j: -scores[0, h, i, j].item())[: 3 - 1 - int(window[i].sum())]
            assert set(best) <= kept


def test_window_larger_than_the_budget_keeps_its_best_blocks():
    scores = torch.tensor([[[[0.1, 0.5, 0.25, 0.15]] * 4]])
    window = torch.ones(4, 4, dtype=torch.bool)
    idx, _ = tm.select_blocks(scores, window, keep=2)
    assert idx[0, 0].tolist() == [[0, 1], [1, 2], [1, 2], [1, 3]]  # own block + the best other window block


def test_density_one_keeps_every_block():
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 1000, 2, 16, generator=g), torch.randn(1, 1000, 2, 16, generator=g)
    idx, cnt = tm.build_block_mask(q, k, None, 1.0)
    assert torch.equal(idx, torch.arange(8, dtype=torch.int32).expand(1, 2, 8, 8)) and (cnt == 8).all()
    assert tm.token_mask(idx, cnt, 1000, 1000).all()


@pytest.mark.parametrize("density", [0.5, 0.25, 0.125])
def test_density_accounting_at_w1_block_counts(density):
    order = tm.tile_order(W1, W1_POSITIONS)
    window = tm.window_blocks(order, 1)
    g = torch.Generator().manual_seed(3)
    scores = torch.softmax(torch.randn(1, 2, order.num_blocks, order.num_blocks, generator=g), dim=-1)
    keep = tm.keep_count(density, order.num_blocks)
    idx, cnt = tm.select_blocks(scores, window, keep)
    mask = tm.token_mask(idx, cnt, order.num_blocks, order.num_blocks, block=1)  # one "token" per block
    assert abs(mask.float().mean().item() - density) <= 0.5 / order.num_blocks
    assert keep >= window.sum(1).max()  # at these densities the whole window fits
    assert mask[0, :, window].all()  # and is kept


def test_token_mask_marks_kept_blocks_and_skips_invalid_entries():
    idx = torch.tensor([[[[0, 2], [1, 7]]]], dtype=torch.int32)  # row 1's second entry is beyond its count
    cnt = torch.tensor([[[2, 1]]], dtype=torch.int32)
    mask = tm.token_mask(idx, cnt, m=130, n=300)
    assert mask.shape == (1, 1, 130, 300)
    assert mask[0, 0, :128, :128].all() and not mask[0, 0, :128, 128:256].any() and mask[0, 0, :128, 256:].all()
    assert not mask[0, 0, 128:, :128].any() and mask[0, 0, 128:, 128:256].all() and not mask[0, 0, 128:, 256:].any()
