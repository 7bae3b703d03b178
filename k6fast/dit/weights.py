"""Resident DiT weights: read by name from the checkpoint's safetensors shards, cast per layer, kept on one device."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from .config import is_fp32_tensor


class PrefixView(Mapping[str, Tensor]):
    """The tensors under `prefix` (e.g. `visual_transformer_blocks.3.`), addressed by their names relative to it."""

    def __init__(self, tensors: Mapping[str, Tensor], prefix: str):
        self._tensors = tensors
        self._prefix = prefix

    def __getitem__(self, name: str) -> Tensor:
        return self._tensors[self._prefix + name]

    def __iter__(self) -> Iterator[str]:
        n = len(self._prefix)
        return (k[n:] for k in self._tensors if k.startswith(self._prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def load_tensors(
    files: list[Path], device: torch.device | str, dtype: torch.dtype, names: set[str] | None = None
) -> dict[str, Tensor]:
    """Read tensors by name from safetensors files. Modulation and time-embedding layers become fp32, every other
    floating tensor `dtype`. `names` restricts what is read (None = everything)."""
    out: dict[str, Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if names is not None and name not in names:
                    continue
                t = f.get_tensor(name)
                target = torch.float32 if is_fp32_tensor(name) else dtype
                out[name] = t.to(device=device, dtype=target if t.is_floating_point() else t.dtype)
    return out
