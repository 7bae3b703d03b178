"""The text phase as the pipeline runs it: Qwen2.5-VL and CLIP opened once, their weights streamed through the
device per new prompt, the result cached.

At construction the tokenizers and configs are loaded and transformers' modules built with their parameters on the
meta device (no weight in host or device memory); the safetensors files are located once (`text_plan.text_weights`).
`encode` runs transformers' own forward up to Qwen's first decoder layer (token embedding, RoPE tables, causal mask:
whatever transformers computes there is captured with the layer's arguments), then binds each decoder layer's weights
from a `UnitStream` slot in turn and calls the layer on the prompt's and the negative prompt's states, so each layer
crosses to the device once for both; then Qwen's final norm (resident), then CLIP, streamed as one unit. The token
embedding is never uploaded: the prompt's rows are read from the file (`RowEmbedding`); the vision tower and lm_head
are never read. The result equals `TextEncoders` (`from_pretrained`, the whole model's `hidden_states[-1]`) bit for
bit (tests/test_text_phase.py).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from .prompt_cache import Encoded, PromptCache, PromptKey
from .safetensors_index import CheckpointError, TensorLocation
from .stream.page_locked import staging_buffers
from .stream.reader import COMPUTE_DTYPES, FileReader, torch_dtype
from .text import (
    CLIP_MAX_LENGTH,
    MAX_PROMPT_TOKENS,
    PROMPT_TEMPLATE,
    QWEN_CROP_START,
    TextConditioning,
    clip_inputs,
    conditioning,
    qwen_inputs,
)
from .text_plan import TEXT_SLOTS, TextFootprint, text_footprint, text_identity, text_weights
from .text_stream import UnitLayout, UnitStream

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TextStats:
    """The last encode: wall seconds, where the result came from ("memory", "disk" or "encoded") and the weight bytes
    it streamed from the files to the device (Qwen's decoder layers and CLIP; the prompt's embedding rows aside)."""

    seconds: float
    source: str
    bytes_streamed: int


class _Captured(Exception):
    """Raised by the hook on Qwen's first decoder layer to stop transformers' forward with the layer's arguments."""

    def __init__(self, args: tuple, kwargs: dict):
        super().__init__("first decoder layer reached")
        self.args, self.kwargs = args, kwargs


