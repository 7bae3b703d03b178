"""`make_synthetic`: a checkpoint the runtime opens and validates like a released one (every tensor name and shape of
the preset, sharded), with its note saying what it is. One block of the smallest preset keeps it to a few seconds."""

from __future__ import annotations

import json
import math

import pytest

from k6fast.checkpoint import open_checkpoint
from k6fast.dit.config import expected_shapes
from k6fast.safetensors_index import index_safetensors
from k6fast.testing.model_constants import PIPELINE_COMPONENTS
from k6fast.testing.synthetic import make_synthetic


def test_a_synthetic_checkpoint_opens_with_the_presets_shapes(tmp_path) -> None:
    root = make_synthetic(tmp_path / "syn", preset="lite-distill", blocks=1, seed=3)
    ckpt = open_checkpoint(root)  # checks every tensor against the config's expected shapes
    assert ckpt.distilled and ckpt.dit.num_visual_blocks == 1 and ckpt.dit.model_dim == 1792
    index = index_safetensors(list(ckpt.transformer_files))
    assert {name: tuple(loc.shape) for name, loc in index.items()} == expected_shapes(ckpt.dit)
    model_index = json.loads((root / "model_index.json").read_text())
    assert {k: v for k, v in model_index.items() if k in PIPELINE_COMPONENTS} == PIPELINE_COMPONENTS
    assert model_index["scheduler"] == ["diffusers", "PiflowScheduler"]
    note = json.loads((root / "synthetic.json").read_text())
    assert note["synthetic"] and note["preset"] == "lite-distill" and note["num_visual_blocks"] == 1


def test_depth_outside_the_preset_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="--blocks must be in 1..32 for lite-distill, found 33"):
        make_synthetic(tmp_path / "syn", preset="lite-distill", blocks=33)
    assert not (tmp_path / "syn").exists()


def _token_ids() -> dict[str, int]:
    from k6fast.testing.tokenizers import QWEN_SPECIAL_TOKENS, build_qwen_processor

    tokenizer = build_qwen_processor().tokenizer
    return {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}


def test_full_text_encoders_have_the_release_shapes_without_writing_them() -> None:
    from k6fast.testing.model_constants import CLIP_L_TEXT_PARAMETERS, QWEN_7B_PARAMETERS
    from k6fast.testing.synthetic_text import clip_config, clip_shapes, qwen_config, qwen_shapes
    from k6fast.testing.tokenizers import build_clip_tokenizer

    config = qwen_config(_token_ids())
    text, vision = config.text_config, config.vision_config
    assert (text.hidden_size, text.intermediate_size, text.num_hidden_layers) == (3584, 18944, 28)
    assert (text.num_attention_heads, text.num_key_value_heads, text.vocab_size) == (28, 4, 152064)
    assert text.rope_parameters["mrope_section"] == [16, 24, 24] and text.rope_parameters["rope_theta"] == 1e6
    assert text.rms_norm_eps == 1e-6 and not config.tie_word_embeddings and not text.use_sliding_window
    assert (vision.depth, vision.hidden_size, vision.intermediate_size) == (32, 1280, 3420)
    assert vision.out_hidden_size == 3584
    assert vision.fullatt_block_indexes == [7, 15, 23, 31] and vision.tokens_per_second == 2
    shapes = qwen_shapes(config)
    assert sum(math.prod(s) for s in shapes.values()) == QWEN_7B_PARAMETERS  # 16,584,333,312 bytes in bf16
    assert len(shapes) == 729
    assert shapes["model.layers.27.mlp.down_proj.weight"] == (3584, 18944)
    assert shapes["model.layers.0.self_attn.k_proj.bias"] == (512,)
    assert shapes["visual.blocks.31.attn.qkv.weight"] == (3840, 1280)
    assert shapes["visual.merger.mlp.2.weight"] == (3584, 5120)
    assert shapes["lm_head.weight"] == shapes["model.embed_tokens.weight"] == (152064, 3584)
    clip = clip_shapes(clip_config(build_clip_tokenizer()))
    assert sum(math.prod(s) for s in clip.values()) == CLIP_L_TEXT_PARAMETERS and len(clip) == 196
    assert clip["text_model.embeddings.position_embedding.weight"] == (77, 768)
    assert clip["text_model.encoder.layers.11.mlp.fc1.weight"] == (3072, 768)


def test_the_release_names_are_those_transformers_writes(tiny_distill) -> None:
    from transformers import AutoConfig

    from k6fast.testing.synthetic_text import qwen_shapes

    written = index_safetensors(sorted((tiny_distill / "text_encoder").glob("*.safetensors")))
    assert qwen_shapes(AutoConfig.from_pretrained(tiny_distill / "text_encoder")) == {
        name: loc.shape for name, loc in written.items()
    }


