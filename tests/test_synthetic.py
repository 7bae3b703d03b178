"""`make_synthetic`: a checkpoint the runtime opens and validates like a released one (every tensor name and shape of
the preset, sharded), with its note saying what it is. One block of the smallest preset keeps it to a few seconds."""

from __future__ import annotations

import json

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
