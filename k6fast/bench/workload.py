"""What a bench visit times: the geometry, and the synthetic inputs for `--component dit` and `--component block`.

Both sides of a DiT or block comparison (k6fast and the diffusers peer) get the same tensors: drawn from a CPU
generator with the session's seed, then moved to the device. Shapes are those of a real request at the geometry:
video latents `[1, T, H/8, W/8, C]` (T = (frames-1)/4 + 1), audio latents of the length the pipeline would use, and
text states of a typical prompt length (64 Qwen tokens after the template crop).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # PyTorch loads where tensors are drawn: `k6fast bench` checks its arguments without it
    import torch
    from torch import Tensor

GEOMETRIES = {"w1": (864, 480, 121), "smoke": (64, 64, 9)}
TEXT_TOKENS = 64  # a typical prompt after the chat-template crop
TIMESTEP = 500.0  # mid-schedule on the [0, 1000] scale; the DiT's cost does not depend on it
FPS = 24.0
_GEOMETRY_RE = re.compile(r"(\d+)x(\d+)x(\d+)")


@dataclass(frozen=True)
class Geometry:
    width: int
    height: int
    frames: int

    @property
    def latent_frames(self) -> int:
        return (self.frames - 1) // 4 + 1

    def video_tokens(self, patch: tuple[int, int, int]) -> int:
        pt, ph, pw = patch
        return (self.latent_frames // pt) * (self.height // 8 // ph) * (self.width // 8 // pw)

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
    config_path = Path(root) / "audio_vae" / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    # MMAudioVAE's defaults, and its encoder halves the mel frame rate (latent hop = 2 x mel hop).
    sample_rate = int(config.get("sample_rate", 44_100))
    hop = 2 * int(config.get("hop_length", 512))
    return math.ceil(((geometry.latent_frames - 1) * 4 + 1) / FPS * sample_rate / hop)


def dit_inputs(
    cfg, geometry: Geometry, audio_len: int, device: torch.device, dtype: torch.dtype, seed: int
) -> dict[str, Tensor]:
    """Keyword arguments of one DiT forward (diffusers' signature, which K6DiT shares), video+audio, no mask.
    cfg: k6fast DiTConfig."""
    import torch

    g = torch.Generator("cpu").manual_seed(seed)
    h, w = geometry.height // 8, geometry.width // 8
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
    pt, ph, pw = cfg.patch_size
    grid = (geometry.latent_frames // pt, geometry.height // 8 // ph, geometry.width // 8 // pw)
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
