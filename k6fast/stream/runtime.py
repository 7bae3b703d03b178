"""Builds the DiT for a device from its weight files and config: fixed weights and the planned resident blocks
uploaded once, the rest streamed."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ..allocator import resolve_device
from ..dit.backend import Backend
from ..dit.config import DiTConfig, block_prefix
from ..dit.model import K6DiT
from ..memory import HostMemory, host_memory
from ..safetensors_index import TensorLocation, index_safetensors
from ..switches.registry import AUTO
from .host_cache import HostBlockCache
from .plan import (
    ResidencyPlan,
    activation_estimate,
    activation_profile,
    block_of,
    index_footprint,
    landing_bytes,
    plan_host_cache,
    plan_residency,
    stored_block_bytes,
)
from .reader import FileReader, upload
from .streamer import BlockStreamer, MixedBlocks


@dataclass
class DiTRuntime:
    """The DiT on its device, with the inputs of its residency plan kept so that each request can be planned for its
    own geometry (`fit`): a larger request than the one the runtime was built for streams more blocks, and the
    blocks it sent away come back for the next smaller one."""

    dit: K6DiT
    plan: ResidencyPlan  # the plan in force now
    base_plan: ResidencyPlan  # the plan for the geometry the runtime was built for: at most this many stay resident
    streamer: BlockStreamer | None
    reader: FileReader
    index: Mapping[str, TensorLocation]
    cfg: DiTConfig
    device: torch.device
    dtype: torch.dtype
    planner: Callable[[tuple[int, int]], ResidencyPlan]  # (video, audio) tokens -> the plan at that geometry
    # Seconds per part of `build_dit`: plan (index and residency plan), resident_upload, staging (the host tier's
    # locked buffers, the streamer's pinned staging and device slots), dit_build (the module, its compile wrappers):
    # the start-up profile's parts.
    load_s: dict[str, float] = field(default_factory=dict)
    host_cache: HostBlockCache | None = None  # the host tier: blocks at the end of every plan's streamed run

    def plan_for(self, tokens: tuple[int, int]) -> ResidencyPlan:
        """The plan a request of `tokens` runs under: its own geometry's, never more resident blocks than the base
        plan's (a small request keeps the blocks where they are). Raises ResidencyError when it cannot fit."""
        plan = self.planner(tokens)
        if plan.resident_blocks >= self.base_plan.resident_blocks:
            return self.base_plan
        return plan

    def fit(self, tokens: tuple[int, int]) -> ResidencyPlan:
        """Put the DiT under `plan_for(tokens)`: resident blocks beyond it leave the device and stream, blocks it
        holds resident again are uploaded. The slots and staging are rebuilt only when the plan changes."""
        plan = self.plan_for(tokens)
        if plan == self.plan:
            return plan
        blocks = self.dit.blocks
        keep = plan.resident_blocks
        for i in [b for b in blocks.resident if b >= keep]:
            del blocks.resident[i]
        missing = [loc for name, loc in sorted(self.index.items()) if (b := block_of(name)) is not None
                   and self.plan.resident_blocks <= b < keep]  # fmt: skip
        if self.streamer is not None:
            self.streamer.close()
            self.streamer = None
        blocks.resident.update(_by_block(upload(self.reader, missing, self.device, self.dtype), keep))
        if plan.streamed_blocks:
            self.streamer = BlockStreamer(self.index, self.reader, self.cfg.num_visual_blocks, keep, plan.slots,
                                          self.device, self.dtype, self.host_cache)  # fmt: skip
        blocks.streamer = self.streamer
        self.plan = plan
        return plan

    def take_host_tier(self) -> HostBlockCache | None:
        """The host tier, handed to the caller (who passes it to the next `build_dit` or closes it), so that `close`
        keeps it: the DiT leaves the device for a video decode, and its blocks need not leave the host and be read
        from disk again for that."""
        cache, self.host_cache = self.host_cache, None
        return cache

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.close()  # waits for the copies out of the host tier too
        if self.host_cache is not None:
            self.host_cache.close()
        self.reader.close()


def _by_block(weights: Mapping[str, Tensor], below: int) -> dict[int, dict[str, Tensor]]:
    """Uploaded block tensors grouped per fused block (names relative to the block), blocks < `below` only."""
    out: dict[int, dict[str, Tensor]] = {}
    for name, tensor in weights.items():
        b = block_of(name)
        if b is not None and b < below:
            out.setdefault(b, {})[name[len(block_prefix(b)) :]] = tensor
    return out


def _activation_profile(backend: Backend | None, index: Mapping[str, TensorLocation]) -> dict[str, bool]:
    """`activation_profile` of the switched backend's resolved choices (a plain ExactBackend runs neither)."""
    gemm = getattr(getattr(backend, "gemm", None), "kind", "bf16")
    attn = getattr(getattr(backend, "attn", None), "kind", "exact")
    return activation_profile(gemm, attn, any(loc.dtype == "F8_E4M3" for loc in index.values()))


