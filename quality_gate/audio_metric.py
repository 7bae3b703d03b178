"""Audio distances for the quality gate: a log-mel spectral distance in dB and a multi-resolution STFT distance.

Why spectral magnitudes and not SI-SDR: a waveform metric compares phase sample by sample, and a generated sound
made of noise-like components (rain, breath, a roaring cascade) changes its fine phase under any perturbation
while sounding the same. The best peer's SI-SDR gate read -1.4 dB between two identical runs, i.e. it could not
tell a run from itself. Magnitude spectrograms drop the phase, so two runs that sound alike score near zero, and a
changed level, timbre, onset or a dropout still shows.

Both distances clamp the spectrograms `DYNAMIC_RANGE_DB` below the louder clip's peak. Without the clamp, the
near-silent parts of a clip (numerical noise at -150 dB) would dominate a log distance with differences nobody can
hear; with it, silence against silence scores zero and sound against silence scores the full range.

Identical waveforms give exactly 0.0 for every number (the same float operations run on the same input).
Check: `pytest tests/test_gate_metrics.py`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from . import GateError

DYNAMIC_RANGE_DB = 80.0
# Log-mel settings: the resolution of common audio-generation evaluations at 44.1 kHz (46 ms window, 11.6 ms hop).
MEL_FFT = 2048
MEL_HOP = 512
MEL_BANDS = 80
# Resolutions of the multi-resolution STFT distance (the Parallel WaveGAN family's loss, here as a metric):
# 11.6 ms windows catch onsets (a pistol crack), 46 ms windows resolve pitch (a violin).
STFT_FFTS = (512, 1024, 2048)
# Length of the window over which the worst stretch of log-mel distance is found: long enough that one noisy
# STFT frame cannot decide it, short enough that a quarter-second dropout or click stands out.
WORST_WINDOW_S = 0.25
_TINY_POWER = 1e-20
_MIN_MAGNITUDE = 1e-9


@dataclass(frozen=True)
class AudioScore:
    """Distances between a reference and a test waveform (0.0 for identical input).

    log_mel_db: mean over STFT frames of the RMS (over mel bands) of the dB difference.
    log_mel_worst_db / log_mel_worst_at_s: the worst `WORST_WINDOW_S` stretch of that per-frame distance and where
        it starts.
    mrstft: mean over `STFT_FFTS` of spectral convergence + log-magnitude distance (the two parts follow).
    spectral_convergence: ||test| - |ref||_F / ||ref||_F, mean over resolutions.
    log_magnitude: mean |ln|test| - ln|ref||, mean over resolutions (nepers).
    identical: the waveforms are equal sample for sample.
    """

    log_mel_db: float
    log_mel_worst_db: float
    log_mel_worst_at_s: float
    mrstft: float
    spectral_convergence: float
    log_magnitude: float
    identical: bool

    def as_dict(self) -> dict[str, float | bool]:
        return asdict(self)


def mel_filterbank(sample_rate: int, n_fft: int, n_mels: int) -> np.ndarray:
    """Triangular filters equally spaced on the HTK mel scale from 0 Hz to Nyquist: float64 [n_mels, n_fft//2+1].

    Filters peak at 1 (no area normalisation): a constant gain per band cancels in a dB difference.
    """
    freqs = np.linspace(0.0, sample_rate / 2, n_fft // 2 + 1)
    mel_max = 2595.0 * np.log10(1.0 + (sample_rate / 2) / 700.0)
    edges = 700.0 * (10.0 ** (np.linspace(0.0, mel_max, n_mels + 2) / 2595.0) - 1.0)
    lower, centre, upper = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising = (freqs[None, :] - lower) / (centre - lower)
    falling = (upper - freqs[None, :]) / (upper - centre)
    return np.maximum(0.0, np.minimum(rising, falling))


def _magnitude(wave: torch.Tensor, n_fft: int, hop: int) -> torch.Tensor:
    """wave: float64 [N] → |STFT| float64 [n_fft//2+1, frames], Hann window, centred (reflect padding)."""
    if wave.numel() <= n_fft // 2:
        # Reflect padding needs more samples than half a window; zero padding keeps very short clips scorable.
        wave = torch.nn.functional.pad(wave, (0, n_fft // 2 + 1 - wave.numel()))
    window = torch.hann_window(n_fft, dtype=wave.dtype)
    spec = torch.stft(wave, n_fft, hop_length=hop, window=window, center=True, pad_mode="reflect", return_complex=True)
    return spec.abs()


def log_mel_frames(reference: np.ndarray, test: np.ndarray, sample_rate: int) -> np.ndarray:
    """Per-STFT-frame log-mel distance in dB: RMS over mel bands of the difference of the clamped dB spectrograms.

    reference, test: float [N] mono at `sample_rate`. Returns float64 [frames].
    """
    ref, tst = _as_pair(reference, test)
    fb = torch.from_numpy(mel_filterbank(sample_rate, MEL_FFT, MEL_BANDS))
    db = [10.0 * torch.log10((fb @ _magnitude(w, MEL_FFT, MEL_HOP) ** 2).clamp_min(_TINY_POWER)) for w in (ref, tst)]
    floor = max(float(db[0].max()), float(db[1].max())) - DYNAMIC_RANGE_DB
    diff = db[0].clamp_min(floor) - db[1].clamp_min(floor)
    return diff.pow(2).mean(dim=0).sqrt().numpy()


def mrstft_distance(reference: np.ndarray, test: np.ndarray) -> tuple[float, float]:
    """(spectral convergence, log-magnitude distance), each the mean over the `STFT_FFTS` resolutions.

    reference, test: float [N] mono. Magnitudes are clamped `DYNAMIC_RANGE_DB` below the louder clip's peak.
    """
    ref, tst = _as_pair(reference, test)
    convergence, log_mag = [], []
    for n_fft in STFT_FFTS:
        a, b = _magnitude(ref, n_fft, n_fft // 4), _magnitude(tst, n_fft, n_fft // 4)
        floor = max(float(a.max()), float(b.max())) * 10.0 ** (-DYNAMIC_RANGE_DB / 20.0)
        floor = max(floor, _MIN_MAGNITUDE)
        a, b = a.clamp_min(floor), b.clamp_min(floor)
        convergence.append(float(torch.linalg.norm(b - a) / torch.linalg.norm(a)))
        log_mag.append(float((b.log() - a.log()).abs().mean()))
    return float(np.mean(convergence)), float(np.mean(log_mag))


def score_audio(reference: np.ndarray, test: np.ndarray, sample_rate: int) -> AudioScore:
    """Every audio distance between two mono waveforms of equal length (float [N] at `sample_rate`)."""
    if sample_rate <= 0:
        raise GateError(f"audio: expected a positive sample rate, found {sample_rate}")
    per_frame = log_mel_frames(reference, test, sample_rate)
    window = max(1, round(WORST_WINDOW_S * sample_rate / MEL_HOP))
    if len(per_frame) > window:
        smoothed = np.convolve(per_frame, np.full(window, 1.0 / window), mode="valid")
    else:
        smoothed = np.array([per_frame.mean()])
    worst = int(np.argmax(smoothed))
    convergence, log_mag = mrstft_distance(reference, test)
    return AudioScore(
        log_mel_db=float(per_frame.mean()),
        log_mel_worst_db=float(smoothed[worst]),
        log_mel_worst_at_s=worst * MEL_HOP / sample_rate,
        mrstft=convergence + log_mag,
        spectral_convergence=convergence,
        log_magnitude=log_mag,
        identical=bool(np.array_equal(reference, test)),
    )


def _as_pair(reference: np.ndarray, test: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate two mono waveforms and return them as float64 tensors (float64 so that rounding cannot make a
    small difference look larger or smaller than it is)."""
    for name, wave in (("reference", reference), ("test", test)):
        if not isinstance(wave, np.ndarray) or wave.ndim != 1:
            shape = getattr(wave, "shape", type(wave).__name__)
            raise GateError(f"audio: expected the {name} as a numpy array of shape [N], found {shape}")
        if wave.size == 0:
            raise GateError(f"audio: expected at least one {name} sample, found none")
        if not np.all(np.isfinite(wave)):
            raise GateError(f"audio: expected finite {name} samples, found NaN or inf")
    if reference.shape != test.shape:
        raise GateError(
            f"audio: expected waveforms of equal length (same geometry), found {reference.size} reference and "
            f"{test.size} test samples"
        )
    return torch.from_numpy(reference.astype(np.float64)), torch.from_numpy(test.astype(np.float64))
