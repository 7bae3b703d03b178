"""What a bench visit times: the geometry, and the synthetic inputs for `--component dit` and `--component block`.

Both sides of a DiT or block comparison (k6fast and the diffusers peer) get the same tensors: drawn from a CPU
generator with the session's seed, then moved to the device. Shapes are those of a real request at the geometry:
video latents `[1, T, H', W', C]` of the geometry's latent shape (k6fast/vae_geometry.py), audio latents of the length
the pipeline would use, and text states of a typical prompt length (64 Qwen tokens after the template crop).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..request import FPS, W1
from ..vae_geometry import audio_length, audio_rate, latent_frames, latent_size

if TYPE_CHECKING:  # PyTorch loads where tensors are drawn: `k6fast bench` checks its arguments without it
    import torch
    from torch import Tensor

GEOMETRIES = {"w1": W1, "smoke": (64, 64, 9)}
TEXT_TOKENS = 64  # a typical prompt after the chat-template crop
TIMESTEP = 500.0  # mid-schedule on the [0, 1000] scale; the DiT's cost does not depend on it
_GEOMETRY_RE = re.compile(r"(\d+)x(\d+)x(\d+)")


@dataclass(frozen=True)
class Geometry:
    width: int
    height: int
    frames: int

    @property
    def latent_frames(self) -> int:
        return latent_frames(self.frames)

    def token_grid(self, patch: tuple[int, int, int]) -> tuple[int, int, int]:
        """(T, H, W) of the DiT's video tokens: the latent shape in `patch`-sized steps."""
        pt, ph, pw = patch
        h, w = latent_size(self.height, self.width)
        return self.latent_frames // pt, h // ph, w // pw

    def video_tokens(self, patch: tuple[int, int, int]) -> int:
        return math.prod(self.token_grid(patch))

    def label(self) -> str:
        return f"{self.width}x{self.height}x{self.frames}"


def parse_geometry(text: str) -> Geometry:
    """`w1`, `smoke` or WIDTHxHEIGHTxFRAMES (multiples of 16, frames 4k+1)."""
    from ..request import RequestError, validate_geometry

    key = text.strip().lower()
    if key in GEOMETRIES:
        return Geometry(*GEOMETRIES[key])
    match = _GEOMETRY_RE.fullmatch(key)
    if match is None:
        raise ValueError(f"--geometry {text!r}: expected one of {', '.join(GEOMETRIES)} or WIDTHxHEIGHTxFRAMES")
    geometry = Geometry(*(int(v) for v in match.groups()))
    try:
        validate_geometry(geometry.width, geometry.height, geometry.frames)
    except RequestError as exc:
        raise ValueError(f"--geometry {text!r}: {exc}") from exc
    return geometry


def audio_tokens(root: Path, geometry: Geometry) -> int:
    """Audio latent steps the pipeline would denoise for this geometry, from the checkpoint's audio VAE config."""
    return audio_length(geometry.latent_frames, FPS, audio_rate(root))


def dit_inputs(
    cfg, geometry: Geometry, audio_len: int, device: torch.device, dtype: torch.dtype, seed: int
) -> dict[str, Tensor]:
    """Keyword arguments of one DiT forward (diffusers' signature, which K6DiT shares), video+audio, no mask.
    cfg: k6fast DiTConfig."""
    import torch

    g = torch.Generator("cpu").manual_seed(seed)
    h, w = latent_size(geometry.height, geometry.width)
    inputs = {
        "hidden_states": torch.randn(1, geometry.latent_frames, h, w, cfg.visual_in_channels, generator=g),
        "encoder_hidden_states": torch.randn(1, TEXT_TOKENS, cfg.in_text_dim, generator=g),
        "pooled_projections": torch.randn(1, cfg.in_text_dim2, generator=g),
        "audio_hidden_states": torch.randn(1, audio_len, cfg.in_audio_dim, generator=g),
    }
    out = {k: v.to(device=device, dtype=dtype) for k, v in inputs.items()}
    out["timestep"] = torch.full((1,), TIMESTEP, device=device)
    return out


@dataclass
class BlockInputs:
    """Activations entering fused block 0 (k6fast layout). vis: [1, N, D]; aud: [1, L, Da]; the rest as
    `k6fast.dit.blocks.FusedBlockInputs`."""

    vis: Tensor
    aud: Tensor
    shared: object  # FusedBlockInputs


def block_inputs(
    cfg, geometry: Geometry, audio_len: int, device: torch.device, dtype: torch.dtype, seed: int
) -> BlockInputs:
    """Synthetic activations of the right shapes and scales for `k6fast.dit.blocks.fused_block`."""
    import torch

    from ..dit.blocks import FusedBlockInputs
    from ..dit.rope import rope_1d, rope_3d

    g = torch.Generator("cpu").manual_seed(seed)
    grid = geometry.token_grid(cfg.patch_size)
    n = math.prod(grid)

    def randn(*shape: int, fp32: bool = False) -> Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=torch.float32 if fp32 else dtype)

    positions = tuple(torch.arange(size, device=device) for size in grid)
    shared = FusedBlockInputs(
        text_v=randn(1, TEXT_TOKENS, cfg.model_dim),
        text_a=randn(1, TEXT_TOKENS, cfg.model_dim_a),
        temb_v=randn(1, cfg.time_dim, fp32=True),
        temb_a=randn(1, cfg.time_dim_a, fp32=True),
        rope_v=rope_3d(positions, cfg.axes_dims, cfg.scale_factor),
        rope_a=rope_1d(torch.arange(audio_len, device=device), cfg.head_dim_a, cfg.audio_freqs_scaling),
        text_mask=None,
    )
    return BlockInputs(randn(1, n, cfg.model_dim), randn(1, audio_len, cfg.model_dim_a), shared)