def build_dit(
    files: Sequence[Path],
    cfg: DiTConfig,
    device: torch.device,
    dtype: torch.dtype,
    *,
    budget_bytes: int,
    tokens: tuple[int, int],
    prefetch: int = 1,
    max_resident: int | None = None,
    backend: Backend | None = None,
    compile_blocks: bool = False,
    text_bytes: int = 0,
    host_cache: str | float = AUTO,
    host: HostMemory | None = None,
    host_tier: HostBlockCache | None = None,
) -> DiTRuntime:
    """The DiT of the checkpoint whose transformer weights are `files` (its shards) and config `cfg`, on `device`
    computing in `dtype`. tokens: (video, audio) token counts of the largest geometry this runtime must serve
    (sizes activations); text_bytes: the text phase's peak, planned in the activations' room; host_cache:
    K6_HOST_CACHE_GB, planned against `host` (default: this host and process now, from /proc); host_tier: the tier
    of an earlier runtime of these files (`DiTRuntime.take_host_tier`), kept where this plan streams its blocks."""
    start = time.perf_counter()
    device = resolve_device(device)
    index = index_safetensors(files)
    fixed_bytes, block_bytes = index_footprint(index, cfg.num_visual_blocks, dtype.itemsize)
    fixed_bytes += landing_bytes(index, cfg.num_visual_blocks)
    profile = _activation_profile(backend, index)

    def planner(at: tuple[int, int]) -> ResidencyPlan:
        return plan_residency(
            budget_bytes=budget_bytes,
            fixed_bytes=fixed_bytes,
            block_bytes=block_bytes,
            num_blocks=cfg.num_visual_blocks,
            activation_bytes=activation_estimate(
                at[0], at[1], cfg.model_dim, cfg.model_dim_a, ff_dim=cfg.ff_dim, **profile
            ),
            prefetch=prefetch,
            max_resident=max_resident,
            text_bytes=text_bytes,
        )

    plan = planner(tokens)
    laps = [("plan", time.perf_counter())]
    reader = FileReader({loc.file for loc in index.values()})
    resident_names = [
        loc for name, loc in sorted(index.items()) if (b := block_of(name)) is None or b < plan.resident_blocks
    ]
    weights = upload(reader, resident_names, device, dtype)
    laps.append(("resident_upload", _synced(device)))
    # Planned after the upload: MemAvailable then counts this process's memory out and the resident blocks' pages
    # (cached, reclaimable) in.
    cache = _host_tier(index, cfg.num_visual_blocks, plan, host_cache, host, device, host_tier)
    if cache is not None:
        # Every plan of this runtime streams the tier's blocks (see `plan_host_cache`), so every plan reports it.
        tier = {"host_blocks": len(cache.blocks), "host_bytes": cache.nbytes}
        plan = dataclasses.replace(plan, **tier)
        planner = _with_tier(planner, tier)
    resident = _by_block(weights, plan.resident_blocks)
    # The fused blocks' tensors live in `resident` only, so that a block sent to the stream by `fit` frees its memory.
    fixed = {name: t for name, t in weights.items() if block_of(name) is None}
    streamer = None
    if plan.streamed_blocks:
        streamer = BlockStreamer(index, reader, cfg.num_visual_blocks, plan.resident_blocks, plan.slots, device, dtype,
                                 cache)  # fmt: skip
    laps.append(("staging", _synced(device)))
    dit = K6DiT(cfg, fixed, backend=backend, blocks=MixedBlocks(resident, streamer))
    if compile_blocks:
        dit.compile_blocks()
    laps.append(("dit_build", time.perf_counter()))
    marks = [start] + [at for _, at in laps]
    load_s = {name: at - marks[i] for i, (name, at) in enumerate(laps)}
    return DiTRuntime(dit, plan, plan, streamer, reader, index, cfg, device, dtype, planner, load_s, cache)


def _host_tier(
    index: Mapping[str, TensorLocation],
    num_blocks: int,
    plan: ResidencyPlan,
    setting: str | float,
    host: HostMemory | None,
    device: torch.device,
    kept: HostBlockCache | None,
) -> HostBlockCache | None:
    """The host tier for `plan`'s streamed blocks under K6_HOST_CACHE_GB (`setting`), or None when it holds none.
    A size this host cannot spare is refused even when nothing streams: the same setting would fail on the next
    larger request or budget, and should fail where it was set."""
    if kept is not None:
        if kept.blocks and min(kept.blocks) >= plan.resident_blocks:
            # Kept whole, not planned again: MemAvailable no longer counts its own memory in.
            return kept
        kept.close()
    if setting == 0:
        return None
    stored = stored_block_bytes(index, num_blocks)
    sizes = {b: stored[b] for b in range(plan.resident_blocks, num_blocks)}
    blocks = plan_host_cache(setting, list(sizes.items()), host if host is not None else host_memory())
    if not blocks:
        return None
    cache = HostBlockCache({b: sizes[b] for b in blocks}, device)
    if not cache.blocks:
        cache.close()
        return None
    return cache


def _with_tier(planner: Callable[[tuple[int, int]], ResidencyPlan], tier: dict[str, int]):
    """`planner` with the tier in every plan that streams: `plan_for` and `fit` compare a request's plan with the one
    in force, and a plan without the tier's figures would differ from it and refit the DiT for every request."""

    def planned(at: tuple[int, int]) -> ResidencyPlan:
        plan = planner(at)
        return dataclasses.replace(plan, **tier) if plan.streamed_blocks else plan

    return planned


def _synced(device: torch.device) -> float:
    """The time once the device has finished what was queued on it (the uploads' copies may run ahead of the host)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
