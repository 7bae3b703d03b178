"""Prompt embeddings kept for reuse: in memory (least recently used first out, bounded in bytes) and, where the
caller names a folder, on disk for repeated CLI runs.

An entry is keyed by the prompt, the negative prompt, the padding, the text encoders' identity (their files, the
template and limits the encode applies), the compute dtype and the widths. A disk entry is one safetensors file named
by the key's digest, written atomically, holding the key itself in its metadata; it is used only when that key, the
tensor names, shapes and dtypes all match and every value is finite. Anything else (corrupt, truncated, foreign,
another version's) is ignored and rewritten after the encode.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from .atomic import write_bytes_atomic
from .text import TextConditioning

logger = logging.getLogger(__name__)

Encoded = tuple[TextConditioning, TextConditioning | None]
METADATA_KEY = "k6fast_prompt_key"
DEFAULT_MAX_BYTES = 256 * 2**20


@dataclass(frozen=True)
class PromptKey:
    prompt: str
    negative: str | None
    pad_to: int | None
    checkpoint: str  # the text encoders' identity (see `TextPhase.identity`)
    dtype: str  # e.g. "torch.bfloat16"
    widths: tuple[int, int]  # (Qwen hidden, CLIP hidden): what a stored entry's shapes must be

    def as_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.as_json().encode()).hexdigest()


def _tensors(value: Encoded) -> dict[str, Tensor]:
    out = {}
    for part, cond in zip(("cond", "uncond"), value, strict=True):
        if cond is None:
            continue
        out[f"{part}.embeds"], out[f"{part}.pooled"] = cond.embeds, cond.pooled
        if cond.mask is not None:
            out[f"{part}.mask"] = cond.mask
    return out


def _value(tensors: dict[str, Tensor], device: torch.device | str, copy: bool) -> Encoded:
    def cond(part: str) -> TextConditioning | None:
        if f"{part}.embeds" not in tensors:
            return None
        move = lambda t: None if t is None else t.to(device, copy=copy)  # noqa: E731
        return TextConditioning(move(tensors[f"{part}.embeds"]), move(tensors[f"{part}.pooled"]),
                                move(tensors.get(f"{part}.mask")))  # fmt: skip

    return cond("cond"), cond("uncond")


def check_entry(key: PromptKey, tensors: dict[str, Tensor]) -> str | None:
    """Why these tensors cannot be the encoding of `key` (None when they can)."""
    parts = ("cond", "uncond") if key.negative is not None else ("cond",)
    allowed = {f"{p}.{n}" for p in parts for n in ("embeds", "pooled", "mask")}
    required = {f"{p}.{n}" for p in parts for n in ("embeds", "pooled")}
    if not required <= set(tensors) <= allowed:
        return f"tensors {sorted(tensors)}, expected {sorted(required)} and optional masks"
    qwen, clip = key.widths
    for p in parts:
        embeds, pooled, mask = tensors[f"{p}.embeds"], tensors[f"{p}.pooled"], tensors.get(f"{p}.mask")
        if str(embeds.dtype) != key.dtype or str(pooled.dtype) != key.dtype:
            return f"{p}: dtypes {embeds.dtype}/{pooled.dtype}, expected {key.dtype}"
        if embeds.ndim != 3 or embeds.shape[0] != 1 or embeds.shape[2] != qwen or embeds.shape[1] < 1:
            return f"{p}.embeds: shape {list(embeds.shape)}, expected [1, S, {qwen}]"
        if key.pad_to is not None and embeds.shape[1] != key.pad_to:
            return f"{p}.embeds: {embeds.shape[1]} tokens, the key pads to {key.pad_to}"
        if tuple(pooled.shape) != (1, clip):
            return f"{p}.pooled: shape {list(pooled.shape)}, expected [1, {clip}]"
        if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (1, embeds.shape[1])):
            return f"{p}.mask: {mask.dtype} {list(mask.shape)}, expected bool [1, {embeds.shape[1]}]"
        if not (torch.isfinite(embeds).all() and torch.isfinite(pooled).all()):
            return f"{p}: values that are not finite"
    return None


class PromptCache:
    """Encoded prompts by `PromptKey`: host copies in memory up to `max_bytes`, and files under `directory` if given.
    `get` returns fresh tensors on the device asked for; `last_source` says where the last hit came from."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, directory: str | Path | None = None):
        if max_bytes < 0:
            raise ValueError(f"the prompt cache's size must be >= 0 bytes, found {max_bytes}")
        self.max_bytes = max_bytes
        self.directory = None if directory is None else Path(directory)
        self._entries: OrderedDict[str, tuple[PromptKey, dict[str, Tensor], int]] = OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0
        self.last_source = ""

    def path(self, key: PromptKey) -> Path | None:
        return None if self.directory is None else self.directory / f"{key.digest}.safetensors"

    def get(self, key: PromptKey, device: torch.device | str) -> Encoded | None:
        with self._lock:
            entry = self._entries.get(key.digest)
            if entry is not None and entry[0] == key:
                self._entries.move_to_end(key.digest)
                self.last_source = "memory"
                return _value(entry[1], device, copy=True)
        tensors = self._read(key)
        if tensors is None:
            return None
        self._remember(key, tensors)
        self.last_source = "disk"
        return _value(tensors, device, copy=True)

    def put(self, key: PromptKey, value: Encoded) -> None:
        tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in _tensors(value).items()}
        problem = check_entry(key, tensors)
        if problem is not None:
            raise ValueError(f"refusing to cache an encoding that does not match its key: {problem}")
        self._remember(key, tensors)
        self._write(key, tensors)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0

    def _remember(self, key: PromptKey, tensors: dict[str, Tensor]) -> None:
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        with self._lock:
            old = self._entries.pop(key.digest, None)
            if old is not None:
                self.nbytes -= old[2]
            if size > self.max_bytes:
                return
            self._entries[key.digest] = (key, tensors, size)
            self.nbytes += size
            while self.nbytes > self.max_bytes:
                _, (_, _, evicted) = self._entries.popitem(last=False)
                self.nbytes -= evicted

    def _read(self, key: PromptKey) -> dict[str, Tensor] | None:
        path = self.path(key)
        if path is None or not path.is_file():
            return None
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                stored_key = (f.metadata() or {}).get(METADATA_KEY)
                if stored_key != key.as_json():
                    logger.warning("prompt cache: %s holds another key; it will be rewritten", path)
                    return None
                tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        except Exception as exc:  # safetensors raises its own error types for a corrupt or truncated file
            logger.warning("prompt cache: %s is unreadable (%s); it will be rewritten", path, exc)
            return None
        problem = check_entry(key, tensors)
        if problem is not None:
            logger.warning("prompt cache: %s does not match its key (%s); it will be rewritten", path, problem)
            return None
        return tensors

    def _write(self, key: PromptKey, tensors: dict[str, Tensor]) -> None:
        path = self.path(key)
        if path is None:
            return
        from safetensors.torch import save

        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(path, save(tensors, metadata={METADATA_KEY: key.as_json(), "format": "pt"}))
        except OSError as exc:  # a full or read-only disk costs the next run an encode, not this request
            logger.warning("prompt cache: could not write %s (%s)", path, exc)
