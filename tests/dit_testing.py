"""Shared by the tests that build the streaming DiT runtime on a tiny checkpoint: one build whose budget no tiny
checkpoint reaches, so every block stays resident unless the test caps `max_resident`."""

from __future__ import annotations

import torch

from k6fast.checkpoint import Checkpoint
from k6fast.stream.runtime import DiTRuntime, build_dit

UNLIMITED_BUDGET_BYTES = 1 << 40
TOKENS = (100, 10)  # (video, audio) tokens the activations are sized for: more than any tiny-test geometry has


def tiny_dit(
    ckpt: Checkpoint, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, **kwargs
) -> DiTRuntime:
    """build_dit for `ckpt`'s transformer on `device` computing in `dtype`; `kwargs` (max_resident, prefetch,
    backend) go to build_dit as they are."""
    return build_dit(
        ckpt.transformer_files, ckpt.dit, device, dtype, budget_bytes=UNLIMITED_BUDGET_BYTES, tokens=TOKENS, **kwargs
    )


def dit_inputs(cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random inputs of one tiny-DiT forward (a 3x4x6 latent grid, 5 text tokens, 4 audio steps), fp32 on the CPU."""
    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(1, 3, 4, 6, cfg.visual_in_channels, generator=g),
        encoder_hidden_states=torch.randn(1, 5, cfg.in_text_dim, generator=g),
        pooled_projections=torch.randn(1, cfg.in_text_dim2, generator=g),
        timestep=torch.tensor([500.0]),
        audio_hidden_states=torch.randn(1, 4, cfg.in_audio_dim, generator=g),
    )
