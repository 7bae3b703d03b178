"""Decoders (and the reference-image encoder): diffusers' HunyuanVideo VAE (loaded untiled; `decode_video` is its
plain or tiled decode, k6fast.video_decode its exact whole-clip one), MMAudio VAE + vocoder."""

from __future__ import annotations

from pathlib import Path

import PIL.Image
import torch
from torch import Tensor


def load_video_vae(root: Path, device: torch.device, dtype: torch.dtype):
    from diffusers import AutoencoderKLHunyuanVideo

    # Untiled: the reference image's encode is one frame; K6_VIDEO_DECODE=tiled turns tiling on for its decode only.
    return AutoencoderKLHunyuanVideo.from_pretrained(root / "vae", dtype=dtype).to(device).eval()


def load_audio_decoder(root: Path, device: torch.device, dtype: torch.dtype):
    from diffusers import MMAudioVAE, MMAudioVocoder

    audio_vae = MMAudioVAE.from_pretrained(root / "audio_vae", dtype=dtype).to(device).eval()
    vocoder = MMAudioVocoder.from_pretrained(root / "vocoder", dtype=dtype).to(device).eval()
    return audio_vae, vocoder


@torch.no_grad()
def encode_image(
    vae, image: PIL.Image.Image, height: int, width: int, generator: torch.Generator | None, dtype: torch.dtype
) -> Tensor:
    """Reference image → first-frame latent [1, H/8, W/8, C] scaled by the VAE's scaling factor. The image is
    resized and centre-cropped to height x width; the latent is sampled from the posterior with `generator`, as the
    reference pipeline does."""
    from diffusers.video_processor import VideoProcessor

    processor = VideoProcessor(vae_scale_factor=vae.config.spatial_compression_ratio)
    pixels = processor.preprocess(image.convert("RGB"), height=height, width=width, resize_mode="crop")
    pixels = pixels.to(device=vae.device, dtype=vae.dtype).unsqueeze(2)  # [1, 3, 1, H, W]
    latent = vae.encode(pixels).latent_dist.sample(generator) * vae.config.scaling_factor
    return latent[:, :, 0].permute(0, 2, 3, 1).to(dtype)


@torch.no_grad()
def decode_video(vae, latents: Tensor, *, tiled: bool = False) -> Tensor:
    """latents: [B, T, H, W, C] (scaled) → frames fp32 [B, F, 8H, 8W, 3] in [0, 1], F = 4(T-1)+1, by diffusers'
    decode: `tiled` = its tiled decode (256 px, 16-frame tiles; below a tile's size it decodes whole); otherwise its
    plain decode (which is still framewise past 4 latent frames, see k6fast/video_decode/)."""
    was_tiled = vae.use_tiling
    if tiled:
        vae.enable_tiling()
    try:
        video = vae.decode(latents.permute(0, 4, 1, 2, 3).to(vae.dtype) / vae.config.scaling_factor).sample
    finally:
        vae.use_tiling = was_tiled
    return (video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1)


@torch.no_grad()
def decode_audio(audio_vae, vocoder, latents: Tensor) -> Tensor:
    """latents: [B, L, C] (scaled) → mono waveform fp32 [B, N] at the audio VAE's sample rate."""
    mel = audio_vae.decode(latents.permute(0, 2, 1).to(audio_vae.dtype) / audio_vae.config.scaling_factor).sample
    return vocoder(mel.to(vocoder.dtype)).sample[:, 0].float()
