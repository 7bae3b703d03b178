"""The text phase from the checkpoint's files alone, without PyTorch (so `k6fast doctor` plans as the runtime does):
where Qwen2.5-VL's and CLIP's tensors are, which of them stream through the device as which unit, the bytes one
encode reads, the device memory the phase needs at its peak, and the identity prompt caches are keyed on.

The streamed units are Qwen's decoder layers, one each, then CLIP's text model whole. Qwen's token embedding is never
uploaded (only the rows of the prompt's tokens are read), its final norm stays on the device, and its vision tower and
lm_head are never read: a text prompt does not use them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .checkpoint import weight_files
from .memory import GiB
from .safetensors_index import ITEMSIZE, CheckpointError, TensorLocation, index_safetensors
from .stream.plan import SLOT_ALIGN, slot_aligned

MAX_PROMPT_TOKENS = 1024
# The chat template's tokens before the prompt, cropped from Qwen's states: diffusers' `_QWEN_CROP_START`, restated
# so this module needs neither PyTorch nor diffusers (tests/test_text_phase.py holds the two equal).
TEMPLATE_TOKENS = 129
CLIP_TOKENS = 77
# Device slots the streamed units pass through: one is copied to while the other computes.
TEXT_SLOTS = 2
# Device slot offsets: the text encoders' layers stream through slots laid out as the DiT's blocks are.
ALIGN = SLOT_ALIGN

# Checkpoint names of the language model: the release's (`model.layers.N.`, as transformers writes them) or the
# module's own (`model.language_model.layers.N.`).
_LANGUAGE_PREFIXES = ("model.", "model.language_model.")
# Persistent in checkpoints written by old transformers versions, a non-persistent buffer the module rebuilds now.
_IGNORED_SUFFIXES = ("position_ids",)


@dataclass(frozen=True)
class QwenShape:
    """The language model's widths (Qwen2.5-VL's `text_config`)."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    layers: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class TextWeights:
    """Where the text phase's tensors are: one unit per Qwen decoder layer (by checkpoint-name prefix), CLIP whole."""

    qwen: QwenShape
    clip_hidden: int
    qwen_index: dict[str, TensorLocation]
    clip_index: dict[str, TensorLocation]
    layer_prefixes: tuple[str, ...]  # "model.layers.N." for N in 0..layers-1
    embed: TensorLocation  # [vocab, hidden]
    norm: TensorLocation  # [hidden], Qwen's final RMSNorm

    def layer(self, i: int) -> dict[str, TensorLocation]:
        """Layer i's tensors by name relative to the layer (`self_attn.q_proj.weight`, ...)."""
        prefix = self.layer_prefixes[i]
        return {name[len(prefix) :]: loc for name, loc in self.qwen_index.items() if name.startswith(prefix)}

    def clip(self) -> dict[str, TensorLocation]:
        return {n: loc for n, loc in self.clip_index.items() if not n.endswith(_IGNORED_SUFFIXES)}

    def units(self) -> list[dict[str, TensorLocation]]:
        """What streams per encode, in order: the decoder layers, then CLIP."""
        return [self.layer(i) for i in range(self.qwen.layers)] + [self.clip()]


def _config(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: expected a readable config.json ({exc})") from exc


def qwen_shape(config: dict[str, Any], path: Path) -> QwenShape:
    """From text_encoder/config.json: the nested `text_config` (transformers 5) or the flat keys of older releases."""
    text = config.get("text_config") or config
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
            "vocab_size")  # fmt: skip
    missing = [k for k in keys if not isinstance(text.get(k), int)]
    if missing:
        raise CheckpointError(f"{path}: Qwen2.5-VL's text config has no integer {missing}")
    return QwenShape(*(text[k] for k in keys))


def _one_of(index: dict[str, TensorLocation], names: list[str], what: str, folder: Path) -> TensorLocation:
    for name in names:
        if name in index:
            return index[name]
    raise CheckpointError(f"{folder}: no {what} tensor; expected one of {names}")


def text_weights(root: Path) -> TextWeights:
    """Locate the text encoders' tensors of the checkpoint at `root` from their safetensors headers."""
    qwen_dir, clip_dir = Path(root) / "text_encoder", Path(root) / "text_encoder_2"
    shape = qwen_shape(_config(qwen_dir / "config.json"), qwen_dir / "config.json")
    clip_config = _config(clip_dir / "config.json")
    clip_hidden = (clip_config.get("text_config") or clip_config).get("hidden_size")
    if not isinstance(clip_hidden, int):
        raise CheckpointError(f"{clip_dir / 'config.json'}: expected an integer hidden_size")
    qwen_index = index_safetensors(weight_files(qwen_dir, "model"))
    clip_index = index_safetensors(weight_files(clip_dir, "model"))
    prefix = next((p for p in _LANGUAGE_PREFIXES if any(n.startswith(f"{p}layers.0.") for n in qwen_index)), None)
    if prefix is None:
        raise CheckpointError(f"{qwen_dir}: no decoder layers; expected tensors named model.layers.0.*")
    layer_prefixes = tuple(f"{prefix}layers.{i}." for i in range(shape.layers))
    weights = TextWeights(
        shape, clip_hidden, qwen_index, clip_index, layer_prefixes,
        embed=_one_of(qwen_index, [f"{p}embed_tokens.weight" for p in _LANGUAGE_PREFIXES], "token embedding", qwen_dir),
        norm=_one_of(qwen_index, [f"{p}norm.weight" for p in _LANGUAGE_PREFIXES], "final norm", qwen_dir),
    )  # fmt: skip
    for i in range(shape.layers):
        if not weights.layer(i):
            raise CheckpointError(f"{qwen_dir}: config.json has {shape.layers} layers, no tensors for layer {i}")
    if weights.embed.shape != (shape.vocab, shape.hidden):
        raise CheckpointError(f"{weights.embed.file}: token embedding of shape {list(weights.embed.shape)}, "
                              f"config.json implies {[shape.vocab, shape.hidden]}")  # fmt: skip
    return weights