# Real names and the release's code path, small widths: what a CPU test can write and run.
REDUCED_QWEN_TEXT = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rope_parameters={
                             "rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]})  # fmt: skip
REDUCED_QWEN_VISION = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=256,
                           fullatt_block_indexes=[1])  # fmt: skip
REDUCED_CLIP = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=2, projection_dim=64)  # fmt: skip


def test_full_text_encoders_in_a_linked_folder(tmp_path, monkeypatch) -> None:
    import torch
    from safetensors import safe_open
    from transformers import CLIPTextModel, Qwen2_5_VLForConditionalGeneration

    from k6fast.testing import synthetic_text
    from k6fast.text import TextEncoders
    from k6fast.text_phase import TextPhase

    for name, reduced in (("QWEN_7B_TEXT", REDUCED_QWEN_TEXT), ("QWEN_7B_VISION", REDUCED_QWEN_VISION),
                          ("CLIP_L_TEXT", REDUCED_CLIP)):  # fmt: skip
        monkeypatch.setattr(synthetic_text, name, {**getattr(synthetic_text, name), **reduced})
    monkeypatch.setattr(synthetic_text, "QWEN_SHARD_BYTES", 1_000_000)  # sharded like the release
    monkeypatch.setattr(synthetic_text, "CHUNK_ELEMENTS", 50_000)  # many chunks per tensor
    text_dir = tmp_path / "shm" / "k6-text"
    root = make_synthetic(tmp_path / "syn", preset="lite-distill", blocks=1, seed=1, text_encoders="full",
                          text_encoder_dir=text_dir)  # fmt: skip
    open_checkpoint(root)  # follows the links, checks every safetensors header
    for name in ("text_encoder", "text_encoder_2"):
        assert (root / name).is_symlink() and (root / name).resolve() == text_dir.resolve() / name
    qwen_files = sorted((text_dir / "text_encoder").glob("model-*.safetensors"))
    assert len(qwen_files) > 1
    note = json.loads((root / "synthetic.json").read_text())
    assert note["text_encoders"].startswith("real shapes, random weights")
    assert note["text_encoder_dir"] == str(text_dir.resolve())
    files = [*qwen_files, text_dir / "text_encoder_2" / "model.safetensors"]
    assert note["text_encoder_bytes"] == sum(loc.nbytes for loc in index_safetensors(files).values())

    with safe_open(str(text_dir / "text_encoder_2" / "model.safetensors"), "pt") as f:
        assert all(name.startswith("text_model.") for name in f.keys())  # noqa: SIM118
        assert torch.equal(f.get_tensor("text_model.final_layer_norm.weight"), torch.ones(64, dtype=torch.bfloat16))
        assert not f.get_tensor("text_model.encoder.layers.0.mlp.fc1.bias").any()
        fc2 = f.get_tensor("text_model.encoder.layers.0.mlp.fc2.weight").float()
        assert abs(fc2.std().item() * math.sqrt(3 * 128) - 1) < 0.05
    for cls, name in ((Qwen2_5_VLForConditionalGeneration, "text_encoder"), (CLIPTextModel, "text_encoder_2")):
        _, info = cls.from_pretrained(root / name, output_loading_info=True)
        assert not any(info.values()), info

    cpu = torch.device("cpu")
    phase = TextPhase(root, cpu, torch.bfloat16)
    reference = TextEncoders(root, cpu, torch.bfloat16)
    try:
        cond, uncond = phase.encode("A fox runs through snow", "blurry")
        assert torch.isfinite(cond.embeds).all() and torch.isfinite(cond.pooled).all()
        assert cond.embeds.shape[-1] == 256 and cond.pooled.shape == (1, 64)
        assert torch.equal(cond.embeds, reference.encode("A fox runs through snow").embeds)
        assert torch.equal(uncond.pooled, reference.encode("blurry").pooled)
    finally:
        phase.close()
        reference.close()


def test_a_text_encoder_folder_is_for_full_encoders_and_must_be_empty(tmp_path) -> None:
    with pytest.raises(ValueError, match="pass text_encoders='full'"):
        make_synthetic(tmp_path / "syn", preset="lite-distill", blocks=1, text_encoder_dir=tmp_path / "text")
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "keep.txt").write_text("user data")
    with pytest.raises(FileExistsError, match="text encoders"):
        make_synthetic(tmp_path / "syn", preset="lite-distill", blocks=1, text_encoders="full",
                       text_encoder_dir=tmp_path / "text")  # fmt: skip
    assert not (tmp_path / "syn").exists() and (tmp_path / "text" / "keep.txt").read_text() == "user data"
