"""measurements/model_5090.py: the script runs on the recorded profiles and writes its table; its arithmetic on a small
made-up profile and rates, checked by hand."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model():
    spec = importlib.util.spec_from_file_location("model_5090", ROOT / "measurements" / "model_5090.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["model_5090"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_script_writes_the_table_from_the_records(model, tmp_path):
    out, numbers = tmp_path / "model.md", tmp_path / "model.json"
    assert model.main(["--out", str(out), "--json", str(numbers)]) == 0
    text = out.read_text()
    for arm in model.arms().values():
        assert arm.name in text
    assert "MODELLED, not measured" in text and "error" in text and "## GeForce work ranked" in text
    result = model.run()
    # The calibration meets the reference anchor exactly; the tuned anchor is a prediction within 10 %.
    assert math.isclose(result["request_s"]["fork-reference"], model.ANCHORS["fork-reference"])
    assert abs(result["calibration_error"]) <= 0.10
    # The committed table is what the script writes (regenerate with `python measurements/model_5090.py`).
    assert (ROOT / "measurements" / "model_5090.md").read_text() == text


def test_block_flops_match_the_pro_block(model):
    f = model.block_flops()
    assert math.isclose(f["gemm"] / 50220, 570e6, rel_tol=0.01)  # 570 MFLOP per video token, plus audio/text rows
    assert math.isclose(f["video_self"], 4 * 50220**2 * 4096)
    assert math.isclose(sum(f.values()), 70.32e12, rel_tol=0.005)  # bench_block_arms' flops_per_block


def test_arithmetic_on_a_made_up_profile(model):
    Rate, GiB = model.Rate, model.GiB
    rates = {k: Rate(v, "test") for k, v in {
        "gemm_bf16": 100e12, "gemm_fast": 200e12, "attn_exact": 50e12, "attn_quant": 100e12,
        "dram": model.H200_DRAM / 2, "pcie": 10e9,
    }.items()}  # fmt: skip
    h200 = {"p": model.H200Block(elementwise=0.010, gemm_quant=0.002, attn_prologue=0.001, gap=0.003)}
    flops = {"gemm": 1e12, "video_self": 2e12, "audio_self": 0.0, "cross": 0.5e12}
    machine = model.Machine(blocks=4, vram=10 * GiB, fixed=5 * GiB)
    arm = model.Arm("a", "gemm_bf16", "p", block_bytes=1 * GiB)
    # Per block: GEMM 10 ms + attention (2.5e12 / 50e12) 50 ms + elementwise 10 ms x 2 (half the H200's bandwidth)
    # + gap 3 ms = 83 ms. Resident: (10 - 5 - 2 slots) / 1 = 3 blocks, 1 streamed: its 107.4 ms copy (1 GiB at
    # 10 GB/s) exposed once, plus what it is longer than a block (24.4 ms).
    p = model.predict(arm, rates, h200, machine, flops)
    copy = GiB / 10e9
    assert p.resident_blocks == 3
    assert math.isclose(p.parts_s["gemm"], 0.010) and math.isclose(p.parts_s["attention"], 0.050)
    assert math.isclose(p.parts_s["elementwise"], 0.020) and math.isclose(p.parts_s["gap"], 0.003)
    assert math.isclose(p.dit_s, 10 * (4 * 0.083 + copy + (copy - 0.083)))
    # Quantized attention on the middle blocks (1 exact at each end) from the second of 3 calls, a faster GEMM with
    # its quantization passes (2 ms x 2): the middle blocks' calls after the first save 50 - 20 - 2 ms of attention.
    fast = model.Arm("b", "gemm_fast", "p", quant_sites=("video_self",), quant_rate="attn_quant", exact_blocks=1,
                     exact_calls=1, dit_calls=3, gemm_quant=True, block_bytes=0.5 * GiB)  # fmt: skip
    q = model.predict(fast, rates, h200, machine, flops)
    exact_block = 0.005 + 0.004 + 0.050 + 0.020 + 0.003
    quant_block = exact_block - 0.040 + 0.020 + 0.002  # video_self 2e12 at 100e12 instead of 50e12, + prologue x 2
    assert q.resident_blocks == 4 and q.exposed_copy_s == 0.0
    assert math.isclose(q.dit_s, 4 * exact_block + 2 * (2 * exact_block + 2 * quant_block))


def test_quantized_attention_with_fp32_pv_is_derived_between_the_two_rates(model):
    rates = model.derive_rates(model.RATES)
    slow, fast = rates["attn_quant_f32pv"].value, rates["attn_quant_f16pv"].value
    assert rates["attn_exact"].value < slow < fast
    # t(F) = F/560 + F/(2·1000): 1 / (1/560 + 1/2000) TFLOP/s
    assert math.isclose(slow, 1 / (1 / 560e12 + 1 / 2000e12))
    for rate in model.RATES.values():
        assert rate.source  # every rate names where it comes from
