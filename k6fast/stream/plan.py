"""The residency planner: from the VRAM budget and the geometry, what stays on the device and what streams.

Arithmetic on the safetensors index alone (no PyTorch), so `k6fast doctor` plans exactly as the runtime does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..dit.config import BLOCK_PREFIX, held_itemsize
from ..memory import PLANNER_RESERVE_BYTES, GiB
from ..safetensors_index import DF11Location, TensorLocation

# Peak activation bytes of one fused block per (video token x model_dim) for k6fast's exact BF16 block: the fp32
# AdaLN temporaries (x.float(), the normalised copy, the affine result: 12 bytes) and the feed-forward's 4x-wide
# hidden state and GELU output (16 bytes) on top of the bf16 stream, plus what the runtime keeps beside the blocks
# (RoPE tables, text states, latents). The reference arm's peak in the full-size acceptance run needed a little more
# than 32 (measurements/sessions/2026-12-01_acceptance-full; tests/test_acceptance_record.py holds the estimate
# against it); 36 leaves a margin.
ACTIVATION_BYTES_PER_TOKEN_DIM = 36
# What the lossy arms hold on top, per video token. fp8 GEMMs: the e4m3 copy of each layer's input (the
# feed-forward's hidden state is the widest, ff_dim bytes) and of the block's stream (model_dim). Quantized attention:
# head-major bf16 copies of q, k and v (6 x model_dim) and their 8-bit forms (3 x model_dim).
FP8_GEMM_EXTRA_PER_DIM = 1  # x (ff_dim + model_dim)
QUANT_ATTENTION_EXTRA_PER_DIM = 9  # x model_dim
RESERVE_BYTES = PLANNER_RESERVE_BYTES  # the planner's share of the one memory budget (k6fast/memory.py)


class ResidencyError(ValueError):
    """The VRAM budget cannot hold what the DiT needs even when streaming."""


@dataclass(frozen=True)
class ResidencyPlan:
    budget_bytes: int
    fixed_bytes: int  # embeddings, text blocks, heads: always resident
    block_bytes: int  # one fused block
    num_blocks: int
    resident_blocks: int  # blocks 0..resident_blocks-1 stay on the device
    slots: int  # device buffers the other blocks stream through (0 when nothing streams)
    activation_bytes: int
    text_bytes: int = 0  # the text phase's peak: it runs in the activations' room, before denoising

    @property
    def streamed_blocks(self) -> int:
        return self.num_blocks - self.resident_blocks

    @property
    def weight_bytes(self) -> int:
        return self.fixed_bytes + self.resident_blocks * self.block_bytes + self.slots * self.block_bytes

    def as_dict(self) -> dict[str, int]:
        return {
            "budget_bytes": self.budget_bytes,
            "fixed_bytes": self.fixed_bytes,
            "block_bytes": self.block_bytes,
            "num_blocks": self.num_blocks,
            "resident_blocks": self.resident_blocks,
            "slots": self.slots,
            "weight_bytes": self.weight_bytes,
            "activation_bytes": self.activation_bytes,
            "text_bytes": self.text_bytes,
            "reserve_bytes": RESERVE_BYTES,
        }

    def describe(self) -> str:
        gib = lambda n: f"{n / GiB:.2f} GiB"  # noqa: E731
        lines = [
            f"residency plan (budget {gib(self.budget_bytes)}):",
            f"  resident: embeddings/text blocks/heads {gib(self.fixed_bytes)} + {self.resident_blocks} of "
            f"{self.num_blocks} fused blocks x {gib(self.block_bytes)}",
        ]
        if self.streamed_blocks:
            lines.append(
                f"  streamed: {self.streamed_blocks} blocks through {self.slots} device slots "
                f"({gib(self.slots * self.block_bytes)}), prefetched {self.slots - 1} ahead"
            )
        lines.append(f"  activations (estimate) {gib(self.activation_bytes)}, reserve {gib(RESERVE_BYTES)}")
        if self.text_bytes:
            lines.append(f"  text phase {gib(self.text_bytes)}, in the activations' room (it runs before denoising)")
        return "\n".join(lines)


def block_of(name: str) -> int | None:
    """The fused block a checkpoint tensor belongs to, None for the always-resident rest."""
    if not name.startswith(BLOCK_PREFIX):
        return None
    return int(name[len(BLOCK_PREFIX) :].split(".", 1)[0])


def weight_footprint(
    entries: Iterable[tuple[str, int, int, bool]], num_blocks: int, compute_itemsize: int
) -> tuple[int, int]:
    """(fixed bytes, largest fused block's bytes) as held on the device, from (name, elements, stored itemsize,
    floating) per tensor.

    Counted in the dtype each tensor computes in: resident blocks keep their modulation layers in fp32 (≈ 150 MB
    more than the bf16 file holds per Pro block), and a streamed slot holds the stored bytes plus the same fp32
    copies while its block runs, so one figure covers both."""
    fixed, blocks = 0, [0] * num_blocks
    for name, elements, itemsize, floating in entries:
        held = elements * held_itemsize(name, itemsize, floating, compute_itemsize)
        b = block_of(name)
        if b is None:
            fixed += held
        else:
            blocks[b] += held
    return fixed, max(blocks)


def index_footprint(index: Mapping[str, TensorLocation], num_blocks: int, compute_itemsize: int) -> tuple[int, int]:
    """`weight_footprint` of a checkpoint's transformer, from its safetensors index."""
    entries = ((name, loc.elements, loc.itemsize, loc.floating) for name, loc in index.items())
    return weight_footprint(entries, num_blocks, compute_itemsize)


