"""Attention dispatch per call site: exact attention (SDPA with the fastest backend for the architecture, chosen once;
flash-attn-4 where the switch asks and it runs), k6fast's INT8/FP8 kernel or the `sageattention` package, and
block-sparse video self-attention, by block and by step.

Exact calls run PyTorch SDPA, or with `K6_EXACT_ATTN_KERNEL=fa4` flash-attn-4 where it is installed and runs (sm_90,
sm_100, sm_120; unmasked); both exact by the flash-attention rule. Where flash-attn-4 cannot run, SDPA does, logged
once.

Policy (switches): a lossy arm (a quantized `K6_ATTN=k6|sage` on the sites `K6_QUANT_ATTN_SITES` names, block-sparse
video self-attention with `K6_SPARSE_ATTN`) runs everywhere except in the first and last `K6_EXACT_ATTN_BLOCKS` fused
blocks, the first `K6_EXACT_ATTN_STEPS` steps, where errors would propagate through every later block or step, and
the last `K6_EXACT_ATTN_LAST_STEPS` steps, which set the final detail (the policy Radial Attention's dense layers and
timesteps also follow; its users found few-step runs need the last step dense). Where both lossy arms could take video
self-attention, the sparse one does (it skips the work instead of cheapening it). A masked call always goes exact.

The sparse arm needs the video tokens in 3-D tiles (k6fast/kernels/tile_mask.py): the DiT asks `video_token_order` once
per forward, permutes its tokens and RoPE tables, and undoes the order before the head. With the arm off it gets
None and nothing moves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections import Counter

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..kernels import fa4_attention, quant_attention, sparse_attention, tile_mask
from ..kernels.exact_attention import sdpa
from ..kernels.tile_mask import TokenOrder
from ..switches import Options, SwitchError
from .config import ATTENTION_SITES

logger = logging.getLogger(__name__)
SUPPORTED_HEAD_DIMS = (64, 128)  # k6fast's quantized kernel (Pro 128, Lite 64)


@functools.cache
def log_once(message: str) -> None:
    """Log `message` as a warning the first time it is given in this process (`log_once.cache_clear()` forgets)."""
    logger.warning(message)


SITE_SETS = {
    "video_self": frozenset({"video_self"}),
    "self": frozenset({"video_self", "audio_self"}),
    "all": frozenset(ATTENTION_SITES) - {"text_self"},  # text blocks always run exact
}


def exact_sdpa_backends(device: torch.device) -> list:
    """SDPA backends in order of preference: cuDNN first on Hopper (much faster than flash at W1 on an H200,
    measurements/sessions/2026-11-29_exact-attention/README.md), flash first elsewhere; the others stay as fallbacks
    for shapes a backend refuses."""
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
        self.options = options  # its K6_EXACT_ATTN_* policy (`Options.lossy_attention_at`)
        self.step = 0
        self.num_steps: int | None = None  # the schedule's length, when the caller says it (the last-steps rule)
        self.block_quantized = False  # the policy's verdict for the block running now
        self.counts: Counter[tuple[str, str]] = Counter()  # (backend, site) → calls
        self._backends = exact_sdpa_backends(device)
        self.exact_kernel = options.exact_attn_kernel
        self._fa4 = self.exact_kernel == "fa4" and fa4_runs_on(device)
        self.sparse_density = options.sparse_attn
        self.sparse_window = options.sparse_attn_window
        self.block_sparse = False  # the policy's verdict on sparse video self-attention for the block running now
        self._order: TokenOrder | None = None
        self._order_key: tuple | None = None
        self._window: torch.Tensor | None = None
        self._device = device
        self.choices = self._describe(device)
        logger.info("attention on %s: %s", device, ", ".join(f"{k} {v}" for k, v in self.choices.items()))
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

    def begin_step(self, step: int, num_steps: int | None = None) -> None:
        self.step, self.num_steps = step, num_steps

    def lossy_block(self, block: int, num_blocks: int) -> bool:
        """Whether a lossy arm may run in this block at the current step (first/last blocks and first/last steps stay
        exact; the last steps only where the schedule's length is known)."""
        return self.options.lossy_attention_at(self.step, self.num_steps, block, num_blocks)

    def quantizes_block(self, block: int, num_blocks: int) -> bool:
        """Whether a quantized backend may run in this block at the current step."""
        return self.kind != "exact" and self.lossy_block(block, num_blocks)

    def sparsifies_block(self, block: int, num_blocks: int) -> bool:
        """Whether video self-attention runs block-sparse in this block at the current step."""
        return self.sparse_density > 0.0 and self.lossy_block(block, num_blocks)

    def begin_block(self, block: int, num_blocks: int) -> None:
        self.block_quantized = self.quantizes_block(block, num_blocks)
        self.block_sparse = self.sparsifies_block(block, num_blocks)

    def video_token_order(
        self, grid: tuple[int, int, int], positions: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    ) -> TokenOrder | None:
        """The order the DiT puts its video tokens in for this forward: None with the sparse arm off, else the tiled
        order of the (T, H, W) `grid` with frames by their temporal RoPE position (`positions[0]`; default
        0..T-1). Built once per geometry; the window of its blocks with it."""
        if self.sparse_density == 0.0:
            self._order = None
            return None
        t_positions = None if positions is None else tuple(int(p) for p in positions[0].tolist())
        key = (tuple(int(n) for n in grid), t_positions)
        if key != self._order_key:
            order = tile_mask.tile_order(grid, t_positions)
            self._window = tile_mask.window_blocks(order, self.sparse_window).to(self._device)
            dev = self._device
            self._order = dataclasses.replace(order, perm=order.perm.to(dev), inverse=order.inverse.to(dev))
            self._order_key = key
        return self._order

    @property
    def token_order(self) -> TokenOrder | None:
        """The order of the video tokens in the current forward: what `video_token_order` last returned."""
        return self._order

    @property
    def key_window(self) -> torch.Tensor | None:
        """The sparse arm's window for the current order, bool [num_blocks, num_blocks]: the key blocks each query
        block keeps whatever their scores (`kernels.tile_mask.window_blocks`); None before the first order."""
        return self._window

    def sparse_here(self, site: str, masked: bool, q: Tensor, k: Tensor) -> bool:
        order = self._order
        return (
            self.block_sparse
            and site == "video_self"
            and not masked
            and order is not None
            and q.shape[1] == k.shape[1] == order.num_tokens
        )

    def quantized_here(self, site: str, masked: bool, head_dim: int) -> bool:
        if not self.block_quantized or masked or site not in self.sites:
            return False
        if self.kind == "k6" and head_dim not in SUPPORTED_HEAD_DIMS:
            if not torch.compiler.is_compiling():
                log_once(f"K6_ATTN=k6: head_dim {head_dim} is not one of {SUPPORTED_HEAD_DIMS}; using exact")
            return False
        return True

    def _count(self, kind: str, site: str) -> None:
        # Counting is Python state: inside a compiled block it would become a guard and force recompiles.
        if not torch.compiler.is_compiling():
            self.counts[(kind, site)] += 1

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, site: str, mask: Tensor | None) -> Tensor:
        """q: [B, Nq, H, D], k/v: [B, Nk, H, D], mask: bool [B, Nk] or None → [B, Nq, H, D]."""
        if self.sparse_here(site, mask is not None, q, k):
            self._count("sparse", site)
            kv_idx, kv_cnt = tile_mask.build_block_mask(q, k, self._window, self.sparse_density)
            return sparse_attention.sparse_attention_op(q, k, v, kv_idx, kv_cnt)
        if self.quantized_here(site, mask is not None, q.shape[-1]):
            self._count(self.kind, site)
            if self.kind == "sage":
                return self._sage(q, k, v, tensor_layout="NHD", is_causal=False)
            # The kernel takes bf16/fp16 (it quantizes to INT8/FP8 anyway); an fp32 run hands it bf16.
            dt = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
            q_, k_, v_ = (t.transpose(1, 2).to(dt).contiguous() for t in (q, k, v))
            return quant_attention.quant_attention_op(q_, k_, v_).transpose(1, 2).to(q.dtype)
        if mask is None and self._fa4:
            if fa4_attention.fa4_shapes_ok(q, k, v):
                self._count("exact_fa4", site)
                return fa4_attention.fa4_attention_op(q, k, v)
            if not torch.compiler.is_compiling():
                log_once(f"K6_EXACT_ATTN_KERNEL=fa4: {q.dtype} head_dim {q.shape[-1]} is not taken; using SDPA")
        self._count("exact", site)
        ctx = sdpa_kernel(self._backends, set_priority=True) if q.is_cuda else contextlib.nullcontext()
        with ctx:
            return sdpa(q, k, v, mask)

    def _describe(self, device: torch.device) -> dict[str, str]:
        """What the exact and sparse arms run on `device`, for the start-up log and records."""
        exact = "sdpa"
        if self.exact_kernel == "fa4":
            exact = f"flash-attn-4 {fa4_attention.fa4_version()}" if self._fa4 else "sdpa (flash-attn-4 unavailable)"
        choices = {"exact": exact}
        if self.sparse_density > 0.0:
            implementation = sparse_attention.implementation_for(device)
            choices["sparse"] = f"density {self.sparse_density}, window {self.sparse_window}, {implementation}"
        return choices


def fa4_runs_on(device: torch.device) -> bool:
    """Whether flash-attn-4 runs on `device`; the reason it does not is logged once (exact calls then run SDPA)."""
    reason = fa4_attention.fa4_unavailable_reason(device)
    if reason is not None:
        log_once(f"K6_EXACT_ATTN_KERNEL=fa4: {reason}; exact attention runs PyTorch SDPA")
    return reason is None
