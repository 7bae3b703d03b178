"""`k6fast acceptance` on the CPU: the plan's order, a real session on the tiny checkpoint (fresh `k6fast generate`
processes, latents compared with the reference's, the table), a failing run recorded as such, the ballast's sizing."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from k6fast.bench.acceptance import build_plan
from k6fast.bench.acceptance_report import latent_error, render_table, request_summary
from k6fast.bench.ballast import CHUNK, bytes_to_hold
from k6fast.bench.records import read_jsonl
from k6fast.cli import main


def test_plan_runs_cold_then_warm_then_other_budgets_then_ballast_then_peer() -> None:
    runs = build_plan(["reference", "final"], [32, 31], ballast_arms=["reference"], host_ram_gb=60,
                      peer="diffusers-offload")  # fmt: skip
    assert [r.slug for r in runs] == [
        "reference-32-cold", "final-32-cold", "reference-32-warm", "final-32-warm",
        "reference-31-warm", "final-31-warm", "reference-32-warm-host60", "diffusers-offload-32-cold",
    ]  # fmt: skip
    assert runs[-1].peer and not runs[0].peer
    assert runs[-2].name == "reference @ 32 GiB, warm, 60 GB host"
    with pytest.raises(ValueError, match="at least one arm"):
        build_plan([], [32])


def test_latent_error_is_zero_against_itself_and_measures_a_perturbation(tmp_path) -> None:
    g = torch.Generator().manual_seed(0)
    ref = {"video": torch.randn(1, 3, 4, 4, 16, generator=g), "audio": torch.randn(1, 7, 8, generator=g)}
    save_file(ref, str(tmp_path / "ref.safetensors"))
    save_file({"video": ref["video"] * 1.01, "audio": -ref["audio"]}, str(tmp_path / "arm.safetensors"))
    same = latent_error(tmp_path / "ref.safetensors", tmp_path / "ref.safetensors")
    assert same["video"] == {"rel_l2": 0.0, "cosine": pytest.approx(1.0)}
    err = latent_error(tmp_path / "arm.safetensors", tmp_path / "ref.safetensors")
    assert err["video"]["rel_l2"] == pytest.approx(0.01, rel=1e-5) and err["video"]["cosine"] == pytest.approx(1.0)
    assert err["audio"]["rel_l2"] == pytest.approx(2.0) and err["audio"]["cosine"] == pytest.approx(-1.0)


def test_ballast_leaves_what_was_asked_in_whole_chunks() -> None:
    total = 128 * 2**30
    held = bytes_to_hold(total, 60)
    assert held % CHUNK == 0 and 0 <= total - held - 60e9 < CHUNK
    assert bytes_to_hold(50 * 2**30, 60) == 0


def test_a_run_without_a_sidecar_reports_nothing_and_the_table_says_fail(tmp_path) -> None:
    assert request_summary(tmp_path) == {}
    row = {"run": "fast @ 32 GiB, cold", "passed": False, "error": "timed out after 900 s: compiling | x"}
    table = render_table([row], {"model": "m", "geometry": "864x480x121", "steps": 10, "argv": ["k6fast"]})
    assert "**FAIL**: timed out after 900 s: compiling / x" in table and "0 of 1 runs passed" in table


@pytest.mark.slow
def test_acceptance_session_on_the_tiny_checkpoint(tiny_distill, tmp_path) -> None:
    out, work = tmp_path / "record", tmp_path / "work"
    argv = ["acceptance", "--model", str(tiny_distill), "--arms", "reference,step-cache", "--budgets", "8",
            "--host-ram-gb", "0", "--peer", "none", "--geometry", "64x64x5", "--out", str(out), "--work", str(work),
            "--timeout", "300", "--only"]  # fmt: skip
    # In two parts, as a lease that must be polled runs it: the second continues the first's record. The first part
    # has no reference yet; its row is compared once the reference has run.
    assert main([*argv, "step-cache-8-cold"]) == 0
    assert "vs_reference" not in read_jsonl(out / "runs.jsonl")[0]
    assert main([*argv, "reference-8-cold,step-cache-8-warm"]) == 0
    assert main([*argv[:-1], "--seed", "7", "--only", "reference-8-cold"]) == 2  # another workload: refused
    rows = read_jsonl(out / "runs.jsonl")
    assert [r["run"] for r in rows] == [
        "step-cache @ 8 GiB, cold", "reference @ 8 GiB, cold", "step-cache @ 8 GiB, warm"
    ]  # fmt: skip
    assert all(r["passed"] and r["returncode"] == 0 for r in rows), [r.get("error") for r in rows]
    cached, ref, warm = rows
    assert ref["vs_reference"]["video"]["rel_l2"] == 0.0
    # The step cache skips one DiT call: its latents differ from the reference's, the same in both of its runs.
    assert 0 < cached["vs_reference"]["video"]["rel_l2"] == warm["vs_reference"]["video"]["rel_l2"]
    assert cached["dit_calls"] == ref["dit_calls"] - 1 and ref["steps"] == cached["steps"] == 10
    assert ref["peak_rss_bytes"] > 0 and ref["request_s"] > 0 and ref["residency"]["num_blocks"] == 2
    assert set(ref["phases_s"]) >= {"text_encode", "denoise", "video_decode", "mux"}
    plan = json.loads((out / "acceptance.json").read_text())
    assert plan["finished"] and plan["steps"] == 10 and len(plan["runs"]) == 3 and plan["parts"] == 2
    table = (out / "README.md").read_text()
    assert "3 of 3 runs passed" in table and table.count("| PASS |") == 3
    assert ref["clip_bytes"] > 0 and (work / "runs" / "reference-8-cold" / "clip.mp4.json").is_file()
