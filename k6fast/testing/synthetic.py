"""`k6fast make-synthetic`: a random-weight checkpoint with the real Kandinsky 6 tensor names and shapes, for measuring
speed and memory where the real weights are not available.

The transformer is the real thing in everything but values: the Pro (or Lite) config, every tensor name and shape,
bf16, sharded like the release, with `--blocks` lowering the depth to fit a disk. The video VAE, audio VAE and
vocoder use diffusers' default (release) configurations. The text encoders are one of:

- `one-layer` (default): the real output widths (Qwen2.5-VL 3584, CLIP 768) but one layer each, for runs that do not
  measure the text phase; flagged in `synthetic.json` so no figure from them is mistaken for the real text phase.
- `full`: Qwen2.5-VL-7B with its vision tower and CLIP-L's text model at their real shapes, random weights (about
  16.8 GB; `synthetic_text.py`). `text_encoder_dir` writes them to another folder (e.g. one in /dev/shm, when the
  disk cannot hold them beside the DiT) and links `text_encoder/` and `text_encoder_2/` of the checkpoint to it.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from ..atomic import build_dir_atomically
from ..dit.config import DiTConfig, expected_shapes
from .model_constants import (
    AUDIO_LATENT_CHANNELS,
    AUDIO_VAE_SCALING,
    CLIP_HIDDEN,
    FLAGS,
    FLOW_MATCH_SCHEDULER,
    N_GRID,
    PIFLOW_SCHEDULER,
    PIPELINE_COMPONENTS,
    QWEN_HIDDEN,
    SCHEDULERS,
    SIZES,
    VIDEO_LATENT_CHANNELS,
)
from .synthetic_text import shard_groups

if TYPE_CHECKING:
    import torch

# preset → (the release's size, distilled)
PRESETS: dict[str, tuple[str, bool]] = {
    "pro-distill": ("pro", True),
    "pro": ("pro", False),
    "lite-distill": ("lite", True),
    "lite": ("lite", False),
}
SHARD_BYTES = 5 * 2**30
TEXT_ENCODERS = {
    "one-layer": "real output widths, one layer each: not representative of the text phase's cost",
    "full": "real shapes, random weights: Qwen2.5-VL-7B with its vision tower, CLIP ViT-L/14 text",
}


def transformer_config(preset: str, blocks: int | None) -> dict:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    size, distilled = PRESETS[preset]
    p = dict(SIZES[size])
    n_grid = N_GRID if distilled else 1
    if blocks is not None:
        if not 1 <= blocks <= p["num_visual_blocks"]:
            raise ValueError(f"--blocks must be in 1..{p['num_visual_blocks']} for {preset}, found {blocks}")
        p["num_visual_blocks"] = blocks
    config = {
        "_class_name": "Kandinsky6Transformer3DModel",
        "_diffusers_version": "0.42.1",
        "in_visual_dim": VIDEO_LATENT_CHANNELS,
        "out_visual_dim": VIDEO_LATENT_CHANNELS * n_grid,
        "in_audio_dim": AUDIO_LATENT_CHANNELS,
        "out_audio_dim": AUDIO_LATENT_CHANNELS * n_grid,
        "in_text_dim": QWEN_HIDDEN,
        "in_text_dim2": CLIP_HIDDEN,
        "axes_dims_a": None,
        **FLAGS,
        **p,
    }
    return {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}


def _init_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator, device: str) -> torch.Tensor:
    """Values at the scale of a freshly initialised model: nn.Linear's uniform(±1/sqrt(fan_in)) as a normal with
    the same variance, zero biases, unit norm weights, small embeddings."""
    import torch

    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    if "norm" in name:
        return torch.ones(shape, dtype=torch.bfloat16)
    std = 0.02 if len(shape) == 1 or "embeddings.weight" in name else 1.0 / math.sqrt(3 * shape[-1])
    t = torch.randn(shape, generator=generator, device=device, dtype=torch.float32) * std
    return t.to(torch.bfloat16).cpu()


def _write_transformer(folder: Path, config: dict, seed: int) -> int:
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shapes = expected_shapes(DiTConfig.from_dict(config))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device).manual_seed(seed)
    # Group into shards of about SHARD_BYTES, in name order, holding one shard in host memory at a time.
    groups = shard_groups(shapes, SHARD_BYTES)
    weight_map, total = {}, 0
    for i, names in enumerate(groups):
        file = f"diffusion_pytorch_model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {name: _init_tensor(name, shapes[name], generator, device) for name in names}
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        total += sum(t.numel() * 2 for t in tensors.values())
        weight_map.update({name: file for name in names})
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def _write_small_components(root: Path, distilled: bool, seed: int, text_encoders: str) -> None:
    """Tokenizers, text encoders (the one-layer ones here; full ones are `synthetic_text`'s), VAEs, scheduler."""
    import torch
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        MMAudioVAE,
        MMAudioVocoder,
        PiflowScheduler,
    )

    from .tokenizers import build_clip_tokenizer, build_qwen_processor

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        processor, clip_tokenizer = build_qwen_processor(), build_clip_tokenizer()
        processor.save_pretrained(root / "tokenizer")
        clip_tokenizer.save_pretrained(root / "tokenizer_2")
        if text_encoders == "one-layer":
            _write_one_layer_text_encoders(root, processor, clip_tokenizer)
        AutoencoderKLHunyuanVideo().to(torch.bfloat16).save_pretrained(root / "vae")
        scaling = AUDIO_VAE_SCALING["distill" if distilled else "base"]
        MMAudioVAE(scaling_factor=scaling).to(torch.bfloat16).save_pretrained(root / "audio_vae")
        MMAudioVocoder().to(torch.bfloat16).save_pretrained(root / "vocoder")
    scheduler = (
        PiflowScheduler(**PIFLOW_SCHEDULER) if distilled else FlowMatchEulerDiscreteScheduler(**FLOW_MATCH_SCHEDULER)
    )
    scheduler.save_pretrained(root / "scheduler")


