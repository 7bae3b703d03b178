"""`exact_decode_fits`, the cheap answer to "is this clip's decode exact within this budget" that `Pipeline.fits` (and
so every fit table) asks, must say what `plan_video_decode(...).exact` says, everywhere: checked over clip sizes on
the 16-pixel grid, 4k+1 frame counts and budgets on both sides of where the whole-clip decode stops fitting, plainly
and fused. `planned_ops`, the planner's op list kept per VAE, must be `decoder_ops`'s list, rebuilt when the decoder
changes and gone with its VAE.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from k6fast.vae import load_video_vae
from k6fast.vae_geometry import latent_frames, latent_size
from k6fast.video_decode import decoder_ops, plan_video_decode
from k6fast.video_decode.plan import exact_decode_fits, planned_ops

HUGE = 1 << 50  # holds the whole-clip decode of any clip here


def _narrow_vae(device: str = "cpu"):
    from diffusers import AutoencoderKLHunyuanVideo

    torch.manual_seed(0)
    with torch.device(device):
        return AutoencoderKLHunyuanVideo(block_out_channels=(32, 64, 64, 64), layers_per_block=2, norm_num_groups=8)


@pytest.fixture(scope="module")
def vaes(tiny_distill) -> dict:
    from diffusers import AutoencoderKLHunyuanVideo

    with torch.device("meta"):
        real = AutoencoderKLHunyuanVideo()  # K6's own decoder widths: arithmetic only, no weights
    return {
        "tiny": (load_video_vae(tiny_distill, torch.device("cpu"), torch.float32), torch.float32),
        "narrow": (_narrow_vae().eval(), None),  # the planner reads the VAE's own dtype
        "real": (real.to(dtype=torch.bfloat16).eval(), torch.bfloat16),
    }


def _planned_exact(vae, shape, budget: int, dtype) -> tuple[bool, str]:
    """(plan_video_decode(...).exact, its mode), False and "none" where no decode fits."""
    try:
        plan = plan_video_decode(vae, shape, budget_bytes=budget, dtype=dtype)
    except ValueError:
        return False, "none"
    return plan.exact, plan.mode


def _boundary(fits) -> int:
    """The least budget at which `fits` holds, by bisection between 0 (nothing fits) and HUGE."""
    low, high = 0, HUGE
    assert not fits(low) and fits(high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid) else (mid, high)
    return high


def _budgets(boundary: int) -> list[int]:
    """Budgets on both sides of a boundary: a byte either side, then a few percent, then a factor of two."""
    near = [boundary + d for d in (-1, 0, 1)]
    return near + [int(boundary * f) for f in (0.5, 0.97, 0.999, 1.001, 1.03, 2.0)]


# Pixel geometries: the smallest clip (one frame of 16 x 16), sizes on the 16-pixel grid that are not powers of two
# or multiples of 32, 4k+1 frame counts that give odd and even latent frame counts, and K6's own sizes.
SMALL = [(16, 16, 1), (16, 48, 5), (48, 16, 9), (80, 112, 13), (144, 80, 17), (256, 256, 33)]
LARGE = [(272, 480, 49), (640, 640, 97), (1280, 720, 121), (848, 480, 241)]


@pytest.mark.parametrize("name", ["tiny", "narrow", "real"])
def test_exact_decode_fits_is_the_plans_exact_at_every_budget(vaes, name: str) -> None:
    vae, dtype = vaes[name]
    modes = set()
    for width, height, frames in SMALL + (LARGE if name == "real" else []):
        shape = (latent_frames(frames), *latent_size(height, width))
        exact = _boundary(lambda b, shape=shape: exact_decode_fits(vae, shape, budget_bytes=b, dtype=dtype))

        def plain_fits(budget: int, shape=shape) -> bool:
            # Without fusion the plan is exact only as the plain whole-clip decode (one slab and one tile would also
            # store the split's input): its boundary is the plain decode's.
            try:
                return plan_video_decode(vae, shape, budget_bytes=budget, dtype=dtype, upsample_fusion="off").exact
            except ValueError:  # no decode fits at all
                return False

        plain = _boundary(plain_fits)  # where "auto" stops fusing: the plain whole-clip decode fits from here
        assert exact <= plain, (shape, exact, plain)
        for budget in sorted(set(_budgets(exact) + _budgets(plain))):
            planned, mode = _planned_exact(vae, shape, budget, dtype)
            modes.add(mode)
            assert exact_decode_fits(vae, shape, budget_bytes=budget, dtype=dtype) == planned, (shape, budget, mode)
            assert planned == (budget >= exact), (shape, budget, exact)
    # The sweep crosses from streamed (or nothing) to the whole-clip decode; the K6 decoder's also through the lean one.
    assert {"whole-clip", "streamed"} <= modes, modes
    if name == "real":
        assert "whole-clip lean" in modes


def test_exact_decode_fits_refuses_what_the_plan_refuses(vaes) -> None:
    vae, dtype = vaes["narrow"]
    for shape in ((0, 2, 2), (1, 0, 2), (1, 2, -1)):
        with pytest.raises(ValueError, match="positive sizes"):
            plan_video_decode(vae, shape, budget_bytes=HUGE, dtype=dtype)
        with pytest.raises(ValueError, match="positive sizes"):
            exact_decode_fits(vae, shape, budget_bytes=HUGE, dtype=dtype)
    with pytest.raises(ValueError, match="AutoencoderKLHunyuanVideo"):
        exact_decode_fits(torch.nn.Linear(2, 2), (1, 2, 2), budget_bytes=HUGE)


def test_the_planned_op_list_is_a_fresh_build_kept_per_vae(vaes) -> None:
    for vae, _ in vaes.values():
        ops = planned_ops(vae)
        assert ops == decoder_ops(vae) and [op.name for op in ops] == [op.name for op in decoder_ops(vae)]
        assert planned_ops(vae) is ops, "built once per VAE"
    tiny, _ = vaes["tiny"]
    assert planned_ops(tiny) != planned_ops(vaes["narrow"][0])  # other modules, other widths


def test_the_planned_op_list_follows_the_decoder() -> None:
    vae, other = _narrow_vae("meta").eval(), _narrow_vae("meta").eval()
    before = planned_ops(vae)
    assert before[-1].module is vae.decoder
    vae.decoder = other.decoder  # a new decoder object: a new list, that decoder's
    after = planned_ops(vae)
    assert after is not before and after == decoder_ops(vae) and after[-1].module is other.decoder
    vae.train()  # refused as decoder_ops refuses it, cached or not
    with pytest.raises(ValueError, match="training mode"):
        planned_ops(vae)
    vae.eval()
    assert planned_ops(vae) == decoder_ops(vae)


def test_the_planned_op_lists_go_with_their_vaes() -> None:
    gc.collect()
    refs = []
    for _ in range(3):
        vae = _narrow_vae("meta").eval()
        planned_ops(vae)
        refs.append(weakref.ref(vae))
        del vae
    gc.collect()
    assert all(ref() is None for ref in refs), "the cache must not keep a VAE alive"
