"""Argument types shared by every `k6fast` subcommand (generate, serve, gate). Imports nothing heavy: the gate's
and server's `register` functions must stay cheap to import."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path


def size_arg(text: str) -> tuple[int, int]:
    """`864x480` → (864, 480); an argparse type, so a bad value is a usage error naming what was expected."""
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT such as 864x480, found {text!r}") from None
    return width, height


def comma_list(text: str, example: str = "reference,final") -> tuple[str, ...]:
    """`a, b,c` → ("a", "b", "c"); an argparse type refusing an empty list."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names such as {example}; found {text!r}")
    return names


def seed_list(text: str) -> tuple[int, ...]:
    """`42,43` → (42, 43); an argparse type refusing a non-integer or a repeated seed."""
    try:
        seeds = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integer seeds such as 42,43, found {text!r}"
        ) from None
    if len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"expected distinct seeds, found {text!r}")
    return seeds


DTYPES = ("bf16", "fp16", "fp32")  # what `--dtype` takes


def torch_dtype_of(name: str | None):
    """The torch dtype a `--dtype` name (one of DTYPES) means; None for None (the device's default: BF16 on a GPU,
    FP32 on the CPU). Imports PyTorch: call it where the model loads."""
    import torch

    return None if name is None else {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


SEED_MAX = 2**63 - 1  # the server's bound too: a seed that works in one works in the other


def seed_problem(seed: int) -> str | None:
    """What is wrong with a seed, or None: an integer in [0, 2**63 - 1]."""
    if not 0 <= seed <= SEED_MAX:
        return f"expected an integer in [0, {SEED_MAX}], found {seed}"
    return None


# The device types torch.device accepts besides cpu and cuda (c10/core/DeviceType.h), so that a device k6fast cannot
# use is told apart from a misspelt name without importing PyTorch.
_OTHER_TORCH_DEVICES = frozenset(
    "ipu xpu mkldnn opengl opencl ideep hip ve fpga maia xla lazy vulkan mps meta hpu mtia privateuseone".split()  # noqa: SIM905
)
_DEVICE_RE = re.compile(r"([a-z]+)(?::([0-9]+))?")
_NO_GPU = "no CUDA GPU is available on this machine; expected --device cpu here"


def no_gpu_device_files() -> bool:
    """True on a Linux machine with none of the device files a CUDA (or ROCm, or WSL) GPU is reached through: no
    driver can find a GPU there, so PyTorch need not be imported to say so."""
    if not sys.platform.startswith("linux"):
        return False
    dev = Path("/dev")
    return not any(dev.glob("nvidia[0-9]*")) and not (dev / "dxg").exists() and not (dev / "kfd").exists()


def device_problem(name: str | None) -> str | None:
    """What keeps the device `name` (cpu, cuda, cuda:N) from being used on this machine, or None; the message reads
    after "--device NAME: ". Imports PyTorch only to count the GPUs of a machine that has some."""
    if name is None:
        return None
    expected = "expected cpu, cuda or cuda:N (k6fast runs on a CUDA GPU or the CPU)"
    match = _DEVICE_RE.fullmatch(name)
    if match is None or match[1] not in ("cpu", "cuda", *_OTHER_TORCH_DEVICES):
        return f"not a device name; {expected}"
    kind, index = match[1], match[2]
    if kind == "cpu":
        return None
    if kind != "cuda":
        return f"{kind} devices are not supported; {expected}"
    if no_gpu_device_files():
        return _NO_GPU
    import torch

    if not torch.cuda.is_available():
        return _NO_GPU
    count = torch.cuda.device_count()
    if index is not None and int(index) >= count:
        return f"this machine has {count} CUDA GPU(s); expected cuda:0 to cuda:{count - 1}"
    return None
