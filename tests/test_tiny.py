"""The tiny random-weight checkpoint: layout, determinism, and a real diffusers pipeline run on it (CPU)."""

import os

# Nothing here may reach a model hub; huggingface_hub reads this when it is first imported.
os.environ["HF_HUB_OFFLINE"] = "1"

import json
import math
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch

from k6fast.testing.model_constants import (
    AUDIO_SAMPLE_RATE,
    AUDIO_VAE_SCALING,
    FLAGS,
    N_GRID,
    PIPELINE_COMPONENTS,
    SCHEDULERS,
    VIDEO_LATENT_CHANNELS,
)
from k6fast.testing.tiny import make_tiny
from k6fast.testing.tokenizers import QWEN_CROP_START, QWEN_SPECIAL_TOKENS, qwen_prompt_prefix


@pytest.fixture(scope="module")
def pipelines(tiny_checkpoints: dict[str, Path]) -> dict:
    from diffusers import Kandinsky6TI2VAPipeline

    return {variant: Kandinsky6TI2VAPipeline.from_pretrained(path) for variant, path in tiny_checkpoints.items()}


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.parametrize("variant", ["distill", "base"])
def test_layout_matches_a_diffusers_checkpoint(tiny_checkpoints: dict[str, Path], variant: str) -> None:
    root = tiny_checkpoints[variant]
    index = _read_json(root / "model_index.json")
    assert index["_class_name"] == "Kandinsky6TI2VAPipeline"
    assert {k: v for k, v in index.items() if not k.startswith("_")} == {
        **PIPELINE_COMPONENTS,
        "scheduler": ["diffusers", SCHEDULERS[variant]],
    }
    for name in [*PIPELINE_COMPONENTS, "scheduler"]:
        assert (root / name).is_dir(), name
    assert not any(p.name.startswith(".") for p in root.parent.iterdir()), "a temporary build folder was left behind"

    # The two big components are sharded like the real ones, everything else is one file.
    for folder, index_name in (
        ("transformer", "diffusion_pytorch_model.safetensors.index.json"),
        ("text_encoder", "model.safetensors.index.json"),
    ):
        shard_index = _read_json(root / folder / index_name)
        shards = sorted(set(shard_index["weight_map"].values()))
        assert len(shards) >= 2, shards
        assert sorted(p.name for p in (root / folder).glob("*.safetensors")) == shards
        assert shards[0].endswith(f"-00001-of-{len(shards):05d}.safetensors")
    for folder in ("vae", "audio_vae", "vocoder"):
        assert [p.name for p in (root / folder).glob("*.safetensors")] == ["diffusion_pytorch_model.safetensors"]
    assert [p.name for p in (root / "text_encoder_2").glob("*.safetensors")] == ["model.safetensors"]
    assert (root / "tokenizer" / "processor_config.json").is_file()
    assert (root / "tokenizer" / "tokenizer.json").is_file()
    assert (root / "tokenizer_2" / "tokenizer.json").is_file()

    total = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    assert total < 8 * 2**20, f"tiny checkpoint is {total / 2**20:.1f} MiB"


@pytest.mark.parametrize("variant", ["distill", "base"])
def test_configs_agree_across_components(tiny_checkpoints: dict[str, Path], variant: str) -> None:
    root = tiny_checkpoints[variant]
    dit = _read_json(root / "transformer" / "config.json")
    vae = _read_json(root / "vae" / "config.json")
    audio_vae = _read_json(root / "audio_vae" / "config.json")
    vocoder = _read_json(root / "vocoder" / "config.json")
    qwen = _read_json(root / "text_encoder" / "config.json")
    clip = _read_json(root / "text_encoder_2" / "config.json")
    scheduler = _read_json(root / "scheduler" / "scheduler_config.json")

    widen = N_GRID if variant == "distill" else 1
    assert dit["in_visual_dim"] == vae["latent_channels"] == VIDEO_LATENT_CHANNELS
    assert dit["out_visual_dim"] == widen * dit["in_visual_dim"]
    assert dit["in_audio_dim"] == audio_vae["latent_channels"]
    assert dit["out_audio_dim"] == widen * dit["in_audio_dim"]
    assert dit["in_text_dim"] == qwen["text_config"]["hidden_size"]
    assert dit["in_text_dim2"] == clip["hidden_size"]
    assert sum(dit["axes_dims"]) == sum(dit["axes_dims_a"])
    for flag, value in FLAGS.items():
        assert dit[flag] == (list(value) if isinstance(value, tuple) else value), flag
    assert (vae["temporal_compression_ratio"], vae["spatial_compression_ratio"]) == (4, 8)
    assert vocoder["num_mels"] == audio_vae["mel_bins"]
    assert math.prod(vocoder["upsample_rates"]) == audio_vae["hop_length"] == 512
    assert audio_vae["sample_rate"] == AUDIO_SAMPLE_RATE
    assert audio_vae["scaling_factor"] == pytest.approx(AUDIO_VAE_SCALING[variant])
    text = qwen["text_config"]
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    assert sum(text["rope_parameters"]["mrope_section"]) == head_dim // 2
    assert scheduler["_class_name"] == SCHEDULERS[variant]
    assert scheduler["shift"] == 5.0
    if variant == "distill":
        assert (scheduler["n_grid"], scheduler["num_policy_substeps"]) == (10, 128)
        assert (scheduler["eps"], scheduler["final_step_size_scale"]) == (1e-6, 0.5)


