"""Addressing a block's weights by their names relative to the block."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from torch import Tensor


class PrefixView(Mapping[str, Tensor]):
    """The tensors under `prefix` (e.g. `config.block_prefix(3)`), addressed by their names relative to it."""

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
