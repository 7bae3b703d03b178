"""k6fast.video_decode: the decode against diffusers' own HunyuanVideo VAE decodes (CPU, fp32 unless stated).

Errors are in pixel units (0-255): |a - b| * 255 on frames in [0, 1]. The parity bar is 0.01 px, float rounding;
what the tests measured on 2 cores is stated next to each bound. Two VAEs: the tiny checkpoint's (channels
(8, 16, 16, 16), one resnet per level) and a narrow one with the real architecture (two resnets per level, three
per up block, the mid-block attention) at channels (32, 64, 64, 64). The lean whole-clip decode is checked on the
decoder's raw output (before [0, 1] clamping), relative to its largest magnitude.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from pipeline_testing import one_thread

from k6fast import video_decode as vd
from k6fast.testing.bounds import assert_within_baseline_error
from k6fast.vae import decode_video, load_video_vae
from k6fast.video_decode import decode_video_fast, plan_video_decode

PARITY_PX = 0.01
HUGE = 1 << 40  # a budget that holds any decode here


def _px(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max, mean) absolute difference in pixel units."""
    d = (a.double() - b.double()).abs() * 255
    return d.max().item(), d.mean().item()


def _max_px(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference in pixel units (of 255)."""
    return _px(a, b)[0]


@contextlib.contextmanager
def _diffusers_mode(vae, *, tiling: bool, framewise: bool, **tiles: int):
    """Set diffusers' tiling flags for one decode and restore them after."""
    saved = {k: getattr(vae, k) for k in vars(vae) if k.startswith(("use_", "tile_"))}
    vae.use_tiling, vae.use_framewise_decoding = tiling, framewise
    for key, value in tiles.items():
        setattr(vae, key, value)
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(vae, key, value)


def untiled(vae, latents: torch.Tensor) -> torch.Tensor:
    """diffusers' untiled decode: tiling off AND framewise decoding off (disable_tiling() alone keeps the latter)."""
    with _diffusers_mode(vae, tiling=False, framewise=False):
        return decode_video(vae, latents)


@torch.no_grad()
def untiled_raw(vae, latents: torch.Tensor) -> torch.Tensor:
    """diffusers' untiled decoder output [B, F, H, W, 3] as is: no [0, 1] shift, no clamping."""
    z = latents.permute(0, 4, 1, 2, 3).to(vae.dtype) / vae.config.scaling_factor
    with _diffusers_mode(vae, tiling=False, framewise=False):
        return vae.decode(z).sample.permute(0, 2, 3, 4, 1).float()


def _narrow_vae():
    from diffusers import AutoencoderKLHunyuanVideo

    torch.manual_seed(0)
    return AutoencoderKLHunyuanVideo(block_out_channels=(32, 64, 64, 64), layers_per_block=2, norm_num_groups=8).eval()


def _latents(t: int, h: int, w: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, t, h, w, 16, generator=g)


def _smooth_latents(t: int, h: int, w: int) -> torch.Tensor:
    """A low-frequency pattern: sinusoids of a few cycles per frame, drifting slowly in time."""
    tt = torch.arange(t).view(t, 1, 1, 1).float()
    yy = torch.arange(h).view(1, h, 1, 1).float()
    xx = torch.arange(w).view(1, 1, w, 1).float()
    cc = torch.arange(16).view(1, 1, 1, 16).float()
    return (torch.sin(0.35 * xx + 0.9 * cc) + torch.cos(0.3 * yy + 0.5 * cc + 0.2 * tt))[None]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # Many small convolutions per decode: on shared cores, one thread spends a third of the CPU time two do.
    with one_thread():
        yield


@pytest.fixture(scope="module")
def tiny_vae(tiny_distill):
    return load_video_vae(tiny_distill, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def narrow_vae():
    return _narrow_vae()


def _case(vae) -> tuple:
    """(vae, latents [1, 6, 6, 8, 16], untiled frames, exact frames, exact plan, whole-clip GroupNorm statistics)."""
    latents = _latents(6, 6, 8)
    ref = untiled(vae, latents)
    plan = plan_video_decode(vae, (6, 6, 8), budget_bytes=HUGE)
    frames, moments = vd.decode_with_plan(vae, latents, plan)
    return vae, latents, ref, frames, plan, moments


@pytest.fixture(scope="module")
def tiny_case(tiny_vae) -> tuple:
    return _case(tiny_vae)


@pytest.fixture(scope="module")
def narrow_case(narrow_vae) -> tuple:
    return _case(narrow_vae)


@pytest.fixture(params=["tiny", "narrow"])
def case(request) -> tuple:
    return request.getfixturevalue(f"{request.param}_case")


# ---------------------------------------------------------------------------------------------------------------
# What is exact
# ---------------------------------------------------------------------------------------------------------------


def test_whole_decode_matches_diffusers_untiled_within_0_01_px(case) -> None:
    # Measured: 0.0009 px (narrow), 0.0007 px (tiny).
    vae, latents, ref, frames, plan, _ = case
    assert plan.exact and plan.split == plan.num_ops
    assert frames.shape == ref.shape == (1, 21, 48, 64, 3) and frames.dtype == torch.float32
    err, _ = _px(frames, ref)
    assert err < PARITY_PX, f"exact decode differs from diffusers' untiled decode by {err:.4f} px"
    public = decode_video_fast(vae, latents, budget_bytes=HUGE)
    assert torch.equal(public, frames)


@pytest.mark.parametrize("chunk", [1, 2, 3, 4])  # 4 does not divide the 6 latent frames
def test_chunked_decode_with_whole_clip_statistics_matches_untiled_within_0_01_px(case, chunk: int) -> None:
    # The streaming machinery alone (carried frames, first-frame upsampling, replicate padding) is exact: given the
    # whole-clip GroupNorm statistics, every slab size reproduces the untiled decode. Measured: <= 0.0009 px.
    vae, latents, ref, _, _, moments = case
    plan = plan_video_decode(vae, (6, 6, 8), budget_bytes=HUGE, chunk_latent_frames=chunk)
    assert plan.slab_latent_frames == chunk and plan.split < plan.num_ops and not plan.exact
    frames, _ = vd.decode_with_plan(vae, latents, plan, frozen=moments)
    err, _ = _px(frames, ref)
    assert err < PARITY_PX, f"slabs of {chunk} with whole-clip statistics: {err:.4f} px from untiled"


@pytest.fixture(scope="module")
def smooth_case(narrow_vae) -> tuple:
    """(latents [1, 2, 12, 16, 16] of a smooth pattern, untiled frames, whole-clip GroupNorm statistics)."""
    latents = _smooth_latents(2, 12, 16) * narrow_vae.config.scaling_factor
    _, moments = vd.decode_with_plan(narrow_vae, latents, plan_video_decode(narrow_vae, (2, 12, 16), budget_bytes=HUGE))
    return latents, untiled(narrow_vae, latents), moments


def test_spatial_tiles_with_whole_clip_statistics_match_untiled_within_0_01_px(narrow_vae, smooth_case) -> None:
    # Tiles x slabs, blended across the middle of their overlaps, are exact under whole-clip statistics.
    # Measured: 0.0010 px.
    latents, ref, moments = smooth_case
    plan = plan_video_decode(narrow_vae, (2, 12, 16), budget_bytes=HUGE, split=16, min_grid=2, chunk_latent_frames=1)
    assert len(plan.tiles) == 4
    frames, _ = vd.decode_with_plan(narrow_vae, latents, plan, frozen=moments)
    err, _ = _px(frames, ref)
    assert err < PARITY_PX, f"2x2 tiles x 2 slabs with whole-clip statistics: {err:.4f} px from untiled"


def test_decoding_a_prefix_is_not_the_prefix_of_the_decode(narrow_case) -> None:
    # Why streaming cannot be exact by itself: every GroupNorm normalises over the whole clip, so the first 3 latent
    # frames decoded alone give other pixels than the first 9 frames of the whole decode. Measured: 25.7 px.
    narrow_vae, latents, whole = narrow_case[:3]
    prefix = untiled(narrow_vae, latents[:, :3])
    err, _ = _px(prefix, whole[:, :9])
    assert err > 1.0


@pytest.mark.parametrize("mode", ["stored", "recomputed"])
@pytest.mark.parametrize("latent_frames", [1, 2, 5])
def test_lean_whole_clip_decode_matches_untiled_within_1e_5_relative(narrow_vae, latent_frames, mode) -> None:
    # Every upsampler fused with the resnet after it (up.2 → up.3.resnets.0 crosses the 64 → 32 shortcut, the others
    # an identity one), in chunks of 1, 2 and 3 frames: chunk boundaries inside the fused convolutions' history, and
    # the clip's first frame. Measured: <= 3.9e-6 of the output's largest magnitude.
    latents = _latents(latent_frames, 3, 4, seed=10 + latent_frames)
    ref = untiled_raw(narrow_vae, latents)
    plan = plan_video_decode(narrow_vae, (latent_frames, 3, 4), budget_bytes=HUGE, upsample_fusion=mode)
    assert plan.exact and plan.mode == "whole-clip lean", plan.describe()
    assert [f.upsampler for f in plan.fusions] == [f"up.{b}.upsamplers.0" for b in range(3)]
    assert all(f.recompute_shortcut == (mode == "recomputed") for f in plan.fusions)
    norms = sum(isinstance(m, torch.nn.GroupNorm) for m in narrow_vae.decoder.modules())
    for chunk in (1, 2, 3):
        frames, moments = vd.decode_with_plan(narrow_vae, latents, plan, max_chunk_frames=chunk, raw=True)
        assert frames.shape == ref.shape == (1, 4 * latent_frames - 3, 24, 32, 3)
        rel = ((frames - ref).abs().max() / ref.abs().max()).item()
        assert rel < 1e-5, f"{mode}, chunks of {chunk}: {rel:.2e} of the largest magnitude from untiled"
        assert len(moments) == norms  # whole-clip statistics of every GroupNorm, the fused ones' included


# ---------------------------------------------------------------------------------------------------------------
# What streaming costs: running GroupNorm statistics
# ---------------------------------------------------------------------------------------------------------------


def test_streamed_decode_is_closer_to_untiled_than_diffusers_tiled(narrow_case) -> None:
    # Running statistics (what a budget-bound decode uses) vs diffusers' framewise decode (17-frame tiles, on by
    # default). Measured on this random-weight VAE: streamed from the last upsampler, slabs of 1: max 14.9 px,
    # mean 1.49 px; streamed from right after the mid block: mean 3.5 px; diffusers framewise: max 255 px, mean
    # 11.2 px. Random weights exaggerate both; a trained VAE sees smoother statistics.
    narrow_vae, latents, ref = narrow_case[:3]
    with _diffusers_mode(narrow_vae, tiling=False, framewise=True):
        tiled = decode_video(narrow_vae, latents)
    _, tiled_mean = _px(tiled, ref)
    late = plan_video_decode(narrow_vae, (6, 6, 8), budget_bytes=HUGE, split=15, chunk_latent_frames=1)
    early = plan_video_decode(narrow_vae, (6, 6, 8), budget_bytes=HUGE, chunk_latent_frames=1)
    late_max, late_mean = _px(vd.decode_with_plan(narrow_vae, latents, late)[0], ref)
    _, early_mean = _px(vd.decode_with_plan(narrow_vae, latents, early)[0], ref)
    assert late_mean < early_mean < tiled_mean, (late_mean, early_mean, tiled_mean)
    assert late_mean < 3.0 and late_max < 40.0, (late_max, late_mean)


def test_matches_diffusers_tiled_decode_as_closely_as_untiled_does(tiny_vae) -> None:
    # diffusers tiles in space (64 px tiles, 48 px stride) and time; the exact decode is the untiled one, so its
    # distance to the tiled decode is the untiled decode's, plus rounding. Measured: 251.5 px max, 22.1 px mean, both.
    latents = _latents(6, 10, 12, seed=2)
    ref = untiled(tiny_vae, latents)
    settings = {"tile_sample_min_height": 64, "tile_sample_min_width": 64}
    settings |= {"tile_sample_stride_height": 48, "tile_sample_stride_width": 48}
    with _diffusers_mode(tiny_vae, tiling=True, framewise=True, **settings):
        tiled = decode_video(tiny_vae, latents)
    frames = decode_video_fast(tiny_vae, latents, budget_bytes=HUGE)
    fast_max, fast_mean = _px(frames, tiled)
    ref_max, ref_mean = _px(ref, tiled)
    assert ref_max > 1.0  # diffusers did tile here
    assert abs(fast_max - ref_max) < PARITY_PX and abs(fast_mean - ref_mean) < PARITY_PX


def test_no_visible_seams_at_tile_boundaries(narrow_vae, smooth_case) -> None:
    # Tiles stream with their own running statistics, so their pixels differ from the untiled decode everywhere;
    # a seam would show as a step in that error where tiles meet. On a smooth latent, the error's largest step
    # between neighbouring pixels inside the blended overlaps stays below its largest step elsewhere.
    # Measured: 30.5 px in the overlaps vs 44.6 px elsewhere across columns, 20.1 vs 32.7 across rows (the error
    # itself: 11.8 px mean, 96.6 px max; diffusers' 64 px tiles here: 27 px mean, 184 px max).
    latents, ref, _ = smooth_case
    plan = plan_video_decode(narrow_vae, (2, 12, 16), budget_bytes=HUGE, split=15, min_grid=2)
    frames, _ = vd.decode_with_plan(narrow_vae, latents, plan)
    err = (frames.double() - ref.double()) * 255  # [1, F, H, W, 3]
    ratio = 8 // plan.segment_scale
    rows = sorted({(r0 * ratio, r1 * ratio) for r0, r1, _, _ in plan.tiles})
    cols = sorted({(c0 * ratio, c1 * ratio) for _, _, c0, c1 in plan.tiles})
    assert len(rows) == len(cols) == 2
    for dim, (first, second) in ((3, cols), (2, rows)):
        step = err.diff(dim=dim).abs()
        band = torch.zeros(step.shape[dim], dtype=torch.bool)
        band[second[0] : first[1]] = True
        seam = step.index_select(dim, band.nonzero()[:, 0]).max().item()
        rest = step.index_select(dim, (~band).nonzero()[:, 0]).max().item()
        assert seam <= rest, f"largest step of the error across dim {dim}: {seam:.1f} px at seams, {rest:.1f} elsewhere"


# ---------------------------------------------------------------------------------------------------------------
# Precision, batch, layout, API
# ---------------------------------------------------------------------------------------------------------------


def test_bf16_error_at_most_twice_diffusers_bf16(tiny_vae) -> None:
    # flash-attention's rule: err(fast bf16) <= 2 * err(diffusers bf16) + rounding floor, both against fp32 untiled.
    # Measured: fast 8.59 px, diffusers 8.61 px max (0.60 / 0.64 px mean).
    latents = _latents(3, 6, 8, seed=3)
    exact = untiled(tiny_vae, latents)
    tiny_vae.to(torch.bfloat16)
    try:
        ours = decode_video_fast(tiny_vae, latents, budget_bytes=HUGE)
        theirs = untiled(tiny_vae, latents)
    finally:
        tiny_vae.to(torch.float32)
    # Half a pixel level of rounding floor.
    assert_within_baseline_error(ours, theirs, exact, metric=_max_px, atol=0.5, what="decode_video_fast in bf16")


def test_batch_is_decoded_per_sample(tiny_vae) -> None:
    latents = _latents(3, 4, 6, seed=4, batch=2)
    both = decode_video_fast(tiny_vae, latents, budget_bytes=HUGE)
    for i in range(2):
        one = decode_video_fast(tiny_vae, latents[i : i + 1], budget_bytes=HUGE)
        assert _px(both[i : i + 1], one)[0] < PARITY_PX


def test_channels_last_layout_is_the_same_decode(tiny_vae) -> None:
    latents = _latents(4, 4, 6, seed=5)
    ref = untiled(tiny_vae, latents)
    frames = decode_video_fast(tiny_vae, latents, budget_bytes=HUGE, chunk_latent_frames=2, layout="ndhwc")
    plain = decode_video_fast(tiny_vae, latents, budget_bytes=HUGE, chunk_latent_frames=2)
    assert _px(frames, plain)[0] < PARITY_PX
    assert _px(decode_video_fast(tiny_vae, latents, budget_bytes=HUGE, layout="ndhwc"), ref)[0] < PARITY_PX


def test_invalid_arguments_say_what_was_expected(tiny_vae) -> None:
    latents = _latents(3, 4, 6)
    with pytest.raises(ValueError, match="layout must be one of ncdhw, ndhwc, found 'nhwc'"):
        decode_video_fast(tiny_vae, latents, budget_bytes=HUGE, layout="nhwc")
    with pytest.raises(ValueError, match=r"expected latents \[B, T, H, W, 16\], found \(1, 3, 4, 6, 8\)"):
        decode_video_fast(tiny_vae, latents[..., :8], budget_bytes=HUGE)
    with pytest.raises(ValueError, match="chunk_latent_frames must be >= 1 or None, found 0"):
        decode_video_fast(tiny_vae, latents, budget_bytes=HUGE, chunk_latent_frames=0)
    with pytest.raises(ValueError, match="does not fit a budget of 0.00 GiB"):
        decode_video_fast(tiny_vae, latents, budget_bytes=1 << 20)
    with pytest.raises(ValueError, match="upsample_fusion must be one of auto, off, stored, recomputed, found 'on'"):
        decode_video_fast(tiny_vae, latents, budget_bytes=HUGE, upsample_fusion="on")


# ---------------------------------------------------------------------------------------------------------------
# The plan at real sizes (the real architecture on the meta device: no weights, no memory)
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_vae():
    from diffusers import AutoencoderKLHunyuanVideo

    with torch.device("meta"):
        vae = AutoencoderKLHunyuanVideo()
    return vae.to(dtype=torch.bfloat16).eval()


W1 = (31, 60, 108)


@pytest.mark.parametrize(
    ("budget_gib", "mode", "tiles"),
    [
        (64, "whole-clip", 1),
        (48, "whole-clip", 1),
        (32, "whole-clip lean", 1),
        (28, "whole-clip lean", 1),
        (24, "streamed", 1),
        (8, "streamed", 1),
        (4, "streamed", 4),
    ],
)
def test_w1_plan_fits_the_budget(real_vae, budget_gib: int, mode: str, tiles: int) -> None:
    budget = budget_gib << 30
    plan = plan_video_decode(real_vae, W1, budget_bytes=budget)
    exact = mode != "streamed"
    assert plan.mode == mode and plan.exact == exact and len(plan.tiles) == tiles, plan.describe()
    assert plan.describe().startswith(mode) and plan.estimated_peak_bytes <= budget
    if not exact:
        # The mid block and the up blocks at the latent's frame count always see the whole clip.
        names = [op.name for op in vd.decoder_ops(real_vae)]
        assert plan.split >= names.index("up.1.upsamplers.0"), names[plan.split]


def test_w1_lean_whole_clip_decode_fits_32_gib(real_vae) -> None:
    # W1 in bf16: the plain whole-clip decode peaks at the 256 → 128 resnet after the last upsampler (its 25.7 GB
    # input next to its output): 36.9 GiB of activations, 41.3 GiB planned. Fused with that upsampler, with its
    # shortcut stored: 28.3 GiB, 31.4 GiB planned; recomputed: 24.9 GiB (the next resnet's), 27.7 GiB at 28 GiB.
    ops, elt, workspace = vd.decoder_ops(real_vae), 2, 1 << 30
    geoms = vd.decoder_geometry(ops, *W1)
    up = [op.name for op in ops].index("up.2.upsamplers.0")
    plain, at = vd.whole_clip_peak(ops, geoms, {}, elt, workspace)
    stored, _ = vd.whole_clip_peak(ops, geoms, {up: False}, elt, workspace)
    recomputed, _ = vd.whole_clip_peak(ops, geoms, {up: True}, elt, workspace)
    assert ops[at].name == "up.3.resnets.0" and recomputed < stored < 30 << 30 < plain
    plan = plan_video_decode(real_vae, W1, budget_bytes=32 << 30)
    assert plan.exact and plan.fusions == (vd.UpsampleFusion("up.2.upsamplers.0", "up.3.resnets.0", False),)
    plain_plan = plan_video_decode(real_vae, W1, budget_bytes=48 << 30)
    assert plain_plan.mode == "whole-clip" and plan.estimated_peak_bytes <= 32 << 30
    assert plan.estimated_peak_bytes < plain_plan.estimated_peak_bytes - (8 << 30)
    assert plan_video_decode(real_vae, W1, budget_bytes=32 << 30, upsample_fusion="off").mode == "streamed"
    tight = plan_video_decode(real_vae, W1, budget_bytes=28 << 30)
    assert tight.exact and [f.recompute_shortcut for f in tight.fusions] == [True]


def test_w1_plan_prefers_whole_clip_statistics_to_large_slabs(real_vae) -> None:
    # 8 GiB: the mid block and the first two up blocks decode whole (17 of 30 GroupNorms see the whole clip); the
    # last two up blocks stream in slabs of one latent frame over the full 864x480 frame, with no spatial tiles.
    plan = plan_video_decode(real_vae, W1, budget_bytes=8 << 30)
    assert (plan.slab_latent_frames, plan.tiles) == (1, ((0, 120, 0, 216),))
    assert plan.segment_scale == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("timed", [False, True])
def test_gpu_the_decode_runs_under_the_process_cudnn_choice(tiny_distill, monkeypatch, timed: bool) -> None:
    # The process owns cuDNN's algorithm timing (`torch.backends.cudnn.benchmark`); the decode neither sets nor
    # resets it, not even for the length of the decode (another thread's convolutions would see it).
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", timed)
    seen: list[bool] = []
    vae = load_video_vae(tiny_distill, torch.device("cuda"), torch.bfloat16)
    frames = decode_video_fast(
        vae,
        _latents(3, 4, 6).cuda(),
        budget_bytes=HUGE,
        layout="ndhwc",
        on_frames=lambda f0, f1, x: seen.append(torch.backends.cudnn.benchmark),
    )
    assert frames.is_cuda and seen and set(seen) == {timed}
    assert torch.backends.cudnn.benchmark is timed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_decodes_within_twice_diffusers_bf16_error(monkeypatch) -> None:
    # Exact plans in every layout/kernel combination, the lean ones (fused upsamplers) too, and slabs of 2 with
    # whole-clip statistics, against the fp32 untiled decode: each within 2x the error of diffusers' own bf16
    # untiled decode + 0.5 px. Under cuDNN's timed algorithms too, which a caller's process may set.
    from diffusers import AutoencoderKLHunyuanVideo

    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo(block_out_channels=(64, 128, 128, 128)).to("cuda").eval()
    latents = _latents(5, 16, 24, seed=6).cuda()
    exact = untiled(vae, latents)
    vae.to(torch.bfloat16)
    theirs = untiled(vae, latents)
    for layout in vd.LAYOUTS:
        for triton_norm in (False, True):
            options = {"layout": layout, "triton_norm": triton_norm}
            ours = decode_video_fast(vae, latents, budget_bytes=8 << 30, **options)
            assert_within_baseline_error(ours, theirs, exact, metric=_max_px, atol=0.5, what=str(options))
    for fusion in ("stored", "recomputed"):
        options = {"layout": "ndhwc", "triton_norm": True, "upsample_fusion": fusion}
        ours = decode_video_fast(vae, latents, budget_bytes=8 << 30, **options)
        assert_within_baseline_error(ours, theirs, exact, metric=_max_px, atol=0.5, what=str(options))
    _, moments = vd.decode_with_plan(vae, latents, plan_video_decode(vae, (5, 16, 24), budget_bytes=8 << 30))
    plan = plan_video_decode(vae, (5, 16, 24), budget_bytes=8 << 30, chunk_latent_frames=2)
    streamed, _ = vd.decode_with_plan(vae, latents, plan, layout="ndhwc", triton_norm=True, frozen=moments)
    assert_within_baseline_error(streamed, theirs, exact, metric=_max_px, atol=0.5, what="slabs of 2, frozen")
