"""Prompt encoding: Qwen2.5-VL hidden states (chat template, 129 template tokens cropped) and the CLIP pooled
embedding. The tokenization and the crop live here, shared by both ways of running the encoders: `TextEncoders`
(transformers' models whole, `from_pretrained`; the reference the streamed text phase is held equal to) and
`k6fast.text_phase.TextPhase` (the layers streamed through the device, what the pipeline runs).

By default the prompt is neither padded nor masked: Qwen2.5-VL is causal, so right-padding does not change the
states of the real tokens, and a masked attention over padding equals an unmasked one over the real tokens. The
reference pipeline pads to 1,153 tokens and masks; `pad_to` reproduces that for parity checks.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers.pipelines.kandinsky6.pipeline_kandinsky6_ti2va import (
    _CLIP_MAX_LENGTH,
    _PROMPT_TEMPLATE,
    _QWEN_CROP_START,
)
from torch import Tensor

from .text_plan import MAX_PROMPT_TOKENS

__all__ = ["DEFAULT_NEGATIVE_PROMPT", "MAX_PROMPT_TOKENS", "TextConditioning", "TextEncoders", "encode_prompts"]

# The reference pipeline's negative prompt for CFG on base checkpoints.
DEFAULT_NEGATIVE_PROMPT = (
    "Static, 2D cartoon, cartoon, 2d animation, paintings, images, "
    "worst quality, low quality, ugly, deformed, walking backwards"
)
QWEN_CROP_START = _QWEN_CROP_START
CLIP_MAX_LENGTH = _CLIP_MAX_LENGTH
PROMPT_TEMPLATE = _PROMPT_TEMPLATE


@dataclass(frozen=True)
class TextConditioning:
    embeds: Tensor  # [1, S, in_text_dim] Qwen last hidden states after the template crop
    pooled: Tensor  # [1, in_text_dim2] CLIP pooled output
    mask: Tensor | None  # bool [1, S], None when nothing is padded


def check_prompt(prompt: str) -> None:
    if not prompt.strip():
        raise ValueError("the prompt is empty; expected a description of the video and its sound")


def qwen_inputs(processor: Any, prompt: str, pad_to: int | None, device: torch.device) -> dict[str, Tensor]:
    """The chat-templated prompt's input_ids and attention_mask (int64 [1, T]), T = template + prompt tokens (at most
    MAX_PROMPT_TOKENS after the crop), or pad_to after the crop with the padding masked."""
    check_prompt(prompt)
    text = PROMPT_TEMPLATE.format(prompt)
    if pad_to is None:
        inputs = processor(text=[text], max_length=MAX_PROMPT_TOKENS + QWEN_CROP_START, truncation=True,
                           return_tensors="pt")  # fmt: skip
    else:
        inputs = processor(text=[text], max_length=pad_to + QWEN_CROP_START, truncation=True,
                           padding="max_length", return_tensors="pt")  # fmt: skip
    return {"input_ids": inputs["input_ids"].to(device), "attention_mask": inputs["attention_mask"].to(device)}


def clip_inputs(tokenizer: Any, prompt: str, device: torch.device) -> dict[str, Tensor]:
    """CLIP's input_ids and attention_mask (int64 [1, 77]), padded to its context."""
    inputs = tokenizer([prompt], max_length=CLIP_MAX_LENGTH, truncation=True, add_special_tokens=True,
                       padding="max_length", return_tensors="pt")  # fmt: skip
    return {k: v.to(device) for k, v in inputs.items()}


def conditioning(last_hidden: Tensor, attention_mask: Tensor, pooled: Tensor) -> TextConditioning:
    """last_hidden: [1, T, in_text_dim] Qwen's last hidden states (after its final norm); attention_mask: [1, T];
    pooled: [1, in_text_dim2] → the conditioning with the template's tokens cropped."""
    embeds = last_hidden[:, QWEN_CROP_START:]
    if embeds.shape[1] == 0:
        raise ValueError("the prompt produced no tokens after the chat template")
    mask = attention_mask[:, QWEN_CROP_START:].to(torch.bool)
    return TextConditioning(embeds, pooled, None if bool(mask.all()) else mask)


class TextEncoders:
    """Both text encoders whole (transformers' `from_pretrained`) and their tokenizers, on one device: the reference
    for the streamed text phase, and what tests and tools use to check it."""

    def __init__(self, root: Path, device: torch.device, dtype: torch.dtype):
        from transformers import CLIPTextModel, CLIPTokenizer, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one k6fast progress bar per request, not one per weight file

        device_map = str(device) if device.type == "cuda" else None
        self.device = device
        self.processor = Qwen2_5_VLProcessor.from_pretrained(root / "tokenizer")
        self.qwen = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            root / "text_encoder", dtype=dtype, device_map=device_map
        ).eval()
        self.clip_tokenizer = CLIPTokenizer.from_pretrained(root / "tokenizer_2")
        self.clip = CLIPTextModel.from_pretrained(root / "text_encoder_2", dtype=dtype, device_map=device_map).eval()
        if device_map is None:
            self.qwen.to(device)
            self.clip.to(device)

    @torch.no_grad()
    def encode(self, prompt: str, pad_to: int | None = None) -> TextConditioning:
        """One prompt → conditioning. pad_to: pad the Qwen tokens (after the crop) to this length and mask them."""
        inputs = qwen_inputs(self.processor, prompt, pad_to, self.device)
        out = self.qwen(**inputs, output_hidden_states=True, return_dict=True)
        pooled = self.clip(**clip_inputs(self.clip_tokenizer, prompt, self.device)).pooler_output
        return conditioning(out.hidden_states[-1], inputs["attention_mask"], pooled)

    def close(self) -> None:
        """Drop both models and give their memory back before the DiT phase."""
        del self.qwen, self.clip
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def encode_prompts(
    root: Path,
    prompt: str,
    negative_prompt: str | None,
    device: torch.device,
    dtype: torch.dtype,
    pad_to: int | None = None,
) -> tuple[TextConditioning, TextConditioning | None]:
    """Encode the prompt (and the negative prompt when CFG needs one) with `TextEncoders` and release them."""
    encoders = TextEncoders(root, device, dtype)
    try:
        cond = encoders.encode(prompt, pad_to)
        uncond = encoders.encode(negative_prompt, pad_to) if negative_prompt is not None else None
    finally:
        encoders.close()
    return cond, uncond