def landing_bytes(index: Mapping[str, TensorLocation], num_blocks: int) -> int:
    """The device buffer a checkpoint with DF11 blobs streams through (`BlockStreamer`: a block's stored bytes land
    there and are decoded into its slot): its largest block as stored, with the slot's 256-byte alignment; 0 without
    blobs. Counted with the fixed weights, whether or not a block ends up streamed."""
    if not any(isinstance(loc, DF11Location) for loc in index.values()):
        return 0
    blocks = [0] * num_blocks
    for name, loc in index.items():
        if (b := block_of(name)) is not None:
            blocks[b] += (loc.nbytes + 255) // 256 * 256
    return max(blocks)


def activation_estimate(
    video_tokens: int,
    audio_tokens: int,
    model_dim: int,
    model_dim_a: int,
    *,
    ff_dim: int = 0,
    fp8_gemm: bool = False,
    quant_attention: bool = False,
) -> int:
    """Bytes the DiT's activations may take at their peak (one fused block's live set), for the arm's kernels.
    Held against peaks measured on the GPU: tests/test_residency_gpu.py (one block) and the full-size acceptance
    record (tests/test_acceptance_record.py)."""
    per_token = ACTIVATION_BYTES_PER_TOKEN_DIM * model_dim
    if fp8_gemm:
        per_token += FP8_GEMM_EXTRA_PER_DIM * (ff_dim + model_dim)
    if quant_attention:
        per_token += QUANT_ATTENTION_EXTRA_PER_DIM * model_dim
    return per_token * video_tokens + ACTIVATION_BYTES_PER_TOKEN_DIM * audio_tokens * model_dim_a


def activation_profile(gemm: str, attn: str, stored_fp8: bool) -> dict[str, bool]:
    """Which lossy kernels hold activations beyond the exact block's, from the GEMM and attention kinds that run
    (after `auto` is resolved): fp8 GEMMs (whatever K6_GEMM says when the checkpoint stores e4m3 weights) and
    quantized attention. `activation_estimate`'s keyword arguments."""
    return {"fp8_gemm": gemm == "fp8" or stored_fp8, "quant_attention": attn != "exact"}


def plan_residency(
    *,
    budget_bytes: int,
    fixed_bytes: int,
    block_bytes: int,
    num_blocks: int,
    activation_bytes: int,
    prefetch: int = 1,
    max_resident: int | None = None,
    text_bytes: int = 0,
) -> ResidencyPlan:
    """As many fused blocks resident as fit after the fixed weights, activations, reserve and `prefetch + 1`
    streaming slots; `max_resident` caps them (so a reduced-depth synthetic model streams the full model's share).
    The text phase (`text_bytes` at its peak) runs before denoising, in the room the activations take later: the
    larger of the two is kept free. Raises ValueError when not even the streaming minimum fits."""
    if prefetch < 1:
        raise ValueError(f"prefetch distance must be >= 1 block, found {prefetch}")
    room = max(activation_bytes, text_bytes)
    free = budget_bytes - fixed_bytes - room - RESERVE_BYTES
    slots = prefetch + 1
    if free >= num_blocks * block_bytes and (max_resident is None or max_resident >= num_blocks):
        return ResidencyPlan(
            budget_bytes, fixed_bytes, block_bytes, num_blocks, num_blocks, 0, activation_bytes, text_bytes
        )
    if free < slots * block_bytes:
        need = fixed_bytes + room + RESERVE_BYTES + slots * block_bytes
        what = "the activations of this geometry" if activation_bytes >= text_bytes else "the text phase"
        raise ResidencyError(
            f"the VRAM budget of {budget_bytes / GiB:.1f} GiB cannot hold the DiT's fixed weights "
            f"({fixed_bytes / GiB:.1f} GiB), {slots} streaming slots and {what} ({room / GiB:.1f} GiB): at least "
            f"{need / GiB:.1f} GiB is needed"
        )
    resident = min(num_blocks - 1, (free - slots * block_bytes) // block_bytes)
    if max_resident is not None:
        resident = min(resident, max_resident)
    slots = min(slots, num_blocks - resident)
    return ResidencyPlan(
        budget_bytes, fixed_bytes, block_bytes, num_blocks, int(resident), slots, activation_bytes, text_bytes
    )
