"""Where the DiT's precision and kernel choices live: one object that runs every linear layer and attention call.

The forward names each call (`name` = the layer's weight name, `site` = the attention call site, one of
`config.ATTENTION_SITES`), so a backend can choose per layer and per call site without the forward knowing.
`ExactBackend` is the BF16 reference path; its elementwise maths and attention are the kernels' own references.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels import adaln, gelu, qk_norm_rope
from ..kernels.adaln import gated_residual_ref, layernorm_modulate_ref
from ..kernels.exact_attention import sdpa
from ..kernels.gelu import gelu_ref
from ..kernels.qk_norm_rope import rms_norm_rope_ref
from .arch import resolve_auto
from .attention import AttentionDispatch
from .linear import LinearDispatch

if TYPE_CHECKING:
    from ..kernels.tile_mask import TokenOrder

logger = logging.getLogger(__name__)

LN_EPS = 1e-5  # nn.LayerNorm's default, as in the reference model

Layer = tuple[Tensor, Tensor | None, str]  # (weight, bias, name) of a linear layer


class Backend(Protocol):
    """What the DiT forward needs from a backend."""

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None, *, name: str) -> Tensor: ...

    def linears(self, x: Tensor, layers: list[Layer]) -> list[Tensor]: ...

    def attention(self, q: Tensor, k: Tensor, v: Tensor, *, site: str, mask: Tensor | None) -> Tensor: ...

    def modulate(self, x: Tensor, scale: Tensor, shift: Tensor) -> Tensor: ...

    def gated_add(self, x: Tensor, out: Tensor, gate: Tensor) -> Tensor: ...

    def gated_add_modulate(
        self, x: Tensor, out: Tensor, gate: Tensor, scale: Tensor, shift: Tensor
    ) -> tuple[Tensor, Tensor]: ...

    def gelu(self, x: Tensor) -> Tensor: ...

    def norm_rope(self, x: Tensor, weight: Tensor, rope: tuple[Tensor, Tensor] | None) -> Tensor: ...

    def begin_step(self, step: int, num_steps: int | None = None) -> None: ...

    def begin_block(self, block: int, num_blocks: int) -> None: ...

    def video_token_order(self, grid: tuple[int, int, int], positions) -> TokenOrder | None: ...


class ExactBackend:
    """The reference every fast path is checked against: GEMMs in the weights' dtype (cuBLAS on GPU), PyTorch SDPA,
    and the elementwise maths as the kernels' own references (the `*_ref` of `k6fast/kernels/`: multi-pass fp32
    torch ops)."""

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None, *, name: str) -> Tensor:
        return F.linear(x, weight, bias)

    def linears(self, x: Tensor, layers: list[Layer]) -> list[Tensor]:
        """Several layers on one input (q/k/v projections): one `linear` call each."""
        return [self.linear(x, weight, bias, name=name) for weight, bias, name in layers]

    def attention(self, q: Tensor, k: Tensor, v: Tensor, *, site: str, mask: Tensor | None) -> Tensor:
        return sdpa(q, k, v, mask)

    def modulate(self, x: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
        """AdaLN: LayerNorm(x) * (1 + scale) + shift in fp32, in x.dtype. x: [B, N, D]; scale, shift: [B, D]."""
        return layernorm_modulate_ref(x, scale, shift, eps=LN_EPS)

    def gated_add(self, x: Tensor, out: Tensor, gate: Tensor) -> Tensor:
        """Gated residual x + gate * out in fp32, returned in x.dtype. x, out: [B, N, D]; gate: [B, D]."""
        return gated_residual_ref(x, out, gate)

    def gated_add_modulate(
        self, x: Tensor, out: Tensor, gate: Tensor, scale: Tensor, shift: Tensor
    ) -> tuple[Tensor, Tensor]:
        """A residual, then the next sub-layer's modulation of the updated stream: (x + gate * out, its AdaLN).
        x, out: [B, N, D]; gate, scale, shift: [B, D]."""
        x = self.gated_add(x, out, gate)
        return x, self.modulate(x, scale, shift)

    def gelu(self, x: Tensor) -> Tensor:
        return gelu_ref(x)

    def norm_rope(self, x: Tensor, weight: Tensor, rope: tuple[Tensor, Tensor] | None) -> Tensor:
        """Per-head RMSNorm (nn.RMSNorm(eps=None), as the reference model), then RoPE. x: [B, N, H, D]; rope: fp32
        (cos, sin) [N, D // 2] or None."""
        cos, sin = (None, None) if rope is None else rope
        return rms_norm_rope_ref(x, weight, cos, sin)

    def begin_step(self, step: int, num_steps: int | None = None) -> None:
        return None

    def begin_block(self, block: int, num_blocks: int) -> None:
        return None

    def video_token_order(self, grid: tuple[int, int, int], positions) -> TokenOrder | None:
        """The order a backend wants the video tokens in for this forward (see attention.py); None: as they are."""
        return None


class SwitchedBackend(ExactBackend):
    """The backend the switches configure: attention and linear dispatch per call site and layer, optional fused
    elementwise kernels. With every switch off it computes what `ExactBackend` computes (exact attention picks the
    fastest SDPA backend for the architecture)."""

    def __init__(self, options, device: torch.device):
        resolved = resolve_auto(options, device)
        if resolved is not options:
            logger.info("on %s: K6_GEMM=%s, K6_ATTN=%s (auto resolved)", device, resolved.gemm, resolved.attn)
        options = resolved
        self.attn = AttentionDispatch(options, device)
        self.gemm = LinearDispatch(options)
        self.fused = options.fused_elementwise

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None, *, name: str) -> Tensor:
        return self.gemm(x, weight, bias, name=name)

    def linears(self, x: Tensor, layers: list[Layer]) -> list[Tensor]:
        # One shared fp8 preparation of x (row quantization, outlier channels) for all of them.
        shared: dict = {}
        return [self.gemm(x, weight, bias, name=name, shared=shared) for weight, bias, name in layers]

    def attention(self, q: Tensor, k: Tensor, v: Tensor, *, site: str, mask: Tensor | None) -> Tensor:
        return self.attn(q, k, v, site=site, mask=mask)

    def fused_for(self, x: Tensor) -> bool:
        """Whether the fused kernels take this activation (they are CUDA kernels; on the CPU the references run)."""
        return self.fused and x.is_cuda

    def modulate(self, x: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
        if self.fused_for(x):
            return adaln.layernorm_modulate(x, scale, shift, eps=LN_EPS)
        return super().modulate(x, scale, shift)

    def gated_add(self, x: Tensor, out: Tensor, gate: Tensor) -> Tensor:
        if self.fused_for(x):
            return adaln.gated_residual(x, out.contiguous(), gate)
        return super().gated_add(x, out, gate)

    def gated_add_modulate(
        self, x: Tensor, out: Tensor, gate: Tensor, scale: Tensor, shift: Tensor
    ) -> tuple[Tensor, Tensor]:
        if self.fused_for(x):
            return adaln.gated_residual_modulate(x, out.contiguous(), gate, scale, shift, eps=LN_EPS)
        return super().gated_add_modulate(x, out, gate, scale, shift)

    def gelu(self, x: Tensor) -> Tensor:
        if self.fused_for(x):
            return gelu.gelu(x)
        return super().gelu(x)

    def norm_rope(self, x: Tensor, weight: Tensor, rope: tuple[Tensor, Tensor] | None) -> Tensor:
        if self.fused_for(x) and x.is_contiguous():
            cos, sin = (None, None) if rope is None else (t.contiguous() for t in rope)
            return qk_norm_rope.rms_norm_rope(x, weight, cos, sin)
        return super().norm_rope(x, weight, rope)

    def begin_step(self, step: int, num_steps: int | None = None) -> None:
        self.attn.begin_step(step, num_steps)

    def begin_block(self, block: int, num_blocks: int) -> None:
        self.attn.begin_block(block, num_blocks)

    def video_token_order(self, grid: tuple[int, int, int], positions) -> TokenOrder | None:
        return self.attn.video_token_order(grid, positions)
