"""Builds the DiT for a device from its weight files and config: fixed weights and the planned resident blocks
uploaded once, the rest streamed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..allocator import resolve_device
from ..dit.backend import Backend
from ..dit.config import DiTConfig
from ..dit.model import K6DiT
from ..safetensors_index import TensorLocation, index_safetensors
from .plan import (
    BLOCK_PREFIX,
    ResidencyPlan,
    activation_estimate,
    block_of,
    index_footprint,
    plan_residency,
)
from .reader import FileReader, upload
from .streamer import BlockStreamer, MixedBlocks


@dataclass
class DiTRuntime:
    dit: K6DiT
    plan: ResidencyPlan
    streamer: BlockStreamer | None
    reader: FileReader

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.close()
        self.reader.close()


def _activation_profile(backend: Backend | None, index: Mapping[str, TensorLocation]) -> dict[str, bool]:
    """Which lossy kernels run, for the activation estimate: the switched backend's resolved choices (a plain
    ExactBackend runs neither), and fp8 GEMMs whenever the checkpoint stores e4m3 weights (they run whatever
    K6_GEMM says)."""
    gemm = getattr(getattr(backend, "gemm", None), "kind", "bf16")
    attn = getattr(getattr(backend, "attn", None), "kind", "exact")
    stored_fp8 = any(loc.dtype == "F8_E4M3" for loc in index.values())
    return {"fp8_gemm": gemm == "fp8" or stored_fp8, "quant_attention": attn != "exact"}


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
) -> DiTRuntime:
    """The DiT of the checkpoint whose transformer weights are `files` (its shards) and config `cfg`, on `device`
    computing in `dtype`. tokens: (video, audio) token counts of the largest geometry this runtime must serve
    (sizes activations)."""
    device = resolve_device(device)
    index = index_safetensors(files)
    fixed_bytes, block_bytes = index_footprint(index, cfg.num_visual_blocks, dtype.itemsize)
    profile = _activation_profile(backend, index)
    plan = plan_residency(
        budget_bytes=budget_bytes,
        fixed_bytes=fixed_bytes,
        block_bytes=block_bytes,
        num_blocks=cfg.num_visual_blocks,
        activation_bytes=activation_estimate(
            tokens[0], tokens[1], cfg.model_dim, cfg.model_dim_a, ff_dim=cfg.ff_dim, **profile
        ),
        prefetch=prefetch,
        max_resident=max_resident,
    )
    reader = FileReader({loc.file for loc in index.values()})
    resident_names = [
        loc for name, loc in sorted(index.items()) if (b := block_of(name)) is None or b < plan.resident_blocks
    ]
    weights = upload(reader, resident_names, device, dtype)
    resident = {
        i: {k[len(f"{BLOCK_PREFIX}{i}.") :]: v for k, v in weights.items() if block_of(k) == i}
        for i in range(plan.resident_blocks)
    }
    streamer = None
    if plan.streamed_blocks:
        streamer = BlockStreamer(index, reader, cfg.num_visual_blocks, plan.resident_blocks, plan.slots, device, dtype)
    dit = K6DiT(cfg, weights, backend=backend, blocks=MixedBlocks(resident, streamer))
    if compile_blocks:
        dit.compile_blocks()
    return DiTRuntime(dit, plan, streamer, reader)
