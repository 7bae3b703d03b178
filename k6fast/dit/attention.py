"""Attention dispatch per call site: exact SDPA (the fastest backend for the architecture, chosen once), k6fast's
INT8/FP8 kernel, or the `sageattention` package, by block and by step.

Exact calls run PyTorch SDPA, or with `K6_EXACT_ATTN_KERNEL=k6` k6fast's Gluon BF16/FP16 kernel where it runs
(sm_90, unmasked, head_dim 64/128); both are exact by the flash-attention rule.

Policy (switches): a quantized backend (`K6_ATTN=k6|sage`) covers the call sites `K6_QUANT_ATTN_SITES` names,
except in the first and last `K6_EXACT_ATTN_BLOCKS` fused blocks and the first `K6_EXACT_ATTN_STEPS` steps, where
errors would propagate through every later block or step. A masked call always goes exact.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import Counter

import torch
import torch.nn.functional as F
from torch import Tensor

from ..switches import Options, SwitchError
from .backend import ATTENTION_SITES

logger = logging.getLogger(__name__)
SUPPORTED_HEAD_DIMS = (64, 128)  # k6fast's kernel (Pro 128, Lite 64)


@functools.cache
def _log_once(message: str) -> None:
    logger.warning(message)


SITE_SETS = {
    "video_self": frozenset({"video_self"}),
    "self": frozenset({"video_self", "audio_self"}),
    "all": frozenset(ATTENTION_SITES) - {"text_self"},  # text blocks always run exact
}


def exact_sdpa_backends(device: torch.device) -> list:
    """SDPA backends in order of preference: cuDNN first on Hopper (585 vs 425 TFLOP/s for flash at W1 on an H200,
    k6-facts.md), flash first elsewhere; the others stay as fallbacks for shapes a backend refuses."""
    from torch.nn.attention import SDPBackend

    if device.type != "cuda":
        return [SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION]
    order = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    if torch.cuda.get_device_capability(device) == (9, 0):
        order.reverse()
    return [*order, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class AttentionDispatch:
    """Runs each attention call with the backend the policy picks and counts what ran where."""

    def __init__(self, options: Options, device: torch.device):
        if options.attn == "auto":
            raise ValueError("K6_ATTN=auto must be resolved for a device first (k6fast.dit.arch.resolve_auto)")
        self.kind = options.attn
        self.sites = SITE_SETS[options.quant_attn_sites]
        self.exact_blocks = options.exact_attn_blocks
        self.exact_steps = options.exact_attn_steps
        self.step = 0
        self.block_quantized = False  # the policy's verdict for the block running now
        self.counts: Counter[tuple[str, str]] = Counter()  # (backend, site) → calls
        self._backends = exact_sdpa_backends(device)
        self.exact_kernel = options.exact_attn_kernel
        self._sage = None
        if self.kind == "sage":
            try:
                from sageattention import sageattn
            except ImportError as exc:
                raise SwitchError(
                    "Unable to use K6_ATTN='sage': the sageattention package is not installed "
                    f"(pip install 'k6fast[sage]'); expected one of exact, k6, sage with its package present ({exc})"
                ) from exc
            self._sage = sageattn

    def begin_step(self, step: int) -> None:
        self.step = step

    def quantizes_block(self, block: int, num_blocks: int) -> bool:
        """Whether a quantized backend may run in this block at the current step (first/last blocks and first
        steps stay exact)."""
        if self.kind == "exact" or self.step < self.exact_steps:
            return False
        return self.exact_blocks <= block < num_blocks - self.exact_blocks

    def begin_block(self, block: int, num_blocks: int) -> None:
        self.block_quantized = self.quantizes_block(block, num_blocks)

    def quantized_here(self, site: str, masked: bool, head_dim: int) -> bool:
        if not self.block_quantized or masked or site not in self.sites:
            return False
        if self.kind == "k6" and head_dim not in SUPPORTED_HEAD_DIMS:
            if not torch.compiler.is_compiling():
                _log_once(f"K6_ATTN=k6: head_dim {head_dim} is not one of {SUPPORTED_HEAD_DIMS}; using exact")
            return False
        return True

    def _count(self, kind: str, site: str) -> None:
        # Counting is Python state: inside a compiled block it would become a guard and force recompiles.
        if not torch.compiler.is_compiling():
            self.counts[(kind, site)] += 1

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, site: str, mask: Tensor | None) -> Tensor:
        """q: [B, Nq, H, D], k/v: [B, Nk, H, D], mask: bool [B, Nk] or None → [B, Nq, H, D]."""
        if self.quantized_here(site, mask is not None, q.shape[-1]):
            self._count(self.kind, site)
            if self.kind == "sage":
                return self._sage(q, k, v, tensor_layout="NHD", is_causal=False)
            from ..kernels.quant_attention import quant_attention_op

            # The kernel takes bf16/fp16 (it quantizes to INT8/FP8 anyway); an fp32 run hands it bf16.
            dt = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
            q_, k_, v_ = (t.transpose(1, 2).to(dt).contiguous() for t in (q, k, v))
            return quant_attention_op(q_, k_, v_).transpose(1, 2).to(q.dtype)
        if mask is None and self.exact_kernel == "k6":
            from ..kernels.flash_attention_wgmma import flash_attention_op, flash_attention_supported

            if flash_attention_supported(q, k, v):
                self._count("exact_k6", site)
                return flash_attention_op(q, k, v)
        self._count("exact", site)
        attn_mask = None if mask is None else mask[:, None, None, :]
        from torch.nn.attention import sdpa_kernel

        ctx = sdpa_kernel(self._backends, set_priority=True) if q.is_cuda else contextlib.nullcontext()
        with ctx:
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 attn_mask=attn_mask)  # fmt: skip
        return out.transpose(1, 2)
