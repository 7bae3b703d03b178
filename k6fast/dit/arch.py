"""What the GEMM and attention choices mean on each GPU architecture, and why (one arm file serves every card).

K6_GEMM and K6_ATTN are resolved for the device before the backend is built (`resolve_auto`), and for any named
target without one (`resolve_for`, which `k6fast switches` prints for sm_90, sm_100, sm_120, sm_89 and the CPU):

- `auto` GEMM (the near-lossless arms): FP16-accumulate only on GeForce cards (sm_80 and newer), where FP16-accumulate
  MMA runs at twice the FP32-accumulate rate (the build check tests/test_sass_geforce.py proves the kernel issues
  `HMMA.16816.F16` for sm_120 and sm_89); on datacenter cards it has no rate advantage (slower than cuBLAS on an
  H200: measurements/sessions/2026-11-29_h200-followup/README.md), so cuBLAS bf16 stays.
- `auto-lossy` GEMM (the lossy arms): block-scaled MXFP8 on Blackwell (sm_100, sm_12x: on the RTX 5090 twice its
  FP32-accumulate FP8 rate by its published specification; measurements/model_5090.md ranks it) where torchao is
  installed; FP8 row-wise elsewhere from sm_89 (the H200's fastest GEMM measured:
  measurements/sessions/2026-11-29_fp8-outliers/README.md); bf16 below sm_89 and on the CPU.
- K6_GEMM=fp8 on GeForce sm_89/sm_12x becomes `fp8-fp16acc`: the FP16-chunk FP8 GEMM (k6fast/kernels/fp8_fp16acc.py,
  `QMMA.16832.F16` in its SASS) instead of `torch._scaled_mm`'s FP32 accumulation, half rate on those cards.
- K6_GEMM=mxfp8 / nvfp4 where there are no block-scaled tensor cores (Hopper, Ada, older): cuBLAS bf16, said once.
- `auto` attention: k6fast's quantized kernel only on GeForce Ada/Blackwell (sm_89, sm_12x: FP8 P·V), the cards on
  which SageAttention 2 reports its largest gains over FlashAttention 2; on the H200 exact attention is the
  near-lossless choice (measurements/sessions/2026-11-29_exact-attention/README.md). Neither GeForce gain is measured
  here.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only where a device is asked about: `k6fast doctor` resolves the arms without it
    import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
    """A device class the choices depend on: CUDA capability (None for the CPU) and whether it is a GeForce card."""

    name: str
    capability: tuple[int, int] | None
    geforce: bool = False


# The targets `k6fast switches` reports besides the GPU at hand.
TARGETS = (
    Target("sm_90 (H100/H200)", (9, 0)),
    Target("sm_100 (B200)", (10, 0)),
    Target("sm_120 (RTX 50, GeForce)", (12, 0), geforce=True),
    Target("sm_89 (RTX 40, GeForce)", (8, 9), geforce=True),
    Target("cpu", None),
)


def target_of(device: torch.device) -> Target:
    import torch

    from ..kernels.fallback import is_geforce

    if device.type != "cuda":
        return Target(device.type, None)
    major, minor = torch.cuda.get_device_capability(device)
    return Target(f"sm_{major}{minor} ({torch.cuda.get_device_name(device)})", (major, minor), is_geforce(device))


def _blockscaled(t: Target) -> bool:
    return t.capability is not None and t.capability[0] in (10, 12)


def _fp8(t: Target) -> bool:
    return t.capability is not None and t.capability >= (8, 9)


def torchao_available() -> bool:
    return importlib.util.find_spec("torchao") is not None


def auto_gemm_for(t: Target) -> str:
    return "fp16acc" if t.geforce and t.capability >= (8, 0) else "bf16"


def auto_lossy_gemm_for(t: Target) -> str:
    if _blockscaled(t) and torchao_available():
        return "mxfp8"
    return "fp8" if _fp8(t) else "bf16"


def auto_attn_for(t: Target) -> str:
    return "k6" if t.geforce and t.capability >= (8, 9) else "exact"


def gemm_for(choice: str, t: Target) -> tuple[str, str | None]:
    """(what K6_GEMM=`choice` runs on `t`, why it differs from `choice` or None)."""
    if choice == "auto":
        return auto_gemm_for(t), None
    if choice == "auto-lossy":
        choice = auto_lossy_gemm_for(t)
    if choice == "fp8" and t.geforce and t.capability[0] in (8, 12) and _fp8(t):
        return "fp8-fp16acc", "FP32-accumulate FP8 runs at half rate on GeForce; FP16 chunks instead"
    if choice in ("mxfp8", "nvfp4") and not _blockscaled(t):
        return "bf16", "no block-scaled tensor cores (needs sm_100 or sm_120)"
    if choice == "fp8-fp16acc" and t.capability is not None and not _fp8(t):
        return "bf16", "no FP8 tensor cores (needs sm_89 or newer)"
    return choice, None


def resolve_for(options, t: Target):
    """Options with K6_GEMM and K6_ATTN replaced by what they mean on target `t` (no logging)."""
    changes = {}
    gemm, _ = gemm_for(options.gemm, t)
    if gemm != options.gemm:
        changes["gemm"] = gemm
    if options.attn == "auto":
        changes["attn"] = auto_attn_for(t)
    return options.replace(**changes) if changes else options


@functools.cache
def say_once(choice: str, target: str, resolved: str, why: str) -> None:
    """Warn that K6_GEMM=choice runs `resolved` on `target` (and why), once per process for each such line;
    `say_once.cache_clear()` forgets what was said."""
    logger.warning("K6_GEMM=%s on %s runs %s: %s", choice, target, resolved, why)


def resolve_auto(options, device: torch.device):
    """Options with `auto` choices (and choices the device cannot run) replaced by what they mean on `device`; a
    choice replaced for want of hardware is logged once."""
    t = target_of(device)
    resolved, why = gemm_for(options.gemm, t)
    if why is not None and options.gemm not in ("auto", "auto-lossy"):
        say_once(options.gemm, t.name, resolved, why)
    return resolve_for(options, t)


# Kept for callers of the earlier API: the choices on a device.
def auto_gemm(device: torch.device) -> str:
    return auto_gemm_for(target_of(device))


def auto_attn(device: torch.device) -> str:
    return auto_attn_for(target_of(device))