def test_same_seed_same_bytes_other_seed_other_weights(
    tmp_path: Path, tiny_checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    rng_state = torch.random.get_rng_state()
    (tmp_path / "again").mkdir()  # an existing empty folder is accepted
    again = make_tiny(tmp_path / "again", "distill", seed=0)
    other = make_tiny(tmp_path / "other", "distill", seed=1)
    assert torch.equal(torch.random.get_rng_state(), rng_state), "building must leave the global RNG alone"

    reference = _files(tiny_checkpoints["distill"])
    assert _files(again) == reference
    other_files = _files(other)
    assert other_files.keys() == reference.keys()
    weights = [name for name in reference if name.endswith(".safetensors")]
    assert len(weights) >= 9
    # Every weight file changes with the seed (the tokenizers are trained, not sampled, and stay the same).
    changed = {name.split("/")[0] for name in weights if other_files[name] != reference[name]}
    assert changed == {"transformer", "vae", "text_encoder", "text_encoder_2", "audio_vae", "vocoder"}


def test_refuses_a_non_empty_folder_and_bad_arguments(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "keep.txt").write_text("user data")
    with pytest.raises(FileExistsError, match="non-empty"):
        make_tiny(target)
    assert [p.name for p in target.iterdir()] == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    with pytest.raises(ValueError, match="variant must be one of"):
        make_tiny(tmp_path / "x", variant="lite")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seed must be"):
        make_tiny(tmp_path / "x", seed=-1)
    assert not (tmp_path / "x").exists()


def test_tokenizers_behave_like_the_real_ones(pipelines: dict) -> None:
    pipe = pipelines["distill"]
    qwen = pipe.tokenizer.tokenizer
    # The pipeline crops exactly the chat-template prefix, so the kept embeddings start at the prompt.
    prefix_ids = qwen(qwen_prompt_prefix())["input_ids"]
    assert len(prefix_ids) == QWEN_CROP_START
    assert prefix_ids[0] == qwen.convert_tokens_to_ids("<|im_start|>")
    for token in QWEN_SPECIAL_TOKENS:
        assert qwen.convert_ids_to_tokens(qwen(token)["input_ids"]) == [token]
    batch = pipe.tokenizer(text=["a cat", "a red ball bouncing"], padding="max_length", max_length=12)
    assert batch["attention_mask"][0][0] == 1 and batch["attention_mask"][0][-1] == 0, "Qwen pads on the right"
    assert batch["input_ids"][0][-1] == qwen.convert_tokens_to_ids("<|endoftext|>")

    clip = pipe.tokenizer_2
    ids = clip("A Cat")["input_ids"]
    tokens = clip.convert_ids_to_tokens(ids)
    assert tokens[0] == "<|startoftext|>" and tokens[-1] == "<|endoftext|>"
    assert tokens[1] == "a</w>" and tokens[-2].endswith("t</w>"), tokens  # lower-cased, word ends marked
    assert clip.decode(ids, skip_special_tokens=True) == "a cat"
    assert pipe.text_encoder_2.config.eos_token_id == clip.eos_token_id == len(clip) - 1


def _generate(pipe, image: PIL.Image.Image | None, num_frames: int, guidance_scale: float):
    return pipe(
        prompt="A red ball bouncing on a wooden floor",
        image=image,
        height=64,
        width=64,
        num_frames=num_frames,
        num_inference_steps=2,
        guidance_scale=guidance_scale,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    )


@pytest.mark.parametrize(("variant", "guidance_scale", "num_frames"), [("distill", 1.0, 17), ("base", 5.0, 5)])
def test_pipeline_generates_video_and_audio(pipelines: dict, variant: str, guidance_scale: float, num_frames: int):
    pipe = pipelines[variant]
    rgb = np.random.default_rng(0).integers(0, 256, size=(80, 96, 3), dtype=np.uint8)
    latent_frames = (num_frames - 1) // 4 + 1
    audio_steps = math.ceil(((latent_frames - 1) * 4 + 1) / 24 * 44_100 / 1024)

    outputs = {}
    for name, image in (("text", None), ("image", PIL.Image.fromarray(rgb))):
        out = _generate(pipe, image, num_frames, guidance_scale)
        frames, audio = out.frames, out.audio
        assert frames.shape == (1, num_frames, 64, 64, 3), name
        assert np.isfinite(frames).all() and frames.min() >= 0.0 and frames.max() <= 1.0, name
        assert frames.std() > 1e-3, f"{name}: the VAE decoded a constant video"
        assert audio.shape == (1, audio_steps * 1024), name
        assert np.isfinite(audio).all() and np.abs(audio).max() <= 1.0, name
        assert audio.std() > 1e-5, f"{name}: the vocoder produced silence"
        outputs[name] = frames
    assert not np.allclose(outputs["text"], outputs["image"]), "the reference image did not condition the video"
