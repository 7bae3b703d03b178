"""What the VAEs make of a clip's size: the video latent's shape and the audio latent's length. No PyTorch: requests
are planned with it before any model code loads (the command line, the server, `k6fast doctor`, the bench).

Video: Kandinsky 6's causal video VAE compresses height and width by `SPATIAL_STRIDE` and time by `TEMPORAL_STRIDE`
after the first frame, which it encodes alone: F frames → (F - 1) / 4 + 1 latent frames, T latent frames → 4(T - 1)
+ 1 frames.

Audio: MMAudio's VAE has one latent step per `latent_hop` waveform samples at `sample_rate`; both come from the
checkpoint's audio_vae/config.json (`audio_rate`), its encoder halving the mel frame rate (latent hop = 2 x the mel
hop), as diffusers' `MMAudioVAE.latent_hop_length` does.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

SPATIAL_STRIDE = 8  # pixels per latent along height and width
TEMPORAL_STRIDE = 4  # frames per latent frame after the first


def latent_frames(frames: int) -> int:
    """Latent frames of a clip of `frames` frames (4k + 1 frames → k + 1)."""
    return (frames - 1) // TEMPORAL_STRIDE + 1


def pixel_frames(latent_frames: int) -> int:
    """Frames the video VAE decodes from `latent_frames` latent frames (the inverse of `latent_frames`)."""
    return (latent_frames - 1) * TEMPORAL_STRIDE + 1


def latent_size(height: int, width: int) -> tuple[int, int]:
    """(latent height, latent width) of frames `height` x `width`."""
    return height // SPATIAL_STRIDE, width // SPATIAL_STRIDE


@dataclass(frozen=True)
class AudioRate:
    sample_rate: int  # Hz, the vocoder's waveform
    latent_hop: int  # waveform samples per audio latent step


# MMAudioVAE's defaults (44.1 kHz, mel hop 512): what a config leaves out, and what a plan made without a checkpoint
# at hand (`k6fast doctor`'s W1 figure) assumes.
MMAUDIO = AudioRate(sample_rate=44_100, latent_hop=2 * 512)


def audio_rate(root: str | Path) -> AudioRate:
    """The audio VAE's rate from a checkpoint folder's audio_vae/config.json, read as diffusers reads it."""
    path = Path(root) / "audio_vae" / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    sample_rate = int(config.get("sample_rate", MMAUDIO.sample_rate))
    return AudioRate(sample_rate, 2 * int(config.get("hop_length", MMAUDIO.latent_hop // 2)))


def audio_length(latent_frames: int, fps: float, rate: AudioRate) -> int:
    """Audio latent steps covering the video of `latent_frames` latent frames at `fps`:
    ceil(frames / fps * sample_rate / latent_hop)."""
    return math.ceil(pixel_frames(latent_frames) / fps * rate.sample_rate / rate.latent_hop)
