"""The numerical building blocks of the DiT forward, written against a plain weight mapping.

Every function here takes its weights as a `Mapping[str, Tensor]` (names relative to the layer) so that resident,
streamed and quantized weights look the same to the forward. Linear layers and attention go through a `Backend`
(see `backend.py`), which is where precision and kernel choices live.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from .backend import Backend

Weights = Mapping[str, Tensor]


def timestep_embedding(timestep: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
    """Sinusoidal embedding, cos half first (diffusers' `Timesteps(flip_sin_to_cos=True, shift=0)`).
    timestep: [B] on the [0, 1000] scale → fp32 [B, dim]."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timestep.device) / half)
    args = timestep.float()[:, None] * freqs[None, :]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def linear(backend: Backend, w: Weights, name: str, x: Tensor) -> Tensor:
    return backend.linear(x, w[f"{name}.weight"], w.get(f"{name}.bias"), name=name)


def linears(backend: Backend, w: Weights, names: list[str], x: Tensor) -> list[Tensor]:
    """The layers `names` on one input, in order: a backend may prepare x once for all of them."""
    return backend.linears(x, [(w[f"{n}.weight"], w.get(f"{n}.bias"), n) for n in names])


def modulation(backend: Backend, w: Weights, name: str, temb: Tensor) -> Tensor:
    """AdaLN parameters from the time embedding: Linear(SiLU(temb)), fp32. temb: [B, time_dim] → [B, k * dim]."""
    return backend.linear(F.silu(temb.float()), w[f"{name}.weight"], w[f"{name}.bias"], name=name)


def text_embedding(backend: Backend, w: Weights, name: str, x: Tensor) -> Tensor:
    """Linear projection then LayerNorm with affine (text tokens, pooled text, audio latents)."""
    h = linear(backend, w, f"{name}.in_layer", x)
    return F.layer_norm(h, (h.shape[-1],), w[f"{name}.norm.weight"].to(h.dtype), w[f"{name}.norm.bias"].to(h.dtype))


def time_embedding(backend: Backend, w: Weights, name: str, timestep: Tensor, dim: int) -> Tensor:
    """timestep [B] → fp32 [B, time_dim] through the sinusoid and a SiLU MLP."""
    h = linear(backend, w, f"{name}.timestep_embedder.linear_1", timestep_embedding(timestep, dim))
    return linear(backend, w, f"{name}.timestep_embedder.linear_2", F.silu(h))


def feed_forward(backend: Backend, w: Weights, name: str, x: Tensor) -> Tensor:
    """Linear, exact-erf GELU, linear. x: [B, N, D] → [B, N, D]."""
    h = linear(backend, w, f"{name}.net.0.proj", x)
    return linear(backend, w, f"{name}.net.2", backend.gelu(h))


def attention(
    backend: Backend,
    w: Weights,
    name: str,
    x: Tensor,
    context: Tensor | None,
    num_heads: int,
    *,
    site: str,
    rope_q: tuple[Tensor, Tensor] | None = None,
    rope_k: tuple[Tensor, Tensor] | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """Multi-head attention with per-head RMSNorm on q and k, optional RoPE, and an output projection.
    x: [B, Nq, D]; context: [B, Nk, Dkv] (None = self-attention); mask: bool [B, Nk] (True = attend)."""
    if context is None:
        q, k, v = linears(backend, w, [f"{name}.to_query", f"{name}.to_key", f"{name}.to_value"], x)
    else:
        q = linear(backend, w, f"{name}.to_query", x)
        k, v = linears(backend, w, [f"{name}.to_key", f"{name}.to_value"], context)
    q, k, v = (t.unflatten(-1, (num_heads, -1)) for t in (q, k, v))
    q = backend.norm_rope(q, w[f"{name}.query_norm.weight"], rope_q)
    k = backend.norm_rope(k, w[f"{name}.key_norm.weight"], rope_k)
    out = backend.attention(q, k, v, site=site, mask=mask)  # [B, Nq, H, Dh]
    return linear(backend, w, f"{name}.out_layer", out.flatten(-2))
