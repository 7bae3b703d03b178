"""Where the DiT's precision and kernel choices live: one object that runs every linear layer and attention call.

The forward names each call (`name` = the layer's weight name, `site` = the attention call site), so a backend can
choose per layer and per call site without the forward knowing. `ExactBackend` is the BF16 reference path.
"""

from __future__ import annotations

from typing import Protocol

import torch.nn.functional as F
from torch import Tensor

# Attention call sites of the DiT. Text blocks attend over text only; fused blocks have the six below.
ATTENTION_SITES = (
    "text_self",
    "video_self",
    "video_text",
    "audio_self",
    "audio_text",
    "video_audio",  # video queries, audio keys
    "audio_video",  # audio queries, video keys
)


class Backend(Protocol):
    """What the DiT forward needs from a backend."""

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None, *, name: str) -> Tensor: ...

    def attention(self, q: Tensor, k: Tensor, v: Tensor, *, site: str, mask: Tensor | None) -> Tensor: ...


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """q: [B, Nq, H, D], k/v: [B, Nk, H, D], mask: bool [B, Nk] or None → [B, Nq, H, D]."""
    attn_mask = None if mask is None else mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask)
    return out.transpose(1, 2)


class ExactBackend:
    """cuBLAS/CPU GEMMs in the weights' dtype and PyTorch SDPA: the reference every fast path is checked against."""

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None, *, name: str) -> Tensor:
        return F.linear(x, weight, bias)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, *, site: str, mask: Tensor | None) -> Tensor:
        return sdpa(q, k, v, mask)
