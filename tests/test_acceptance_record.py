"""The residency planner's activation estimate held against the denoise-phase peaks the full-size acceptance run
measured on the GPU (measurements/sessions/2026-12-01_acceptance-full): for every k6fast run, the memory allocated
above the planned weights while denoising stays within the estimate the planner makes today for that arm, and the
whole plan (weights, activations, reserve) within the run's budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k6fast.dit.arch import TARGETS, resolve_for
from k6fast.dit.config import DiTConfig
from k6fast.stream.plan import GiB, activation_estimate
from k6fast.switches import load_options
from k6fast.testing.synthetic import transformer_config

RECORD = Path(__file__).resolve().parents[1] / "measurements" / "sessions" / "2026-12-01_acceptance-full"
W1_PLANNED_TOKENS = (32 * 30 * 54, 218)  # what the pipeline plans W1 for: video tokens with the image tail frame
SM_90 = next(t for t in TARGETS if t.capability == (9, 0))  # the record's GPU, an H200


def _rows() -> list[dict]:
    rows = [json.loads(line) for line in (RECORD / "runs.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if not r["arm"].startswith("diffusers")]


def _estimate(arm: str) -> int:
    """The estimate the planner makes now for the arm as it resolves on an sm_90 GPU (the record's)."""
    cfg = DiTConfig.from_dict(transformer_config("pro-distill", None))
    options = resolve_for(load_options(environ={}, arm=arm), SM_90)
    return activation_estimate(*W1_PLANNED_TOKENS, cfg.model_dim, cfg.model_dim_a, ff_dim=cfg.ff_dim,
                               fp8_gemm=options.gemm == "fp8", quant_attention=options.attn != "exact")  # fmt: skip


def test_the_record_has_every_arm_under_both_budgets() -> None:
    runs = {(r["arm"], r["budget_gb"], r["cache"]) for r in _rows() if r["passed"]}
    for arm in ("reference", "final", "fast"):
        assert {(arm, 32.0, "warm" if arm != "reference" else "cold"), (arm, 31.0, "warm")} <= runs, arm


@pytest.mark.parametrize("row", _rows(), ids=lambda r: r["slug"])
def test_activation_estimate_covers_the_measured_denoise_peak(row: dict) -> None:
    residency = row["residency"]
    above_weights = row["phase_peaks"]["denoise"]["allocated"] - residency["weight_bytes"]
    estimate = _estimate(row["arm"])
    assert above_weights <= estimate, (
        f"{row['run']}: denoising allocated {above_weights / GiB:.2f} GiB above the weights, the planner now allows "
        f"{estimate / GiB:.2f} GiB"
    )
    # The run's plan fitted its budget, and what the allocator reserved stayed inside it.
    plan = residency["weight_bytes"] + residency["activation_bytes"] + residency["reserve_bytes"]
    assert plan <= residency["budget_bytes"] == int(row["budget_gb"] * GiB)
    assert row["peak_vram_reserved_bytes"] <= residency["budget_bytes"]
