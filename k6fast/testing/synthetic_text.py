"""Real-size text encoders for `k6fast make-synthetic --text-encoders full`: Qwen2.5-VL-7B with its vision tower and
CLIP ViT-L/14's text model, with the release's configurations, tensor names and shapes, in bf16, random weights.

The tensor names and shapes come from transformers' own modules built on the meta device (no memory), renamed as the
release stores them (`model.layers.N.`, `visual.`, `lm_head.`; CLIP under `text_model.`). The files are written
tensor by tensor: each tensor's values are drawn in chunks, each chunk from its own generator seeded by (seed, tensor,
chunk), on a pool of threads (on the GPU where there is one), and written in order, so that no more than a few chunks
are ever in memory and the bytes do not depend on the thread count.

Values are at the scale of a freshly initialised model, so activations stay finite through all 28 layers in bf16:
normal weights of standard deviation 1/sqrt(3 fan_in) (nn.Linear's uniform init has that variance), 0.02 for
embeddings, zero biases, unit norm weights.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from .model_constants import CLIP_L_TEXT, QWEN_7B_TEXT, QWEN_7B_TIE_WORD_EMBEDDINGS, QWEN_7B_VISION

CHUNK_ELEMENTS = 1 << 24
# The release's Qwen shards are about 3.9 GB each.
QWEN_SHARD_BYTES = 3_900_000_000
ARCHITECTURES = {"text_encoder": "Qwen2_5_VLForConditionalGeneration", "text_encoder_2": "CLIPTextModel"}


def qwen_config(token_ids: dict[str, int], text: dict[str, Any] | None = None, vision: dict[str, Any] | None = None):
    """Qwen2.5-VL-7B's config (`text`/`vision` override entries, for reduced test variants); special token ids from
    the checkpoint's tokenizer."""
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config={**QWEN_7B_TEXT, **(text or {}), "bos_token_id": token_ids["<|endoftext|>"],
                     "eos_token_id": token_ids["<|im_end|>"], "pad_token_id": token_ids["<|endoftext|>"]},
        vision_config={**QWEN_7B_VISION, **(vision or {})},
        image_token_id=token_ids["<|image_pad|>"], video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"], vision_end_token_id=token_ids["<|vision_end|>"],
        tie_word_embeddings=QWEN_7B_TIE_WORD_EMBEDDINGS,
    )  # fmt: skip


