"""Argument types shared by every `k6fast` subcommand (generate, serve, gate). Imports nothing heavy: the gate's
and server's `register` functions must stay cheap to import."""

from __future__ import annotations

import argparse


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


SEED_MAX = 2**63 - 1  # the server's bound too: a seed that works in one works in the other


def seed_problem(seed: int) -> str | None:
    """What is wrong with a seed, or None: an integer in [0, 2**63 - 1]."""
    if not 0 <= seed <= SEED_MAX:
        return f"expected an integer in [0, {SEED_MAX}], found {seed}"
    return None


def device_problem(name: str | None) -> str | None:
    """What keeps the device `name` (cpu, cuda, cuda:N) from being used on this machine, or None; the message reads
    after "--device NAME: ". Imports torch: call it after parsing, before loading a model."""
    if name is None:
        return None
    import torch

    expected = "expected cpu, cuda or cuda:N (k6fast runs on a CUDA GPU or the CPU)"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        return f"not a device name; {expected}"
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"{device.type} devices are not supported; {expected}"
    if not torch.cuda.is_available():
        return "no CUDA GPU is available on this machine; expected --device cpu here"
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        return f"this machine has {count} CUDA GPU(s); expected cuda:0 to cuda:{count - 1}"
    return None
