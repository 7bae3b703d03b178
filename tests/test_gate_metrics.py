"""The gate's metrics on synthetic clips: LPIPS per frame (identical → 0, more noise → more distance, the worst
frame is where the damage is), the AlexNet backbone file handling, the audio distances (same three properties,
plus the calibration the default audio limits rest on), thresholds and set aggregation.

LPIPS runs with the seeded random backbone (no weights are downloaded in tests); the properties checked hold for
any backbone. CPU time: about 10 s, most of it importing torchvision and lpips once.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from k6fast.media import read_mp4, write_mp4
from k6fast.quality_gate import GateError
from k6fast.quality_gate.audio_metric import score_audio
from k6fast.quality_gate.lpips_metric import ALEXNET_FILE, RANDOM, RANDOM_LABEL, LpipsScorer
from k6fast.quality_gate.scoring import ArmResult, ClipScore, aggregate, judge
from k6fast.quality_gate.thresholds import Thresholds

SR = 44100
F, H, W = 9, 64, 64


@pytest.fixture(scope="module")
def scorer() -> LpipsScorer:
    return LpipsScorer(RANDOM, device="cpu")


def _video(seed: int = 0) -> np.ndarray:
    """uint8 [F, H, W, 3]: gradients plus texture that drift from frame to frame."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:H, 0:W]
    texture = rng.integers(0, 40, (H, W))
    out = np.empty((F, H, W, 3), np.uint8)
    for i in range(F):
        out[i, ..., 0] = (x * 3 + 5 * i + texture) % 256
        out[i, ..., 1] = (y * 3 + texture) % 256
        out[i, ..., 2] = ((x + y) * 2 + 9 * i) % 256
    return out


def _noisy(frames: np.ndarray, sigma: float, seed: int = 1) -> np.ndarray:
    noise = np.random.default_rng(seed).normal(0.0, sigma, frames.shape)
    return np.clip(frames + noise, 0, 255).astype(np.uint8)


def test_lpips_identical_frames_score_exactly_zero(scorer: LpipsScorer) -> None:
    clip = _video()
    scores = scorer.frames(clip, clip.copy())
    assert scores.shape == (F,) and scores.dtype == np.float64
    assert np.all(scores == 0.0)
    assert scorer.label == RANDOM_LABEL and scorer.random and scorer.sha256 is None


def test_lpips_grows_with_noise(scorer: LpipsScorer) -> None:
    clip = _video()
    means = [scorer.frames(clip, _noisy(clip, sigma)).mean() for sigma in (2.0, 6.0, 15.0, 40.0)]
    assert means[0] > 0.0
    assert all(a < b for a, b in zip(means, means[1:], strict=False)), means


def test_lpips_worst_frame_is_where_the_damage_is(scorer: LpipsScorer) -> None:
    clip = _video()
    damaged = _noisy(clip, 3.0)
    damaged[6, 16:48, 16:48] = 255 - damaged[6, 16:48, 16:48]  # an inverted square on frame 6 only
    scores = scorer.frames(clip, damaged)
    assert int(np.argmax(scores)) == 6
    assert scores[6] > 3 * np.delete(scores, 6).max()


def test_lpips_is_reproducible_and_independent_of_global_rng() -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = LpipsScorer(RANDOM, device="cpu")
    after = torch.rand(1)
    b = LpipsScorer(RANDOM, device="cpu")
    assert torch.equal(before, after)  # building the scorer left the caller's random stream alone
    clip = _video()
    noisy = _noisy(clip, 10.0)
    assert np.array_equal(a.frames(clip, noisy), b.frames(clip, noisy))


def test_lpips_rejects_mismatched_or_tiny_clips(scorer: LpipsScorer) -> None:
    clip = _video()
    with pytest.raises(GateError, match=r"same shape.*\[9, 64, 64, 3\] and \[8, 64, 64, 3\]"):
        scorer.frames(clip, clip[:8])
    with pytest.raises(GateError, match="at least 32x32, found 16x16"):
        scorer.frames(clip[:, :16, :16], clip[:, :16, :16])
    with pytest.raises(GateError, match="uint8"):
        scorer.frames(clip.astype(np.float32), clip)


def test_backbone_missing_says_how_to_provide_it(tmp_path: Path) -> None:
    missing = tmp_path / ALEXNET_FILE
    with pytest.raises(GateError) as info:
        LpipsScorer(missing, device="cpu")
    message = str(info.value)
    assert str(missing) in message and "--lpips-backbone PATH" in message and "IMAGENET1K_V1" in message


