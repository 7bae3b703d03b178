"""PyTorch's CUDA caching allocator, configured for a run that fills a card to its budget.

The DiT phase at W1 on a 32 GiB budget holds most of the budget in weights and reallocates multi-GiB activations (the
feed-forward's hidden state, the attention inputs) every block. With fixed-size segments those allocations
fragment the reserved memory until a large one no longer fits (the full-size acceptance run met such an OOM with GiBs
reserved but unallocated: measurements/sessions/2026-12-01_acceptance-full). Expandable segments map physical pages
into one growing virtual range instead, so freed room is reusable for any size. `device_budget` says what the
VRAM budget is.

PyTorch reads `PYTORCH_CUDA_ALLOC_CONF` when CUDA first initialises, so the entry points ask for expandable segments
there (`with_expandable`) before anything touches CUDA. A user's own `expandable_segments` choice is left alone.

Nothing here changes the process: setting the allocator and capping it at the budget are the entry points' (k6fast/
entry.py), so that a library user's two pipelines in one process do not re-cap each other.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import TYPE_CHECKING

from .memory import OUTSIDE_ALLOCATOR_BYTES, GiB

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

ENV = "PYTORCH_CUDA_ALLOC_CONF"
SETTING = "expandable_segments:True"
# The granularity an expandable segment maps and unmaps in, by pool (PyTorch's kSmallBuffer and kLargeBuffer, the
# large one unless large_segment_size_mb says otherwise): `empty_cache` gives back only the pages no allocated block
# touches.
EXPANDABLE_PAGE = {"small": 2 << 20, "large": 20 << 20}
DEFAULT_POOL = (0, 0)  # the snapshot's segment_pool_id of the allocator's own pools (not a CUDA graph's or a MemPool's)


def user_chose(conf: str | None) -> bool:
    """Whether the allocator options `conf` (PYTORCH_CUDA_ALLOC_CONF's value) say yes or no to expandable segments."""
    return "expandable_segments" in (conf or "")


def with_expandable(conf: str | None) -> str | None:
    """`PYTORCH_CUDA_ALLOC_CONF` with expandable segments asked for, keeping any other allocator options the user
    set (conf: its current value, None when unset); None when the user already chose either way."""
    if user_chose(conf):
        return None
    current = (conf or "").strip().strip(",")
    return f"{current},{SETTING}" if current else SETTING


def resolve_device(device: torch.device | str | None) -> torch.device:
    """`cuda` → `cuda:N` (the current device): CUDA memory and stream APIs need an explicit index. None: CUDA where
    there is a GPU, else the CPU."""
    import torch

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def device_budget(device: torch.device, budget_gb: float) -> int:
    """The VRAM budget in bytes: the switch's value, or, at 0, what the card has free now (the CUDA context, a
    display and other programs already hold the rest) less what CUDA will add outside the allocator. A budget larger
    than that is lowered to it, with a warning: on a 32 GB card a 32 GiB budget would run out of device memory
    outside PyTorch's accounting. Arithmetic on what the card reports: `entry.cap_device_memory` enforces it."""
    import torch

    device = resolve_device(device)
    if device.type != "cuda":
        return int(budget_gb * GiB) if budget_gb > 0 else 1 << 62
    free = torch.cuda.mem_get_info(device)[0]
    available = free + torch.cuda.memory_reserved(device) - OUTSIDE_ALLOCATOR_BYTES
    budget = int(budget_gb * GiB) if budget_gb > 0 else available
    if budget > available:
        _warn_lowered(
            f"K6_VRAM_BUDGET_GB={budget_gb:g} is more than this GPU has free for k6fast ({available / GiB:.2f} GiB "
            f"after the CUDA context and other programs, less {OUTSIDE_ALLOCATOR_BYTES / GiB:.1f} GiB CUDA adds "
            f"later); planning for {available / GiB:.2f} GiB"
        )
        budget = available
    return budget


def held_bytes(segments: list[dict]) -> int | None:
    """What the caching allocator would still hold after `empty_cache`, from its snapshot's segments on one device
    (`torch.cuda.memory_snapshot()`, one segment per mapped range): the pages of an expandable segment that an
    allocated block touches, a fixed segment whole while any block in it is allocated, a private pool's segment
    (a CUDA graph's, a MemPool's) whole. None where the snapshot lacks what this needs or its pages are not
    `EXPANDABLE_PAGE`'s."""
    held = 0
    try:
        for segment in segments:
            active = [b for b in segment["blocks"] if b["state"] != "inactive"]
            if tuple(segment["segment_pool_id"]) != DEFAULT_POOL:
                held += segment["total_size"]
            elif not segment["is_expandable"]:
                held += segment["total_size"] if active else 0
            else:
                page, base = EXPANDABLE_PAGE[segment["segment_type"]], segment["address"]
                if segment["total_size"] % page or base % EXPANDABLE_PAGE["small"]:
                    return None
                pages = set()
                for block in active:
                    start = block["address"] - base
                    pages.update(range(start // page, (start + block["size"] - 1) // page + 1))
                held += len(pages) * page
    except (KeyError, TypeError):
        return None
    return held


def held_after_release(device: torch.device) -> int | None:
    """What `empty_cache` would leave reserved on `device`, counted without giving anything back, so that the next
    large tensor reuses the mapped memory instead of mapping it again (what that costs a process's first video
    decode: measurements/sessions/2026-12-02_acceptance-envelope4). Where a growth would pass the allocator's cap, the
    allocator gives its free pages back itself first. None where that cannot be relied on: no cap (then it gives them
    back only when the device runs out, past the budget) or expandable pages of a size the user set."""
    import torch

    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if fraction is None or fraction(device) >= 1.0:
        return None
    if any("large_segment_size" in os.environ.get(name, "") for name in ("PYTORCH_ALLOC_CONF", ENV)):
        return None
    return held_bytes([s for s in torch.cuda.memory_snapshot() if s.get("device") == device.index])


@functools.cache
def _warn_lowered(message: str) -> None:
    # Once per message: the entry point's cap and the pipeline's plan ask for the same budget.
    logger.warning(message)
