"""The residency planner: from the VRAM budget and the geometry, what stays on the device and what streams.

Arithmetic on the safetensors index alone (no PyTorch), so `k6fast doctor` plans exactly as the runtime does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..dit.config import BLOCK_PREFIX, held_itemsize
from ..memory import PLANNER_RESERVE_BYTES, GiB, HostMemory
from ..safetensors_index import DF11Location, TensorLocation
from ..switches.registry import AUTO, SwitchError

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


class HostCacheError(SwitchError):
    """K6_HOST_CACHE_GB asks for more host memory than this host can spare: a switch value this host cannot use, so
    the entry points report it as they report any other."""


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
    host_blocks: int = 0  # streamed blocks held in host memory (the host tier), read from disk once
    host_bytes: int = 0  # their stored bytes

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
            "host_blocks": self.host_blocks,
            "host_bytes": self.host_bytes,
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
        if self.host_blocks:
            lines.append(
                f"  host tier: the last {self.host_blocks} streamed blocks held in host memory "
                f"({gib(self.host_bytes)}), read from disk once"
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


# Device slot offsets: every tensor of a streamed block starts on a 256-byte boundary in its slot, and so in the
# host buffers its stored bytes are read into (`streamer.BlockLayout`).
SLOT_ALIGN = 256


def slot_aligned(nbytes: int) -> int:
    return (nbytes + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN


def stored_block_bytes(index: Mapping[str, TensorLocation], num_blocks: int) -> list[int]:
    """Each fused block's stored bytes as one read of it lays them out (`streamer.BlockLayout.nbytes`: each tensor at
    a 256-byte boundary): what a staging buffer, the landing buffer and the host tier hold per block, and what the
    disk gives when the block is not in the page cache."""
    blocks = [0] * num_blocks
    for name, loc in index.items():
        if (b := block_of(name)) is not None:
            blocks[b] += slot_aligned(loc.nbytes)
    return blocks


def landing_bytes(index: Mapping[str, TensorLocation], num_blocks: int) -> int:
    """The device buffer a checkpoint with DF11 blobs streams through (`BlockStreamer`: a block's stored bytes land
    there and are decoded into its slot): its largest block as stored; 0 without blobs. Counted with the fixed
    weights, whether or not a block ends up streamed."""
    if not any(isinstance(loc, DF11Location) for loc in index.values()):
        return 0
    return max(stored_block_bytes(index, num_blocks))


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


def plan_host_cache(setting: str | float, streamed: Sequence[tuple[int, int]], host: HostMemory) -> tuple[int, ...]:
    """The streamed blocks the host tier holds, from K6_HOST_CACHE_GB (`setting`: "auto", 0 = off, or GiB).
    streamed: (block, stored bytes) in the order every forward streams them. Raises HostCacheError when a number
    is more than `host` can spare (`HostMemory.cache_room_bytes`).

    The tier is a run at the end of the cycle: residency is always a prefix of the blocks and a request's own plan
    never keeps more resident than the plan the runtime was built with, so the last streamed blocks stream under
    every plan `DiTRuntime.fit` may choose, and their memory is never held for a block that has become resident."""
    room, total = host.cache_room_bytes, sum(n for _, n in streamed)
    if setting == AUTO:
        # Each step scans the streamed blocks in the same order. When they fit the page cache it serves every step
        # after the first, and a tier would only cost load time and locked memory. When they do not, a cyclic
        # scan larger than an LRU cache evicts each block just before its next use: every block outside the tier
        # comes from disk each step, whatever room the page cache keeps, so the tier takes all the room there is.
        # The text encoders' files lose their cached pages to it: they are read once per request, a block once per
        # step.
        if total <= room:
            return ()
        want = room
    else:
        want = int(float(setting) * GiB)
        if want > room:
            raise HostCacheError(
                f"K6_HOST_CACHE_GB={float(setting):g} is more than this host can spare for it: "
                f"{room / GiB:.1f} GiB ({host.room_source} less the reserve for the "
                f"OS and this process, k6fast/memory.py); expected at most {room / GiB:.1f}, 0 (off) or auto"
            )
    chosen, used = [], 0
    for block, nbytes in reversed(streamed):
        if used + nbytes > want:
            break
        chosen.append(block)
        used += nbytes
    return tuple(reversed(chosen))


def disk_bytes_per_step(streamed_bytes: int, host_bytes: int, host: HostMemory) -> int:
    """Bytes a steady denoising step reads from disk when `streamed_bytes` (stored) stream each step and
    `host_bytes` of them sit in the host tier. The streamed blocks are all a step reads (the resident ones and the
    fixed weights are on the device; the text encoders are read once per request); the rest is the page cache's
    rule in `plan_host_cache`: what is outside the tier is read whole when it does not fit the room the tier
    leaves, and not at all when it does."""
    rest = streamed_bytes - host_bytes
    return 0 if rest <= host.cache_room_bytes - host_bytes else rest