def test_backbone_file_in_torchvision_layout_is_loaded(tmp_path: Path, scorer: LpipsScorer) -> None:
    import torchvision

    torch.manual_seed(5)
    state = torchvision.models.alexnet().state_dict()  # same layout as alexnet-owt-7be5be79.pth
    path = tmp_path / "alexnet.pth"
    torch.save(state, path)
    loaded = LpipsScorer(path, device="cpu")
    trunk = loaded.model.net.state_dict()
    assert torch.equal(trunk["slice5.10.weight"], state["features.10.weight"])
    assert torch.equal(trunk["slice1.0.bias"], state["features.0.bias"])
    assert not loaded.random and "not torchvision's" in loaded.label and loaded.sha256[:16] in loaded.label
    clip = _video()
    noisy = _noisy(clip, 10.0)
    assert not np.array_equal(loaded.frames(clip, noisy), scorer.frames(clip, noisy))

    del state["features.6.weight"]
    state["features.3.bias"] = torch.zeros(7)
    torch.save(state, path)
    with pytest.raises(GateError, match=r"features\.3\.bias has shape \[7\], expected \[192\]; features\.6\.weight"):
        LpipsScorer(path, device="cpu")


def _scene(seed: int, f0: float = 440.0, seconds: float = 3.0) -> np.ndarray:
    """A synthetic sound scene at 44.1 kHz peaking at 0.98: a harmonic tone with vibrato, band-limited noise and
    decaying clicks. `seed` draws the noise and the clicks (another draw = another take of the same scene)."""
    rng = np.random.default_rng(seed)
    n = int(SR * seconds)
    t = np.arange(n) / SR
    phase = 2 * np.pi * np.cumsum(f0 * (1 + 0.01 * np.sin(2 * np.pi * 5 * t))) / SR
    tone = sum(0.3 / k * np.sin(k * phase) for k in range(1, 8))
    brown = np.cumsum(rng.standard_normal(n))
    brown -= np.convolve(brown, np.ones(441) / 441, "same")
    clicks = np.zeros(n)
    for start in rng.integers(0, n - 2000, 6):
        clicks[start : start + 2000] += 0.5 * rng.standard_normal(2000) * np.exp(-np.arange(2000) / 300)
    x = tone + 0.15 * brown / np.abs(brown).max() + clicks
    return (0.98 * x / np.abs(x).max()).astype(np.float32)


def _aac_round_trip(wave: np.ndarray, tmp_path: Path) -> np.ndarray:
    path = tmp_path / "audio.mp4"
    frames = round(len(wave) / SR * 24)
    write_mp4(path, np.zeros((frames, 32, 32, 3), np.uint8), 24.0, wave, SR)
    return read_mp4(path)[1][: len(wave)]


def test_audio_identical_is_exactly_zero() -> None:
    wave = _scene(1)
    score = score_audio(wave, wave.copy(), SR)
    assert score.identical
    assert (score.log_mel_db, score.log_mel_worst_db, score.mrstft) == (0.0, 0.0, 0.0)
    assert (score.spectral_convergence, score.log_magnitude) == (0.0, 0.0)


def test_audio_distances_grow_with_noise() -> None:
    wave = _scene(1)
    noise = np.random.default_rng(2).standard_normal(wave.size)
    scores = [score_audio(wave, (wave + 10 ** (db / 20) * noise).astype(np.float32), SR) for db in (-60, -40, -20)]
    for field in ("log_mel_db", "log_mel_worst_db", "mrstft", "spectral_convergence", "log_magnitude"):
        values = [getattr(s, field) for s in scores]
        assert 0.0 < values[0] < values[1] < values[2], (field, values)
    assert not any(s.identical for s in scores)


def test_audio_worst_window_is_where_the_dropout_is() -> None:
    wave = _scene(1)
    damaged = wave.copy()
    damaged[int(1.8 * SR) : int(1.9 * SR)] = 0.0  # 100 ms of silence starting at 1.8 s
    score = score_audio(wave, damaged, SR)
    assert 1.8 - 0.25 <= score.log_mel_worst_at_s <= 1.8 + 0.1
    assert score.log_mel_worst_db > 5 * score.log_mel_db


def test_audio_is_symmetric_in_level_floor_and_rejects_mismatched_lengths() -> None:
    wave = _scene(1)
    silent = np.zeros_like(wave)
    assert score_audio(silent, silent, SR).log_mel_db == 0.0  # silence against silence: nothing to hear
    assert score_audio(wave, silent, SR).log_mel_db == pytest.approx(score_audio(silent, wave, SR).log_mel_db)
    with pytest.raises(GateError, match="equal length.*132300 reference and 132299 test"):
        score_audio(wave, wave[:-1], SR)