def clip_config(tokenizer, overrides: dict[str, Any] | None = None):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(**{**CLIP_L_TEXT, **(overrides or {})}, bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip


def release_name(module_name: str) -> str:
    """A parameter's name in transformers 5's modules → its name in the released checkpoints."""
    for new, old in (("model.language_model.", "model."), ("model.visual.", "visual.")):
        if module_name.startswith(new):
            return old + module_name[len(new) :]
    return module_name


def tensor_shapes(model_class, config, rename) -> dict[str, tuple[int, ...]]:
    """Every parameter of `model_class(config)` by its checkpoint name, built on the meta device."""
    import torch

    with torch.device("meta"):
        model = model_class(config)
    return {rename(name): tuple(p.shape) for name, p in model.named_parameters()}


def qwen_shapes(config) -> dict[str, tuple[int, ...]]:
    from transformers import Qwen2_5_VLForConditionalGeneration

    return tensor_shapes(Qwen2_5_VLForConditionalGeneration, config, release_name)


def clip_shapes(config) -> dict[str, tuple[int, ...]]:
    from transformers import CLIPTextModel

    return tensor_shapes(CLIPTextModel, config, lambda n: n if n.startswith("text_model.") else f"text_model.{n}")


def init_rule(name: str, shape: tuple[int, ...]) -> float | str:
    """The value of a tensor: "zeros", "ones", or the standard deviation of a normal draw."""
    if name.endswith(".bias"):
        return "zeros"
    if len(shape) == 1:
        return "ones"  # every 1-D weight of both models is a norm's scale
    if "embed" in name:
        return 0.02
    return 1.0 / math.sqrt(3 * math.prod(shape[1:]))


def _chunk_seed(seed: int, name: str, chunk: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}:{chunk}".encode()).digest()[:8], "little") >> 1


def _chunks(names: list[str], shapes: dict[str, tuple[int, ...]], seed: int, device: str) -> Iterator[np.ndarray]:
    """Each tensor's bf16 bytes in file order, CHUNK_ELEMENTS at a time, drawn on a pool of threads (PyTorch's
    generators release the GIL)."""
    import torch

    constant = {rule: fill(CHUNK_ELEMENTS, dtype=torch.bfloat16).view(torch.int16).numpy()
                for rule, fill in (("zeros", torch.zeros), ("ones", torch.ones))}  # fmt: skip

    def draw(name: str, chunk: int, count: int) -> np.ndarray:
        rule = init_rule(name, shapes[name])
        if isinstance(rule, str):
            return constant[rule][:count]
        g = torch.Generator(device).manual_seed(_chunk_seed(seed, name, chunk))
        t = torch.empty(count, device=device, dtype=torch.bfloat16).normal_(0.0, rule, generator=g)
        return t.cpu().view(torch.int16).numpy()

    tasks = [(name, i, min(CHUNK_ELEMENTS, n - start))
             for name in names for n in [math.prod(shapes[name])]
             for i, start in enumerate(range(0, n, CHUNK_ELEMENTS))]  # fmt: skip
    workers = max(1, min(16, os.cpu_count() or 1))
    with ThreadPoolExecutor(workers, thread_name_prefix="k6-synthetic") as pool:
        pending = []
        for task in tasks:
            pending.append(pool.submit(draw, *task))
            if len(pending) > workers + 2:
                yield pending.pop(0).result()
        for future in pending:
            yield future.result()


def write_safetensors(path: Path, names: list[str], shapes: dict[str, tuple[int, ...]], seed: int, device: str) -> int:
    """One bf16 safetensors file of `names` (in this order) with random values; returns its data bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for name in names:
        nbytes = 2 * math.prod(shapes[name])
        header[name] = {"dtype": "BF16", "shape": list(shapes[name]), "data_offsets": [at, at + nbytes]}
        at += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads its header to 8 bytes
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for chunk in _chunks(names, shapes, seed, device):
            f.write(chunk)
    return at


def shard_groups(shapes: dict[str, tuple[int, ...]], shard_bytes: int) -> list[list[str]]:
    """Tensor names in name order, grouped into shards of about `shard_bytes` of bf16 data each."""
    groups: list[list[str]] = [[]]
    size = 0
    for name in sorted(shapes):
        nbytes = 2 * math.prod(shapes[name])
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def write_sharded(folder: Path, shapes: dict[str, tuple[int, ...]], seed: int, device: str, shard_bytes: int) -> int:
    """`model.safetensors`, or `model-0000N-of-0000M.safetensors` shards of about shard_bytes with their index, as
    transformers writes them; returns the data bytes."""
    groups = shard_groups(shapes, shard_bytes)
    if len(groups) == 1:
        return write_safetensors(folder / "model.safetensors", groups[0], shapes, seed, device)
    weight_map, total = {}, 0
    for i, names in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        total += write_safetensors(folder / file, names, shapes, seed, device)
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_parameters": total // 2, "total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return total


def write_text_encoders(
    root: Path,
    processor,
    clip_tokenizer,
    seed: int,
    qwen_overrides: tuple[dict[str, Any], dict[str, Any]] | None = None,
    clip_overrides: dict[str, Any] | None = None,
) -> int:
    """Write `root/text_encoder` (Qwen2.5-VL-7B) and `root/text_encoder_2` (CLIP-L text); returns their bytes.
    The overrides (Qwen's text and vision config entries, CLIP's) shrink them for tests, through the same code."""
    import torch

    from .tokenizers import QWEN_SPECIAL_TOKENS

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ids = {t: processor.tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    text, vision = qwen_overrides or ({}, {})
    qwen = qwen_config(ids, text, vision)
    clip = clip_config(clip_tokenizer, clip_overrides)
    total = 0
    for folder, config, shapes, shard_bytes in (
        (root / "text_encoder", qwen, qwen_shapes(qwen), QWEN_SHARD_BYTES),
        (root / "text_encoder_2", clip, clip_shapes(clip), math.inf),
    ):
        folder.mkdir(parents=True)
        config.architectures = [ARCHITECTURES[folder.name]]
        config.dtype = "bfloat16"
        config.save_pretrained(folder)
        total += write_sharded(folder, shapes, seed, device, shard_bytes)
    return total
