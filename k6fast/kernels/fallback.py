"""Where a kernel cannot run, its reference does, and one log line says so.

Every kernel module decides with `kernel_runs` (or logs through `log_reference_once` for reasons of its own): one
line per (logger, op, device, reason) and process; INFO for CPU tensors, where the reference is the expected path,
WARNING on a GPU, where it is a slow one. The line comes from the kernel module's own logger.

Beside them, the device rules the kernels share: `device_label`, `cuda_at_least` and `is_geforce`.
"""

from __future__ import annotations

import functools
import logging

import torch


def device_label(device: torch.device) -> str:
    """ "cuda sm_XY" for a CUDA device, else the device's type ("cpu")."""
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"cuda sm_{major}{minor}"


def is_geforce(device: torch.device) -> bool:
    """Whether `device` is a GeForce card: the device-name rule for the choices made for GeForce speed (FP16-accumulate
    MMA at twice the FP32-accumulate rate there), which the compute capability alone cannot tell (an L40S is sm_89)."""
    return device.type == "cuda" and "GeForce" in torch.cuda.get_device_name(device)


def cuda_at_least(device: torch.device, capability: tuple[int, int]) -> bool:
    """Whether `device` is a CUDA device of compute capability `capability` or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= capability


@functools.cache
def log_reference_once(
    logger: logging.Logger,
    op: str,
    where: str,
    why: str,
    *,
    what: str = "the PyTorch reference",
    level: int | None = None,
) -> None:
    """ "`op` on `where` runs `what`: `why`", once per process; level None: INFO on the CPU, WARNING elsewhere."""
    if level is None:
        level = logging.INFO if where == "cpu" else logging.WARNING
    logger.log(level, "%s on %s runs %s: %s", op, where, what, why)


def kernel_runs(
    logger: logging.Logger,
    op: str,
    device: torch.device,
    runs: bool,
    why_on_cuda: str,
    *,
    elsewhere: str = "no Triton kernels here",
    what: str = "the PyTorch reference",
) -> bool:
    """`runs` (the caller's verdict on `device`); when False, the fallback is logged once with its reason:
    `why_on_cuda` on a GPU, "CPU tensors" on the CPU, `elsewhere` on any other device."""
    if not runs:
        why = why_on_cuda if device.type == "cuda" else ("CPU tensors" if device.type == "cpu" else elsewhere)
        log_reference_once(logger, op, device_label(device), why, what=what)
    return runs
