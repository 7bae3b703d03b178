"""The headline arms (`final`, `fast`) load, and the gate scores them against `reference` on the tiny
checkpoint on CPU. On CPU the GPU-only parts of these arms (fused kernels, fp8/fp16acc GEMMs, quantized attention
with the tiny model's head_dim 16) fall back to the exact path, so what the gate measures here is the step cache
(and compile's float reassociation): small, non-zero, and reported."""

from __future__ import annotations

import argparse
import json

import pytest

from k6fast.checkpoint import open_checkpoint
from k6fast.quality_gate import GateError
from k6fast.quality_gate.clips import check_arms_fit, load_arm
from k6fast.quality_gate.command import EXIT_PLUMBING, register
from k6fast.quality_gate.config import SET_A
from k6fast.switches import list_arms, load_options

pytestmark = pytest.mark.slow


def test_headline_arms_are_valid_and_lossy_where_declared() -> None:
    assert {"reference", "final", "fast", "step-cache"} <= set(list_arms())
    final, fast = load_options(environ={}, arm="final"), load_options(environ={}, arm="fast")
    assert final.fused_elementwise and final.compile and final.piflow_cache_steps == (8,)
    assert final.gemm == "auto" and final.attn == "auto"  # bf16 + exact on Hopper/CPU, fp16acc + k6 on GeForce
    assert fast.gemm == "auto-lossy" and fast.attn == "k6" and fast.piflow_cache_steps == (5, 8)
    assert final.arm_hash() != fast.arm_hash() != load_options(environ={}, arm="reference").arm_hash()


def test_gate_scores_final_and_fast_on_the_tiny_checkpoint(tiny_distill, tmp_path) -> None:
    prompt_set = json.loads(SET_A.read_text())
    prompt_set["prompts"] = prompt_set["prompts"][:1]
    (tmp_path / "prompts.json").write_text(json.dumps(prompt_set))
    parser = argparse.ArgumentParser(prog="k6fast")
    register(parser.add_subparsers(dest="command", required=True))
    argv = ["gate", "--model", str(tiny_distill), "--prompts", str(tmp_path / "prompts.json"), "--out",
            str(tmp_path / "out"), "--size", "64x64", "--frames", "9", "--steps", "10", "--seeds", "42",
            "--lpips-backbone", "random", "--reference", "reference", "--arm", "final", "--arm", "fast"]  # fmt: skip
    args = parser.parse_args(argv)
    assert args.func(args) == EXIT_PLUMBING  # the random backbone: every stage ran, no verdict
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    arms = {a["label"]: a for a in report["arms"]}
    assert set(arms) == {"final", "fast"}
    for label, arm in arms.items():
        assert arm["passed"], label
        assert 0 < arm["set"]["lpips_mean"] < 0.15, label  # the cached steps move the clip, a little
    assert (tmp_path / "out" / "report.md").is_file()


def test_the_arms_fit_check_asks_only_what_the_checkpoint_applies(tiny_checkpoints) -> None:
    # step-cache's K6_PIFLOW_CACHE_STEPS=8 does not fit 4 steps of a distilled schedule; a base checkpoint does not
    # apply it, so 4 steps fit there.
    arms = [load_arm("reference", "reference"), load_arm("step-cache", "step-cache")]
    check_arms_fit(arms, 4, open_checkpoint(tiny_checkpoints["base"]))
    with pytest.raises(GateError, match="arm step-cache: .*outside the schedule"):
        check_arms_fit(arms, 4, open_checkpoint(tiny_checkpoints["distill"]))
