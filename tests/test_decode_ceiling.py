"""The acceptance's "video decode vs ceiling" (`k6fast.bench.decode_ceiling`): the rate is the recorded cuBLAS BF16
figure, the FLOPs counted on the meta device are those of a real decode, and the row's share is the ceiling over the
run's decode seconds, none where no rate was measured. CPU only."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from k6fast.bench import decode_ceiling
from k6fast.bench.acceptance_report import render_table
from k6fast.bench.decode_ceiling import UNBOUNDED, decode_flops, dense_bf16_rate, row_decode_ceiling
from k6fast.bench.roofline import CEILINGS
from k6fast.vae import load_video_vae
from k6fast.vae_geometry import latent_frames, latent_size
from k6fast.video_decode import decode_video_fast, plan_video_decode

ROOT = Path(__file__).resolve().parents[1]
H200 = CEILINGS[0]
SIDECAR = ROOT / "measurements/sessions/2026-12-02_acceptance-envelope4/sidecars/final-32-warm.json"


def test_the_rate_is_the_recorded_fastest_bf16_gemm() -> None:
    results = json.loads((ROOT / "measurements/sessions/2026-11-29_kernels/gemm.json").read_text())["results"]
    recorded = max(r["TFLOPs"] for r in results if r["variant"] == "cublas_bf16")
    assert dense_bf16_rate(H200) / 1e12 == pytest.approx(recorded, rel=2e-3)  # from the p50 times the table holds


def test_the_meta_count_is_a_real_decodes(tiny_distill: Path) -> None:
    vae = load_video_vae(tiny_distill, torch.device("cpu"), torch.bfloat16)
    width, height, frames = 48, 32, 9
    shape = (1, latent_frames(frames), *latent_size(height, width), vae.config.latent_channels)
    latents = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    plan = plan_video_decode(vae, shape[1:4], budget_bytes=UNBOUNDED, dtype=torch.bfloat16)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        frames_out = decode_video_fast(vae, latents, plan=plan, layout="ncdhw", triton_norm=False)
    assert frames_out.shape[1:4] == (frames, height, width)
    real = {str(op).split(".")[1]: float(n) for op, n in counter.get_flop_counts()["Global"].items()}
    counted = decode_flops(str(tiny_distill / "vae"), width, height, frames)
    # The CPU's fused attention kernel has no FLOP formula; on the meta device (and a GPU) the attention is counted:
    # the mid-block's one head attends from each latent frame to it and the frames before it (causal by frame).
    t, h, w = shape[1:4]
    dim = vae.config.block_out_channels[-1]
    assert counted["convolution"] > 0 and counted["bmm"] == 4 * (h * w) ** 2 * dim * t * (t + 1) // 2
    assert {op: n for op, n in counted.items() if op != "bmm"} == {op: n for op, n in real.items() if op != "bmm"}


def test_a_sidecar_and_the_table_column(monkeypatch) -> None:
    flops = {"convolution": 848.7e12, "bmm": 42.7e12}
    monkeypatch.setattr(decode_ceiling, "decode_flops", lambda *args: flops)
    sidecar = json.loads(SIDECAR.read_text())
    ceiling = row_decode_ceiling(sidecar, Path("m"))
    decode_s = sidecar["telemetry"]["phases_s"]["video_decode"]
    assert ceiling["tflop"] == pytest.approx(891.4)
    assert math.isclose(ceiling["ceiling_s"], 891.4e12 / dense_bf16_rate(H200), abs_tol=1e-3)
    assert math.isclose(ceiling["share"], ceiling["ceiling_s"] / decode_s, rel_tol=1e-3)
    assert row_decode_ceiling({**sidecar, "gpu_name": "cpu"}, Path("m")) is None  # no rate measured for it
    no_decode = {**sidecar, "telemetry": {**sidecar["telemetry"], "phases_s": {"denoise": 60.9}}}
    assert row_decode_ceiling(no_decode, Path("m")) is None
    assert row_decode_ceiling({**sidecar, "request": {"width": 864}}, Path("m")) is None
    assert row_decode_ceiling({**sidecar, "telemetry": "odd"}, Path("m")) is None
    plan = {"model": "m", "geometry": "864x480x121", "steps": 10, "argv": ["k6fast"]}
    row = {"run": "final @ 32 GiB, warm", "arm": "final", "passed": True, "request_s": 71.5,
           "phases_s": {"video_decode": decode_s}, "decode_ceiling": ceiling}  # fmt: skip
    table = render_table([row, {**row, "run": "cpu", "decode_ceiling": None}], plan)
    assert f"| {ceiling['share']:.0%} ({ceiling['ceiling_s']:.2f} of {ceiling['decode_s']:.2f} s, 891 TFLOP) |" in table
    assert "video decode vs ceiling" not in render_table([{**row, "decode_ceiling": None}], plan)


def test_the_command_prints_the_count_at_a_geometry(tiny_distill: Path, capsys) -> None:
    assert decode_ceiling.main(["--model", str(tiny_distill), "--geometry", "48x32x9", "--budget-gib", "0"]) == 0
    total = sum(decode_flops(str(tiny_distill / "vae"), 48, 32, 9).values())
    assert f"48x32x9 plan for unbounded GiB: {total / 1e12:.1f} TFLOP (convolution" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        decode_ceiling.main(["--model", str(tiny_distill), "--geometry", "50x32x9"])  # not a multiple of 16