def test_default_audio_limits_separate_codec_from_another_take(tmp_path: Path) -> None:
    """The calibration in scoring.py's docstring: what a codec pass or a 1 dB gain change costs passes the default
    limits; another take of the same scene, and a 100 ms dropout, fail them."""
    limits = Thresholds()

    def passes(reference: np.ndarray, test: np.ndarray) -> bool:
        s = score_audio(reference, test, SR)
        return (
            s.log_mel_db <= limits.log_mel_db
            and s.log_mel_worst_db <= limits.log_mel_worst_db
            and s.mrstft <= limits.mrstft
        )

    wave = _scene(1)
    dropout = wave.copy()
    dropout[SR : SR + SR // 10] = 0.0
    assert passes(wave, _aac_round_trip(wave, tmp_path))
    assert passes(wave, (wave * 10 ** (-1 / 20)).astype(np.float32))
    assert not passes(wave, _scene(2))
    assert not passes(wave, _scene(2, f0=523.0))
    assert not passes(wave, dropout)


def _clip(prompt: str, lpips: list[float], mel: float, mel_worst: float = 0.0, identical: bool = False) -> ClipScore:
    from k6fast.quality_gate.audio_metric import AudioScore

    audio = AudioScore(mel, mel_worst, 0.5, mel / 10, mel / 20, mel / 20, identical)
    return ClipScore(prompt, 42, np.array(lpips), identical, audio)


def test_set_aggregates_mean_of_means_and_worst_anywhere() -> None:
    clips = [_clip("a", [0.1, 0.1, 0.1, 0.1], 1.0, 2.0), _clip("b", [0.0, 0.3], 3.0, 9.0)]
    agg = aggregate(clips)
    assert agg["lpips_mean"] == pytest.approx((0.1 + 0.15) / 2)  # not the mean over all 6 frames (0.1167)
    assert agg["lpips_worst"] == pytest.approx(0.3)
    assert agg["lpips_worst_at"] == {"prompt": "b", "seed": 42, "frame": 1}
    assert agg["log_mel_db"] == pytest.approx(2.0) and agg["log_mel_worst_db"] == pytest.approx(9.0)


def test_judge_absolute_relative_and_exact() -> None:
    clips = [_clip("a", [0.03, 0.05], 1.0, 2.0)]
    result = ArmResult("x", "x.env", "h", {}, [], exact=False, shares_reference=False, clips=clips)
    assert all(c.passed for c in judge(result, Thresholds(), None))
    failed = [c.metric for c in judge(result, Thresholds(lpips_mean=0.01, log_mel_worst_db=1.0), None) if not c.passed]
    assert failed == ["lpips_mean", "log_mel_worst_db"]

    floor = aggregate([_clip("a", [0.01, 0.01], 0.4, 1.0)])
    relative = {c.metric: c for c in judge(result, Thresholds(relative=2.0), floor)}
    assert relative["lpips_mean"].limit == pytest.approx(0.01 * 2 + 0.01)
    assert not relative["lpips_mean"].passed and not relative["lpips_worst"].passed
    assert relative["log_mel_db"].passed  # 1.0 <= 0.4 * 2 + 0.5
    with pytest.raises(GateError, match="--floor"):
        judge(result, Thresholds(relative=2.0), None)

    result.exact = True
    exact = judge(result, Thresholds(), None)
    assert exact[-1].metric == "differing_clips" and exact[-1].value == 1.0 and not exact[-1].passed
    result.clips = [_clip("a", [0.0, 0.0], 0.0, identical=True)]
    assert all(c.passed for c in judge(result, Thresholds(), None))


def test_command_module_imports_no_runtime() -> None:
    """`k6fast` builds its parser on every start: registering `gate` must not import torch, diffusers or lpips."""
    import subprocess
    import sys

    code = (
        "import sys, argparse; from k6fast.quality_gate.command import register; "
        "register(argparse.ArgumentParser().add_subparsers()); "
        "print(sorted(m for m in ('torch', 'diffusers', 'lpips', 'matplotlib', 'av') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_lpips_linear_layers_are_the_packaged_calibrated_ones(scorer: LpipsScorer) -> None:
    import lpips

    packaged = torch.load(Path(lpips.__file__).parent / "weights" / "v0.1" / "alex.pth", map_location="cpu")
    ours = scorer.model.state_dict()
    assert len(packaged) == 5 and all(torch.equal(ours[name], value) for name, value in packaged.items())
