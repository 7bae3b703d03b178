"""Prompt encoding: Qwen2.5-VL hidden states (chat template, 129 template tokens cropped) and the CLIP pooled
embedding, with transformers' models loaded for the text phase only and dropped after it.

By default the prompt is neither padded nor masked: Qwen2.5-VL is causal, so right-padding does not change the
states of the real tokens, and a masked attention over padding equals an unmasked one over the real tokens. The
reference pipeline pads to 1,153 tokens and masks; `pad_to` reproduces that for parity checks.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers.pipelines.kandinsky6.pipeline_kandinsky6_ti2va import (
    _CLIP_MAX_LENGTH,
    _PROMPT_TEMPLATE,
    _QWEN_CROP_START,
)
from torch import Tensor

# The reference pipeline's negative prompt for CFG on base checkpoints.
DEFAULT_NEGATIVE_PROMPT = (
    "Static, 2D cartoon, cartoon, 2d animation, paintings, images, "
    "worst quality, low quality, ugly, deformed, walking backwards"
)
MAX_PROMPT_TOKENS = 1024


@dataclass(frozen=True)
class TextConditioning:
    embeds: Tensor  # [1, S, in_text_dim] Qwen last hidden states after the template crop
    pooled: Tensor  # [1, in_text_dim2] CLIP pooled output
    mask: Tensor | None  # bool [1, S], None when nothing is padded


class TextEncoders:
    """Both text encoders and their tokenizers, on one device, for the duration of the text phase."""

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
        if not prompt.strip():
            raise ValueError("the prompt is empty; expected a description of the video and its sound")
        text = _PROMPT_TEMPLATE.format(prompt)
        max_length = MAX_PROMPT_TOKENS + _QWEN_CROP_START
        if pad_to is None:
            inputs = self.processor(text=[text], max_length=max_length, truncation=True, return_tensors="pt")
        else:
            inputs = self.processor(
                text=[text],
                max_length=pad_to + _QWEN_CROP_START,
                truncation=True,
                padding="max_length",
                return_tensors="pt",
            )
        inputs = inputs.to(self.device)
        out = self.qwen(
            input_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            output_hidden_states=True,
            return_dict=True,
        )
        embeds = out.hidden_states[-1][:, _QWEN_CROP_START:]
        if embeds.shape[1] == 0:
            raise ValueError("the prompt produced no tokens after the chat template")
        mask = inputs["attention_mask"][:, _QWEN_CROP_START:].to(torch.bool)
        mask = None if bool(mask.all()) else mask

        clip_inputs = self.clip_tokenizer(
            [prompt],
            max_length=_CLIP_MAX_LENGTH,
            truncation=True,
            add_special_tokens=True,
            padding="max_length",
            return_tensors="pt",
        ).to(self.device)
        pooled = self.clip(**clip_inputs).pooler_output
        return TextConditioning(embeds, pooled, mask)

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
    """Encode the prompt (and the negative prompt when CFG needs one) and release the encoders."""
    encoders = TextEncoders(root, device, dtype)
    try:
        cond = encoders.encode(prompt, pad_to)
        uncond = encoders.encode(negative_prompt, pad_to) if negative_prompt is not None else None
    finally:
        encoders.close()
    return cond, uncond
