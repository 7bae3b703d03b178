"""Exact attention references: what every attention kernel of k6fast is checked against or falls back to.

- `sdpa(q, k, v, mask)`: PyTorch's scaled_dot_product_attention on the DiT's [B, N, H, D] layout with an optional
  key mask; the exact path of the DiT forward (the runtime picks SDPA's backend around it).
- `attention_fp32(q, k, v)`: exact attention in fp32 on [B, H, N, D], chunked over query rows; the yardstick the
  errors of the low-precision kernels (and of SDPA itself) are measured against.

Pure PyTorch; no Triton.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["attention_fp32", "sdpa"]


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """q: [B, Nq, H, D], k/v: [B, Nk, H, D], mask: bool [B, Nk] (True = attend) or None → [B, Nq, H, D]."""
    attn_mask = None if mask is None else mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask)
    return out.transpose(1, 2)


def attention_fp32(q: Tensor, k: Tensor, v: Tensor, *, sm_scale: float | None = None) -> Tensor:
    """Exact softmax(q kᵀ·sm_scale) v in FP32. q: [B, H, M, D], k, v: [B, H, N, D] any float dtype -> fp32 [B, H, M, D].

    Chunked over query rows so the score block stays near 2**28 elements (1 GiB).
    """
    if torch.get_float32_matmul_precision() != "highest":
        raise RuntimeError(
            "attention_fp32: expected torch.get_float32_matmul_precision() == 'highest' (TF32 off), "
            f"found {torch.get_float32_matmul_precision()!r}"
        )
    b, h, m, d = q.shape
    n = k.shape[2]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    kt = k.float().transpose(-1, -2)
    vf = v.float()
    out = torch.empty((b, h, m, d), dtype=torch.float32, device=q.device)
    chunk = max(1, (1 << 28) // (b * h * n))
    for i in range(0, m, chunk):
        s = torch.matmul(q[:, :, i : i + chunk].float(), kt).mul_(scale)
        out[:, :, i : i + chunk] = torch.matmul(torch.softmax(s, dim=-1), vf)
    return out
