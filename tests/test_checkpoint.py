"""Checkpoint resolution and validation: variant from the checkpoint's own files; broken checkpoints fail at load
with the file named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from k6fast.checkpoint import CheckpointError, open_checkpoint


@pytest.fixture
def copy_of(tmp_path):
    def make(src: Path) -> Path:
        dst = tmp_path / "ckpt-copy"
        shutil.copytree(src, dst)
        return dst

    return make


def test_variant_comes_from_the_checkpoint_files(tiny_checkpoints, tmp_path) -> None:
    distill, base = open_checkpoint(tiny_checkpoints["distill"]), open_checkpoint(tiny_checkpoints["base"])
    assert distill.distilled and distill.default_steps == 10 and distill.default_guidance == 1.0
    assert not base.distilled and base.default_steps == 50 and base.default_guidance == 5.0
    assert distill.variant == "custom-distill" and base.variant == "custom"
    # A misleading directory name changes nothing.
    renamed = tmp_path / "Kandinsky-6.0-Pro-base"
    shutil.copytree(tiny_checkpoints["distill"], renamed)
    assert open_checkpoint(renamed).distilled
    assert len(distill.transformer_files) > 1  # the tiny checkpoint is sharded like real ones


def test_truncated_shard_is_named(tiny_distill, copy_of) -> None:
    ckpt = copy_of(tiny_distill)
    shard = sorted((ckpt / "transformer").glob("*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=rf"{shard.name}.*truncated"):
        open_checkpoint(ckpt)


def test_missing_shard_is_named(tiny_distill, copy_of) -> None:
    ckpt = copy_of(tiny_distill)
    shard = sorted((ckpt / "transformer").glob("*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"missing shard .*{shard.name}"):
        open_checkpoint(ckpt)


def test_config_that_does_not_match_the_tensors(tiny_distill, copy_of) -> None:
    ckpt = copy_of(tiny_distill)
    config_path = ckpt / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config["num_visual_blocks"] += 1
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="tensors missing.*visual_transformer_blocks"):
        open_checkpoint(ckpt)
    config["num_visual_blocks"] -= 1
    config["ff_dim"] *= 2
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"has shape .* transformer/config.json implies"):
        open_checkpoint(ckpt)


def test_missing_component_and_bad_scheduler(tiny_distill, copy_of) -> None:
    ckpt = copy_of(tiny_distill)
    shutil.rmtree(ckpt / "audio_vae")
    with pytest.raises(CheckpointError, match="audio_vae"):
        open_checkpoint(ckpt)
    shutil.copytree(tiny_distill / "audio_vae", ckpt / "audio_vae")
    sched = ckpt / "scheduler" / "scheduler_config.json"
    sched.write_text(json.dumps({"_class_name": "DDIMScheduler"}))
    with pytest.raises(CheckpointError, match="DDIMScheduler.*not supported"):
        open_checkpoint(ckpt)


def test_model_that_is_neither_directory_nor_hub_id(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="not a Hub id"):
        open_checkpoint(str(tmp_path / "nowhere" / "deep" / "path"))
    with pytest.raises(CheckpointError, match="not in the local Hugging Face cache"):
        open_checkpoint("nobody-here/not-a-model")