def unit_bytes(unit: dict[str, TensorLocation]) -> int:
    """A unit's bytes in a device slot: its tensors as stored, each at an ALIGN-byte offset."""
    return sum(slot_aligned(loc.nbytes) for loc in unit.values())


def activation_bytes(tokens: int, q: QwenShape, clip_hidden: int, itemsize: int) -> int:
    """Device memory for the activations of one encode (prompt and negative, each `tokens` long with the template):
    both prompts' states, embedding rows, RoPE tables and masks, plus the peak inside one decoder layer: the fp32
    RMSNorm temporaries, q/k/v with their rotated and head-expanded copies, the attention scores of SDPA's math
    path (an upper bound: the fused kernels keep none), and the MLP's gate, up and product. CLIP's 77 tokens are
    a rounding term beside it."""
    t, h, kv = tokens, q.hidden, q.kv_heads * q.head_dim
    kept = 2 * t * (3 * h * itemsize + 2 * q.head_dim * itemsize + t)
    layer = t * (6 * h * itemsize + 3 * h * 4 + 4 * kv * itemsize + 4 * q.intermediate * itemsize)
    scores = q.heads * t * t * 4
    clip = 2 * CLIP_TOKENS * clip_hidden * 16 * 4
    return kept + layer + scores + clip


@dataclass(frozen=True)
class TextFootprint:
    """What the text phase holds on the device at its peak, and what it reads per encode."""

    slots: int
    unit_bytes: int  # the largest streamed unit as stored (a Qwen decoder layer)
    convert_bytes: int  # that unit converted to the compute dtype on the device (0 when stored in it)
    resident_bytes: int  # Qwen's final norm, on the device while the phase lives
    activation_bytes: int  # see `activation_bytes`
    streamed_bytes: int  # read from the files and copied to the device per encode (every unit once)
    tokens: int  # the longest prompt planned for, template included

    @property
    def device_bytes(self) -> int:
        return self.slots * self.unit_bytes + self.convert_bytes + self.resident_bytes + self.activation_bytes

    def as_dict(self) -> dict[str, int]:
        return {"device_bytes": self.device_bytes, "slots": self.slots, "unit_bytes": self.unit_bytes,
                "convert_bytes": self.convert_bytes, "resident_bytes": self.resident_bytes,
                "activation_bytes": self.activation_bytes, "streamed_bytes": self.streamed_bytes,
                "tokens": self.tokens}  # fmt: skip

    def describe(self) -> str:
        gib = lambda n: f"{n / GiB:.2f} GiB"  # noqa: E731
        return (f"text phase: {gib(self.device_bytes)} at its peak ({self.slots} slots x {gib(self.unit_bytes)} of "
                f"Qwen layers streamed, activations {gib(self.activation_bytes)} for {self.tokens} tokens); "
                f"{self.streamed_bytes / 1e9:.1f} GB read per new prompt")  # fmt: skip


def text_footprint(
    weights: TextWeights, compute_dtype: str = "BF16", max_tokens: int | None = None, slots: int = TEXT_SLOTS
) -> TextFootprint:
    """The text phase's device memory for prompts of up to `max_tokens` after the template (MAX_PROMPT_TOKENS by
    default) computed in `compute_dtype` (a safetensors dtype string), streaming through `slots` device slots."""
    compute_itemsize = ITEMSIZE[compute_dtype]
    if slots < 1:
        raise ValueError(f"the text phase streams through at least one device slot, found {slots}")
    units = weights.units()
    largest = max(units, key=unit_bytes)
    converted = sum(loc.elements * compute_itemsize for loc in largest.values() if loc.dtype != compute_dtype)
    tokens = (MAX_PROMPT_TOKENS if max_tokens is None else max_tokens) + TEMPLATE_TOKENS
    return TextFootprint(
        slots=slots,
        unit_bytes=unit_bytes(largest),
        convert_bytes=converted,
        resident_bytes=weights.norm.elements * compute_itemsize,
        activation_bytes=activation_bytes(tokens, weights.qwen, weights.clip_hidden, compute_itemsize),
        streamed_bytes=sum(loc.nbytes for unit in units for loc in unit.values()),
        tokens=tokens,
    )


def text_identity(root: Path) -> str:
    """A digest of everything a prompt's embedding depends on in the checkpoint: every file of both text encoders and
    both tokenizers (resolved path, size, modification time)."""
    entries = []
    for component in ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"):
        folder = (Path(root) / component).resolve()
        for file in sorted(p for p in folder.rglob("*") if p.is_file()):
            stat = file.stat()
            entries.append([component, str(file), stat.st_size, stat.st_mtime_ns])
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()