class RowEmbedding(nn.Module):
    """Qwen's token embedding without holding it: the rows of the tokens asked for, read through a read-only map of
    the file (page cache, not process memory) and converted as `from_pretrained(dtype=...)` converts the table."""

    def __init__(self, loc: TensorLocation, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.loc, self.device, self.dtype = loc, device, dtype
        vocab = loc.shape[0]
        row_bytes = loc.nbytes // vocab
        self._rows = np.memmap(loc.file, dtype=np.uint8, mode="r", offset=loc.offset, shape=(vocab, row_bytes))

    def forward(self, input_ids: Tensor) -> Tensor:
        """input_ids: int64 [B, T] → [B, T, hidden] in `dtype` on `device`."""
        ids = input_ids.cpu()
        vocab = self.loc.shape[0]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise IndexError(f"token ids must lie in [0, {vocab}), found [{int(ids.min())}, {int(ids.max())}]")
        unique, inverse = torch.unique(ids, return_inverse=True)
        raw = torch.from_numpy(np.ascontiguousarray(self._rows[unique.numpy()]))
        rows = raw.view(torch_dtype(self.loc)).to(self.device)
        return rows.to(self.dtype)[inverse.to(self.device)]

    def close(self) -> None:
        self._rows._mmap.close()


def _empty(cls, config, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """transformers' module with its parameters on the meta device; buffers (RoPE frequencies, position ids) are
    computed as `from_pretrained` computes them, then moved to `device`."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = cls._from_config(config, dtype=dtype)
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = buf.to(device)
    return model.eval()


def _layer_output(out) -> Tensor:
    return out[0] if isinstance(out, tuple) else out  # older transformers return (hidden_states, ...)


class TextPhase:
    """Qwen2.5-VL + CLIP encoding with the weights streamed per new prompt; see the module docstring."""

    def __init__(
        self,
        root: Path,
        device: torch.device,
        dtype: torch.dtype,
        cache: PromptCache | None = None,
        slots: int = TEXT_SLOTS,
    ):
        from transformers import AutoConfig, CLIPTextModel, CLIPTokenizer, Qwen2_5_VLProcessor
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

        if dtype not in COMPUTE_DTYPES:
            raise ValueError(f"the text phase computes in one of {list(COMPUTE_DTYPES)}, found {dtype}")
        self.root, self.device, self.dtype, self.cache, self.slots = Path(root), device, dtype, cache, slots
        self.weights = text_weights(self.root)
        self.processor = Qwen2_5_VLProcessor.from_pretrained(self.root / "tokenizer")
        self.clip_tokenizer = CLIPTokenizer.from_pretrained(self.root / "tokenizer_2")
        qwen_config = AutoConfig.from_pretrained(self.root / "text_encoder")
        layer_types = set(getattr(qwen_config.text_config, "layer_types", None) or ["full_attention"])
        if layer_types != {"full_attention"}:
            raise CheckpointError(f"{self.root / 'text_encoder'}: layer types {sorted(layer_types)}; the streamed "
                                  "text phase runs full-attention layers only (use_sliding_window false)")  # fmt: skip
        self.qwen = _empty(Qwen2_5_VLModel, qwen_config, dtype, device)
        self.clip = _empty(CLIPTextModel, AutoConfig.from_pretrained(self.root / "text_encoder_2"), dtype, device)
        self._layers = list(self.qwen.language_model.layers)
        self._embedding = RowEmbedding(self.weights.embed, device, dtype)
        self.qwen.language_model.embed_tokens = self._embedding

        indexes = (self.weights.qwen_index, self.weights.clip_index)
        self._reader = FileReader({loc.file for index in indexes for loc in index.values()})
        units = [self.weights.layer(i) for i in range(len(self._layers))] + [self._clip_names()]
        for unit, module in zip(units, [*self._layers, self.clip], strict=True):
            _check_unit(unit, module)
        # What each streamed unit (a Qwen decoder layer, then CLIP) reads: its pieces and bytes, in the encode's order.
        self.layouts = [UnitLayout.of(unit) for unit in units]
        self._bound: list[tuple[nn.Module, str, nn.Parameter]] = []
        self._norm = self.qwen.language_model.norm
        self._bind(self._norm, self._read_resident({"weight": self.weights.norm}))
        self._bound.clear()  # the final norm stays bound while the phase lives
        self._staging = None
        if device.type == "cuda":  # locked at exactly the largest unit's size, as the DiT stream's (`page_locked`)
            self._staging = staging_buffers(max(layout.nbytes for layout in self.layouts), 2, device)
        limits = [PROMPT_TEMPLATE, str(QWEN_CROP_START), str(MAX_PROMPT_TOKENS), str(CLIP_MAX_LENGTH)]
        self.identity = hashlib.sha256("\n".join([text_identity(self.root), *limits]).encode()).hexdigest()
        self.last: TextStats | None = None
        self._lock = threading.Lock()  # one encode at a time: the modules' parameters are bound per encode

    def _read_resident(self, tensors: dict[str, TensorLocation]) -> dict[str, Tensor]:
        layout = UnitLayout.of(tensors)
        buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
        self._reader.read_into(buffer, [(loc, at) for _, loc, at in layout.pieces])
        return layout.views(buffer.to(self.device), self.dtype)

    def _clip_names(self) -> dict[str, TensorLocation]:
        """CLIP's tensors by module parameter name: releases store them under `text_model.`, transformers 5's
        CLIPTextModel holds them without it."""
        params = {name for name, _ in self.clip.named_parameters()}
        out = {}
        for name, loc in self.weights.clip().items():
            bare = name.removeprefix("text_model.")
            out[name if name in params else bare if bare in params else f"text_model.{name}"] = loc
        return out

    def footprint(self, max_tokens: int | None = None) -> TextFootprint:
        return text_footprint(self.weights, COMPUTE_DTYPES[self.dtype], max_tokens, self.slots)

    def device_bytes(self, max_tokens: int | None = None) -> int:
        """The most device memory an encode takes (prompt and negative of up to `max_tokens` tokens after the
        template, MAX_PROMPT_TOKENS by default): slots, converted weights, Qwen's final norm and activations."""
        return self.footprint(max_tokens).device_bytes

    def key(self, prompt: str, negative: str | None, pad_to: int | None) -> PromptKey:
        widths = (self.weights.qwen.hidden, self.weights.clip_hidden)
        return PromptKey(prompt, negative, pad_to, self.identity, str(self.dtype), widths)

    @torch.no_grad()
    def encode(
        self, prompt: str, negative: str | None = None, pad_to: int | None = None
    ) -> tuple[TextConditioning, TextConditioning | None]:
        """The prompt's conditioning, and the negative prompt's when one is given (CFG). pad_to: pad Qwen's tokens
        (after the template crop) to this length and mask them, as the reference pipeline does."""
        return self.encode_with_stats(prompt, negative, pad_to)[0]

    def encode_with_stats(
        self, prompt: str, negative: str | None = None, pad_to: int | None = None
    ) -> tuple[tuple[TextConditioning, TextConditioning | None], TextStats]:
        """`encode`, with that encode's stats (taken under the lock: `last` may be another caller's by the time it is
        read)."""
        with self._lock:
            return self._encode(prompt, negative, pad_to), self.last

    def _encode(
        self, prompt: str, negative: str | None, pad_to: int | None
    ) -> tuple[TextConditioning, TextConditioning | None]:
        start = time.perf_counter()
        key = self.key(prompt, negative, pad_to) if self.cache is not None else None
        if key is not None:
            hit = self.cache.get(key, self.device)
            if hit is not None:
                self.last = TextStats(time.perf_counter() - start, self.cache.last_source, 0)
                return hit
        prompts = [prompt] if negative is None else [prompt, negative]
        qwen_in = [qwen_inputs(self.processor, p, pad_to, self.device) for p in prompts]
        clip_in = [clip_inputs(self.clip_tokenizer, p, self.device) for p in prompts]
        staging = self._staging.buffers if self._staging is not None else None
        stream = UnitStream(self.layouts, self._reader, self.slots, self.device, self.dtype, staging)
        try:
            states = [self._first_layer_inputs(inputs) for inputs in qwen_in]
            for i, layer in enumerate(self._layers):
                self._bind(layer, stream.get(i))
                states = [(_layer_output(layer(h, *args, **kwargs)), args, kwargs) for h, args, kwargs in states]
                stream.release(i)
                self._unbind()
            last_hidden = [self._norm(h) for h, _, _ in states]
            self._bind(self.clip, stream.get(len(self._layers)))
            pooled = [self.clip(**inputs).pooler_output for inputs in clip_in]
            stream.release(len(self._layers))
        finally:
            self._unbind()
            stream.close()
        out = [conditioning(h, x["attention_mask"], p) for h, x, p in zip(last_hidden, qwen_in, pooled, strict=True)]
        result: Encoded = (out[0], out[1] if negative is not None else None)
        if key is not None:
            self.cache.put(key, result)
        self.last = TextStats(time.perf_counter() - start, "encoded", stream.bytes_streamed)
        return result

    def _first_layer_inputs(self, inputs: dict[str, Tensor]) -> tuple[Tensor, tuple, dict]:
        """transformers' forward of the whole model, stopped at its first decoder layer: (the layer's hidden-state
        input [1, T, hidden], its other positional and keyword arguments), exactly what each layer is called with."""

        def stop(module, args, kwargs):
            raise _Captured(args, kwargs)

        hook = self._layers[0].register_forward_pre_hook(stop, with_kwargs=True)
        try:
            self.qwen(**inputs, use_cache=False)  # no key/value cache: each layer runs once per prompt
        except _Captured as captured:
            return captured.args[0], captured.args[1:], captured.kwargs
        finally:
            hook.remove()
        raise RuntimeError("transformers' Qwen2.5-VL forward returned without calling its first decoder layer")

    def _bind(self, module: nn.Module, tensors: dict[str, Tensor]) -> None:
        for name, tensor in tensors.items():
            owner, _, leaf = name.rpartition(".")
            sub = module.get_submodule(owner)
            self._bound.append((sub, leaf, sub._parameters[leaf]))
            sub._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)

    def _unbind(self) -> None:
        """Put the meta parameters back, so no module keeps a slot alive."""
        for sub, leaf, meta in reversed(self._bound):
            sub._parameters[leaf] = meta
        self._bound.clear()

    def close(self) -> None:
        self._reader.close()
        self._embedding.close()
        if self._staging is not None:
            self._staging.close()  # each encode's stream waited for its copies out of the staging
        self._staging = None


class TextAhead:
    """One encode on its own thread, started before the rest of the load (`Pipeline(first_request=...)`: the CLI
    knows its prompt at start-up, so the text phase's seconds, its first-use costs included, pass under the DiT's
    load). `take` waits for it; a failed encode is logged and left to the request, which encodes again."""

    def __init__(self, text: TextPhase, prompt: str, negative: str | None):
        self.text, self.prompt, self.negative = text, prompt, negative
        self._result: tuple[TextConditioning, TextConditioning | None] | None = None
        self.stats: TextStats | None = None  # the encode's own (its seconds overlapped the load)
        self._thread = threading.Thread(target=self._run, name="k6-text-ahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result, self.stats = self.text.encode_with_stats(self.prompt, self.negative)
        except Exception:  # the request encodes again and raises it there, in the request's own phase
            logger.warning("encoding the prompt during the load failed; the request encodes it", exc_info=True)

    def take(
        self, prompt: str, negative: str | None
    ) -> tuple[tuple[TextConditioning, TextConditioning | None] | None, TextStats | None]:
        """Wait for the encode; its result and stats when it succeeded for this prompt and negative, else (None,
        None)."""
        self.wait()
        if self._result is None or (prompt, negative) != (self.prompt, self.negative):
            return None, None
        return self._result, self.stats

    def wait(self) -> None:
        """Until the encode has ended (an owner that will not use it, before it closes the text phase or the process
        exits: a thread must not run CUDA work through the interpreter's shutdown)."""
        self._thread.join()


def _check_unit(unit: dict[str, TensorLocation], module: nn.Module) -> None:
    """The unit's tensors are exactly the module's parameters, with their shapes."""
    params = dict(module.named_parameters())
    missing, extra = sorted(set(params) - set(unit)), sorted(set(unit) - set(params))
    if missing or extra:
        files = sorted({str(loc.file.parent) for loc in unit.values()})
        raise CheckpointError(f"{files}: text encoder tensors do not match {type(module).__name__}'s parameters: "
                              f"missing {missing[:3]}, unexpected {extra[:3]}")  # fmt: skip
    for name, loc in unit.items():
        if tuple(params[name].shape) != loc.shape:
            raise CheckpointError(f"{loc.file}: tensor {loc.name} has shape {list(loc.shape)}, the config implies "
                                  f"{list(params[name].shape)}")  # fmt: skip
