"""The acceptance's runs on the lossless compressed checkpoint (`--df11-model`): planned after the BF16 runs, each held
to bit-identical latents with the same run on the BF16 checkpoint, a column of their own."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from k6fast.bench.acceptance import Run, build_plan, hold_to_bf16_twin
from k6fast.bench.acceptance_report import DF11_COLUMNS, render_table
from k6fast.bench.records import read_jsonl
from k6fast.cli import main
from k6fast.df11_checkpoint import compress_checkpoint


def test_the_compressed_runs_follow_the_bf16_ones_and_precede_the_peer() -> None:
    runs = build_plan(["reference", "final"], [32], ballast_arms=["final"], host_ram_gb=60,
                      peer="diffusers-offload", df11_arms=["reference", "final"])  # fmt: skip
    assert [r.slug for r in runs] == [
        "reference-32-cold", "final-32-cold", "reference-32-warm", "final-32-warm", "final-32-warm-host60",
        "reference-32-warm-df11", "final-32-warm-df11", "final-32-warm-host60-df11", "diffusers-offload-32-cold",
    ]  # fmt: skip
    compressed = runs[-2]
    assert compressed.name == "final @ 32 GiB, warm, 60 GB host, df11 checkpoint"
    assert compressed.bf16_twin == Run("final", 32, "warm", 60) and compressed.bf16_twin.slug == "final-32-warm-host60"


def test_a_compressed_run_fails_unless_its_latents_equal_its_bf16_twins(tmp_path) -> None:
    video, audio = torch.randn(1, 3, 4, 4, 8), torch.randn(1, 6, 8)
    save_file({"video": video, "audio": audio}, tmp_path / "bf16.safetensors")
    save_file({"video": video, "audio": audio}, tmp_path / "same.safetensors")
    audio[0, 0, 0] = torch.nextafter(audio[0, 0, 0], torch.tensor(1.0))  # one ulp
    save_file({"video": video, "audio": audio}, tmp_path / "other.safetensors")
    same = {"passed": True}
    hold_to_bf16_twin(same, tmp_path / "same.safetensors", tmp_path / "bf16.safetensors")
    assert same == {"passed": True, "vs_bf16": {"audio": True, "video": True}}
    other = {"passed": True}
    hold_to_bf16_twin(other, tmp_path / "other.safetensors", tmp_path / "bf16.safetensors")
    assert other["passed"] is False and other["vs_bf16"] == {"audio": False, "video": True}
    assert other["error"].startswith("audio latents differ from the same run's on the BF16 checkpoint")
    alone = {"passed": True}
    hold_to_bf16_twin(alone, tmp_path / "same.safetensors", tmp_path / "missing.safetensors")
    assert alone["passed"] is False and "vs_bf16" not in alone  # nothing to hold it to: it shows nothing
    assert alone["error"].startswith("no latents of the same run on the BF16 checkpoint to compare with")
    rows = [{"run": "final @ 32 GiB, warm", "passed": True},
            {"run": "final @ 32 GiB, warm, df11 checkpoint", "checkpoint": "df11", **same},
            {"run": "reference @ 32 GiB, warm, df11 checkpoint", "checkpoint": "df11", **other},
            {"run": "final @ 32 GiB, warm, 60 GB host, df11 checkpoint", "checkpoint": "df11", **alone}]  # fmt: skip
    table = render_table(rows, {"model": "m", "df11_model": "/shm/m-df11"})
    assert f"| {DF11_COLUMNS[0]} |" in table and "- the df11 runs read /shm/m-df11" in table
    lines = [line for line in table.splitlines() if line.startswith("| final") or line.startswith("| reference")]
    assert [line.rsplit("|", 2)[-2].strip() for line in lines] == [
        "—", "bit-identical", "**differ**: audio", "not compared"
    ]  # fmt: skip
    assert DF11_COLUMNS[0] not in render_table(rows[:1], {"model": "m"})  # older records keep their table


def test_acceptance_on_the_compressed_tiny_checkpoint(tiny_bf16, tmp_path, capsys) -> None:
    compressed = tmp_path / "df11"
    compress_checkpoint(tiny_bf16, compressed, min_elements=1, log=lambda line: None)
    out, work = tmp_path / "record", tmp_path / "work"
    argv = ["acceptance", "--model", str(tiny_bf16), "--arms", "reference", "--budgets", "8", "--host-ram-gb", "0",
            "--peer", "none", "--geometry", "64x64x5", "--out", str(out), "--work", str(work)]  # fmt: skip
    assert main([*argv, "--df11-model", str(tiny_bf16), "--only", "reference-8-warm-df11"]) == 2
    assert "expected a checkpoint written by `k6fast quantize --format df11`" in capsys.readouterr().err
    assert main([*argv, "--df11-model", str(compressed), "--df11-arms", "final", "--only", "reference-8-warm"]) == 2
    assert "--df11-arms final: expected arms of --arms (reference)" in capsys.readouterr().err
    # In two parts, as a lease runs it: the BF16 run, then (the BF16 DiT could be gone by now) the compressed one.
    assert main([*argv, "--only", "reference-8-warm"]) == 0
    assert main([*argv, "--df11-model", str(compressed), "--only", "reference-8-warm-df11"]) == 0
    bf16, df11 = read_jsonl(out / "runs.jsonl")
    assert bf16["passed"] and "vs_bf16" not in bf16
    assert df11["passed"] and df11["checkpoint"] == "df11", df11.get("error")
    assert df11["vs_bf16"] == {"audio": True, "video": True}
    assert str(compressed) in " ".join(df11["command"])
    plan = json.loads((out / "acceptance.json").read_text())
    assert plan["df11_model"] == str(compressed) and plan["parts"] == 2
    assert "| bit-identical |" in (out / "README.md").read_text()
