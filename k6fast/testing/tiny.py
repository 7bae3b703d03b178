"""Tiny random-weight Kandinsky 6 checkpoints in the exact Diffusers layout.

`make_tiny(dir)` writes `model_index.json` and all nine components (`transformer/ vae/ text_encoder/ tokenizer/
text_encoder_2/ tokenizer_2/ scheduler/ audio_vae/ vocoder/`) with the classes and `save_pretrained` of diffusers
and transformers, so that `Kandinsky6TI2VAPipeline.from_pretrained(dir)` loads it offline and generates a clip in
seconds on a CPU. The transformer and the Qwen text encoder are sharded like the real checkpoints. Weights are stored
in float32 (the real ones are bf16) so CPU tests run at full precision.

What is kept from the real checkpoints (so the code paths that real users hit run here too; the figures are the
release's, from `model_constants.py`): every Pro transformer flag (`ca_rope`, `cross_gates`, `fix_modulation`,
`text_token_padding`, `visual_cond`, two visual token types, `audio_freqs_scaling`), the patch, the video VAE's
latent channels and its 4x temporal / 8x spatial compression, 44.1 kHz audio at 1024 samples per latent step, the
widened PiFlow heads (N_GRID x the latent channels), the schedulers and the audio VAE scaling factors, Qwen's special
tokens and right padding, and a Qwen chat-template prefix of exactly the tokens the reference pipeline crops
(`tokenizers.py`). Widths are tiny and deliberately unequal (video 64, audio 32, Qwen 48, CLIP 24) so that a
mixed-up dimension fails loudly instead of passing by coincidence.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from ..atomic import build_dir_atomically
from .model_constants import (
    AUDIO_SAMPLE_RATE,
    AUDIO_VAE_SCALING,
    FLAGS,
    FLOW_MATCH_SCHEDULER,
    N_GRID,
    PIFLOW_SCHEDULER,
    VIDEO_LATENT_CHANNELS,
)
from .tokenizers import QWEN_SPECIAL_TOKENS, build_clip_tokenizer, build_qwen_processor

if TYPE_CHECKING:
    from diffusers import Kandinsky6TI2VAPipeline

Variant = Literal["distill", "base"]
VARIANTS: tuple[str, ...] = ("distill", "base")

# Widths of the tiny components (the video latent channels are the release's). The transformer's `in_*` dims
# follow from these.
QWEN_HIDDEN = 48
CLIP_HIDDEN = 24
AUDIO_LATENT_CHANNELS = 8
AUDIO_MEL_BINS = 32

# Real checkpoints store the DiT as several `diffusion_pytorch_model-0000N-of-0000M.safetensors` and Qwen2.5-VL as
# `model-0000N-of-0000M.safetensors`; these sizes split the tiny ones into a handful of shards.
TRANSFORMER_SHARD_BYTES = 400_000
TEXT_ENCODER_SHARD_BYTES = 150_000


def make_tiny(out_dir: str | Path, variant: Variant = "distill", seed: int = 0) -> Path:
    """Write a tiny random-weight Kandinsky 6 checkpoint (Diffusers layout) to `out_dir` and return its path.

    `variant` "distill" mirrors Pro-distill (PiFlow scheduler, heads of `n_grid` x the latent channels, run with
    guidance 1.0); "base" mirrors Pro (flow-matching Euler, plain heads, CFG). The same `seed` gives the same weight
    bytes. The checkpoint is built in a temporary folder beside `out_dir` and renamed into place, so an interrupted
    build never leaves a half-written checkpoint; an existing non-empty `out_dir` is refused.
    """
    _check_args(variant, seed)
    return build_dir_atomically(out_dir, lambda tmp: _write_checkpoint(tmp, variant, seed), "tiny checkpoint")


def build_tiny_pipeline(variant: Variant = "distill", seed: int = 0) -> Kandinsky6TI2VAPipeline:
    """The in-memory pipeline that `make_tiny` saves: float32 weights on the CPU, default initialisers."""
    from diffusers import Kandinsky6TI2VAPipeline

    _check_args(variant, seed)
    processor = build_qwen_processor()
    tokenizer_2 = build_clip_tokenizer()
    # Each component draws from its own seed so that changing one leaves the others' bytes alone.
    with _seeded(seed, 1):
        text_encoder = _build_qwen(processor.tokenizer)
    with _seeded(seed, 2):
        text_encoder_2 = _build_clip(tokenizer_2)
    with _seeded(seed, 3):
        transformer = _build_transformer(variant)
    with _seeded(seed, 4):
        vae = _build_video_vae()
    with _seeded(seed, 5):
        audio_vae = _build_audio_vae(variant)
    with _seeded(seed, 6):
        vocoder = _build_vocoder()
    return Kandinsky6TI2VAPipeline(
        transformer=transformer,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=processor,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        scheduler=_build_scheduler(variant),
        audio_vae=audio_vae,
        vocoder=vocoder,
    )


def transformer_config(variant: Variant) -> dict:
    """`Kandinsky6Transformer3DModel` config of the tiny checkpoint: the Pro flags at tiny widths."""
    _check_args(variant, 0)
    widen = N_GRID if variant == "distill" else 1
    return {
        "in_visual_dim": VIDEO_LATENT_CHANNELS,
        "out_visual_dim": widen * VIDEO_LATENT_CHANNELS,
        "in_text_dim": QWEN_HIDDEN,
        "in_text_dim2": CLIP_HIDDEN,
        "time_dim": 16,
        "model_dim": 64,
        "ff_dim": 128,
        "num_text_blocks": 1,
        "num_visual_blocks": 2,
        # head_dim 16 for both modalities: `ca_rope` rotates audio keys with video positions and needs equal heads.
        "axes_dims": (4, 6, 6),
        "in_audio_dim": AUDIO_LATENT_CHANNELS,
        "out_audio_dim": widen * AUDIO_LATENT_CHANNELS,
        "model_dim_a": 32,
        "time_dim_a": 16,
        "ff_dim_a": 64,
        "axes_dims_a": (4, 6, 6),
        **FLAGS,
    }


def _check_args(variant: str, seed: int) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")


def _write_checkpoint(path: Path, variant: Variant, seed: int) -> None:
    pipe = build_tiny_pipeline(variant, seed)
    pipe.save_pretrained(path, safe_serialization=True)
    # Re-save the two big components sharded, as real checkpoints ship them.
    for name, shard_bytes in (("transformer", TRANSFORMER_SHARD_BYTES), ("text_encoder", TEXT_ENCODER_SHARD_BYTES)):
        shutil.rmtree(path / name)
        getattr(pipe, name).save_pretrained(path / name, safe_serialization=True, max_shard_size=shard_bytes)


@contextmanager
def _seeded(seed: int, component: int) -> Iterator[None]:
    # Default initialisers draw from the global RNG; fork it so building a checkpoint leaves the caller's RNG alone.
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1000 + component)
        yield


def _build_qwen(tokenizer):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN_SPECIAL_TOKENS}
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": QWEN_HIDDEN,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 3,
            # Grouped-query attention like Qwen2.5-VL-7B (28 query heads over 4 key/value heads).
            "num_key_value_heads": 1,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            # M-RoPE splits head_dim / 2 = 8 rotary frequencies over (temporal, height, width).
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]},
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config={
            "depth": 2,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": QWEN_HIDDEN,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [1],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def _build_clip(tokenizer):
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=CLIP_HIDDEN,
        intermediate_size=48,
        projection_dim=CLIP_HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=77,
        hidden_act="quick_gelu",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModel(config).eval()


def _build_transformer(variant: Variant):
    from diffusers import Kandinsky6Transformer3DModel

    return Kandinsky6Transformer3DModel(**transformer_config(variant)).eval()


def _build_video_vae():
    from diffusers import AutoencoderKLHunyuanVideo

    # Four levels as in the real VAE: 8x spatial and 4x temporal compression, 16 latent channels; the default
    # scaling factor is the real one.
    return AutoencoderKLHunyuanVideo(
        latent_channels=VIDEO_LATENT_CHANNELS,
        block_out_channels=(8, 16, 16, 16),
        layers_per_block=1,
        norm_num_groups=4,
        spatial_compression_ratio=8,
        temporal_compression_ratio=4,
    ).eval()


def _build_audio_vae(variant: Variant):
    from diffusers import MMAudioVAE

    # 44.1 kHz with a mel hop of 512; the encoder halves the frame rate, so one latent step is 1024 samples.
    return MMAudioVAE(
        mel_bins=AUDIO_MEL_BINS,
        latent_channels=AUDIO_LATENT_CHANNELS,
        hidden_channels=16,
        channel_multipliers=(1, 2, 4),
        layers_per_block=1,
        sample_rate=AUDIO_SAMPLE_RATE,
        n_fft=2048,
        hop_length=512,
        scaling_factor=AUDIO_VAE_SCALING[variant],
    ).eval()


def _build_vocoder():
    from diffusers import MMAudioVocoder

    # The upsample rates multiply to the audio VAE's mel hop (8 * 8 * 8 = 512), one waveform sample per step.
    return MMAudioVocoder(
        num_mels=AUDIO_MEL_BINS,
        upsample_initial_channel=16,
        upsample_rates=(8, 8, 8),
        upsample_kernel_sizes=(16, 16, 16),
        resblock_kernel_sizes=(3, 5),
        resblock_dilation_sizes=((1, 3), (1, 3)),
    ).eval()


def _build_scheduler(variant: Variant):
    from diffusers import FlowMatchEulerDiscreteScheduler, PiflowScheduler

    if variant == "distill":
        return PiflowScheduler(**PIFLOW_SCHEDULER)
    return FlowMatchEulerDiscreteScheduler(**FLOW_MATCH_SCHEDULER)
