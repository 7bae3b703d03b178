"""Builds the DiT for a device: fixed weights and the planned resident blocks uploaded once, the rest streamed."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from ..checkpoint import Checkpoint
from .backend import Backend
from .model import K6DiT
from .residency import BLOCK_PREFIX, GiB, ResidencyPlan, activation_estimate, block_of, plan_residency, weight_footprint
from .weight_stream import BlockStreamer, FileReader, TensorLocation, index_safetensors, upload

logger = logging.getLogger(__name__)


class MixedBlocks:
    """Blocks below `resident` from device memory, the others from the streamer."""

    def __init__(self, resident: dict[int, Mapping[str, Tensor]], streamer: BlockStreamer | None):
        self.resident = resident
        self.streamer = streamer

    def begin_forward(self) -> None:
        if self.streamer is not None:
            self.streamer.begin_forward()

    def get(self, block: int) -> Mapping[str, Tensor]:
        if block in self.resident:
            return self.resident[block]
        return self.streamer.get(block)

    def release(self, block: int) -> None:
        if block not in self.resident:
            self.streamer.release(block)

    def abort_forward(self) -> None:
        if self.streamer is not None:
            self.streamer.abort_forward()


def footprint(
    tensors: Iterable[tuple[str, int, torch.dtype]], num_blocks: int, compute: torch.dtype
) -> tuple[int, int]:
    """(fixed bytes, largest fused block's bytes) as held on the device, from (name, elements, stored dtype)."""
    entries = ((name, n, dtype.itemsize, dtype.is_floating_point) for name, n, dtype in tensors)
    return weight_footprint(entries, num_blocks, compute.itemsize)


def index_footprint(index: Mapping[str, TensorLocation], num_blocks: int, compute: torch.dtype) -> tuple[int, int]:
    entries = ((name, loc.nbytes // loc.dtype.itemsize, loc.dtype) for name, loc in index.items())
    return footprint(entries, num_blocks, compute)


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
    stored_fp8 = any(loc.dtype == torch.float8_e4m3fn for loc in index.values())
    return {"fp8_gemm": gemm == "fp8" or stored_fp8, "quant_attention": attn != "exact"}


def build_dit(
    ckpt: Checkpoint,
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
    """tokens: (video, audio) token counts of the largest geometry this runtime must serve (sizes activations)."""
    cfg = ckpt.dit
    device = resolve_device(device)
    index = index_safetensors(list(ckpt.transformer_files))
    fixed_bytes, block_bytes = index_footprint(index, cfg.num_visual_blocks, dtype)
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


def resolve_device(device: torch.device | str) -> torch.device:
    """`cuda` → `cuda:N` (the current device): CUDA memory and stream APIs need an explicit index."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


# What CUDA adds outside PyTorch's caching allocator once work starts (cuBLAS/cuDNN handles, kernel images of Triton
# and flash-attn-4). The full-size acceptance run saw nvidia-smi's use exceed the allocator's reserved peak by the
# CUDA context plus this much (measurements/sessions/2026-12-01_acceptance-full).
OUTSIDE_ALLOCATOR_BYTES = GiB // 2


def device_budget(device: torch.device, budget_gb: float) -> int:
    """The VRAM budget in bytes: the switch's value, or, at 0, what the card has free now (the CUDA context, a
    display and other programs already hold the rest) less what CUDA will add outside the allocator. A budget larger
    than that is lowered to it, with a warning: on a 32 GB card a 32 GiB budget would run out of device memory
    outside PyTorch's accounting. The budget is enforced through the caching allocator, so an H200 behaves like a
    32 GB card."""
    device = resolve_device(device)
    if device.type != "cuda":
        return int(budget_gb * GiB) if budget_gb > 0 else 1 << 62
    free, total = torch.cuda.mem_get_info(device)
    available = free + torch.cuda.memory_reserved(device) - OUTSIDE_ALLOCATOR_BYTES
    budget = int(budget_gb * GiB) if budget_gb > 0 else available
    if budget > available:
        logger.warning(
            "K6_VRAM_BUDGET_GB=%g is more than this GPU has free for k6fast (%.2f GiB after the CUDA context and other "
            "programs, less %.1f GiB CUDA adds later); planning for %.2f GiB",
            budget_gb, available / GiB, OUTSIDE_ALLOCATOR_BYTES / GiB, available / GiB,
        )  # fmt: skip
        budget = available
    torch.cuda.set_per_process_memory_fraction(budget / total, device)
    return budget
