"""PyTorch's CUDA caching allocator, configured for a run that fills a card to its budget.

The DiT phase at W1 on a 32 GiB budget holds most of the budget in weights and reallocates multi-GiB activations (the
feed-forward's hidden state, the attention inputs) every block. With fixed-size segments those allocations
fragment the reserved memory until a large one no longer fits (the full-size acceptance run met such an OOM with GiBs
reserved but unallocated: measurements/sessions/2026-12-01_acceptance-full). Expandable segments map physical pages
into one growing virtual range instead, so freed room is reusable for any size. `device_budget` caps the allocator
at the VRAM budget.

PyTorch reads `PYTORCH_CUDA_ALLOC_CONF` when CUDA first initialises, so the command line sets it before anything
touches CUDA; a library user who builds a `Pipeline` after CUDA started gets the same setting through the
allocator's runtime switch. A user's own `expandable_segments` choice is left alone.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from .memory import OUTSIDE_ALLOCATOR_BYTES, GiB

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

ENV = "PYTORCH_CUDA_ALLOC_CONF"
SETTING = "expandable_segments:True"


def _user_chose(environ: dict[str, str] | os._Environ) -> bool:
    return "expandable_segments" in environ.get(ENV, "")


def configure_environment(environ: dict[str, str] | os._Environ | None = None) -> bool:
    """Before CUDA starts (the CLI's first step): ask for expandable segments in the environment, keeping any other
    allocator options the user set. Returns True when it changed the environment."""
    environ = os.environ if environ is None else environ
    if _user_chose(environ):
        return False
    current = environ.get(ENV, "").strip().strip(",")
    environ[ENV] = f"{current},{SETTING}" if current else SETTING
    return True


def configure_runtime() -> None:
    """From inside a process where CUDA may already run (a `Pipeline` built by library code): switch the allocator
    to expandable segments for the segments it creates from now on, unless the user chose otherwise."""
    import torch

    if _user_chose(os.environ) or not torch.cuda.is_available():
        return
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None:  # a PyTorch without the runtime switch: the environment variable is the only way
        logger.warning("this PyTorch cannot switch on expandable segments at run time; set %s=%s", ENV, SETTING)
        return
    try:
        setter(SETTING)
    except RuntimeError as exc:  # keep running with fixed segments: slower to fit, not wrong
        logger.warning("could not switch the CUDA allocator to expandable segments (%s); set %s=%s", exc, ENV, SETTING)


def resolve_device(device: torch.device | str) -> torch.device:
    """`cuda` → `cuda:N` (the current device): CUDA memory and stream APIs need an explicit index."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def device_budget(device: torch.device, budget_gb: float) -> int:
    """The VRAM budget in bytes: the switch's value, or, at 0, what the card has free now (the CUDA context, a
    display and other programs already hold the rest) less what CUDA will add outside the allocator. A budget larger
    than that is lowered to it, with a warning: on a 32 GB card a 32 GiB budget would run out of device memory
    outside PyTorch's accounting. The budget is enforced through the caching allocator, so an H200 behaves like a
    32 GB card."""
    import torch

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