def _write_one_layer_text_encoders(root: Path, processor, clip_tokenizer) -> None:
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from .tokenizers import QWEN_SPECIAL_TOKENS

    ids = {t: processor.tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    qwen = Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config={
                "vocab_size": len(processor.tokenizer), "hidden_size": QWEN_HIDDEN, "intermediate_size": 1024,
                "num_hidden_layers": 1, "num_attention_heads": 28, "num_key_value_heads": 4,
                "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
                "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
                "pad_token_id": ids["<|endoftext|>"],
            },
            vision_config={
                "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                "out_hidden_size": QWEN_HIDDEN, "fullatt_block_indexes": [0],
            },
            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        )
    )  # fmt: skip
    qwen.to(torch.bfloat16).save_pretrained(root / "text_encoder")
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(clip_tokenizer), hidden_size=CLIP_HIDDEN, intermediate_size=1024,
            projection_dim=CLIP_HIDDEN, num_hidden_layers=1, num_attention_heads=12, max_position_embeddings=77,
            bos_token_id=clip_tokenizer.bos_token_id, eos_token_id=clip_tokenizer.eos_token_id,
            pad_token_id=clip_tokenizer.pad_token_id,
        )
    )  # fmt: skip
    clip.to(torch.bfloat16).save_pretrained(root / "text_encoder_2")


def make_synthetic(
    out_dir: str | Path,
    preset: str = "pro-distill",
    blocks: int | None = None,
    seed: int = 0,
    text_encoders: str = "one-layer",
    text_encoder_dir: str | Path | None = None,
) -> Path:
    """Write the synthetic checkpoint to `out_dir` (built beside it, then renamed; a non-empty dir is refused).
    text_encoders: "one-layer" or "full" (see the module docstring); text_encoder_dir: with "full", a missing or empty
    folder that receives `text_encoder/` and `text_encoder_2/`, linked from the checkpoint."""
    config = transformer_config(preset, blocks)
    distilled = PRESETS[preset][1]
    if text_encoders not in TEXT_ENCODERS:
        raise ValueError(f"unknown text encoders {text_encoders!r}; expected one of {sorted(TEXT_ENCODERS)}")
    if text_encoder_dir is not None and text_encoders != "full":
        raise ValueError("a separate text-encoder folder holds full-size text encoders; pass text_encoders='full'")
    if text_encoder_dir is not None and Path(text_encoder_dir).exists():
        folder = Path(text_encoder_dir)
        if not folder.is_dir() or any(folder.iterdir()):
            raise FileExistsError(f"expected a missing or empty directory for the text encoders, found {folder}")
    linked: list[Path] = []

    def build(tmp: Path) -> None:
        total = _write_transformer(tmp / "transformer", config, seed)
        _write_small_components(tmp, distilled, seed, text_encoders)
        text_bytes = None
        if text_encoders == "full":
            text_bytes = _write_full_text_encoders(tmp, seed, text_encoder_dir, linked)
        scheduler = SCHEDULERS["distill" if distilled else "base"]
        model_index = {
            "_class_name": "Kandinsky6TI2VAPipeline",
            "_diffusers_version": "0.42.1",
            **PIPELINE_COMPONENTS,
            "scheduler": ["diffusers", scheduler],
        }
        (tmp / "model_index.json").write_text(json.dumps(model_index, indent=2) + "\n")
        note = {
            "synthetic": True,
            "preset": preset,
            "num_visual_blocks": config["num_visual_blocks"],
            "full_depth_blocks": SIZES[PRESETS[preset][0]]["num_visual_blocks"],
            "transformer_bytes": total,
            "seed": seed,
            "text_encoders": TEXT_ENCODERS[text_encoders],
            "text_encoder_bytes": text_bytes,
            "text_encoder_dir": None if not linked else str(linked[0]),
        }
        (tmp / "synthetic.json").write_text(json.dumps(note, indent=2) + "\n")

    try:
        return build_dir_atomically(out_dir, build, "synthetic checkpoint")
    except BaseException:
        for folder in linked:  # written for this checkpoint, which does not exist
            shutil.rmtree(folder, ignore_errors=True)
        raise


def _write_full_text_encoders(root: Path, seed: int, text_encoder_dir: str | Path | None, linked: list[Path]) -> int:
    """The real-size text encoders into the checkpoint, or into `text_encoder_dir` with links from the checkpoint
    (recorded in `linked` so a failed build can remove them)."""
    from transformers import CLIPTokenizer, Qwen2_5_VLProcessor

    from .synthetic_text import write_text_encoders

    processor = Qwen2_5_VLProcessor.from_pretrained(root / "tokenizer")
    clip_tokenizer = CLIPTokenizer.from_pretrained(root / "tokenizer_2")
    if text_encoder_dir is None:
        return write_text_encoders(root, processor, clip_tokenizer, seed)
    total = 0

    def build(tmp: Path) -> None:
        nonlocal total
        total = write_text_encoders(tmp, processor, clip_tokenizer, seed)

    target = build_dir_atomically(text_encoder_dir, build, "text encoders").resolve()
    linked.append(target)
    for name in ("text_encoder", "text_encoder_2"):
        (root / name).symlink_to(target / name, target_is_directory=True)
    return total
