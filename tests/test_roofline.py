"""The acceptance's "DiT step vs ceiling" (`k6fast.bench.roofline`): the ceilings are the figures of the records they
cite, a step's ceiling is its video self-attention and video-token GEMMs at those figures under the arm's own
attention policy and GEMM format, the steady step leaves out what is not steady, and nothing is made up where no
ceiling was measured. CPU only: the arithmetic on recorded figures."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from k6fast.bench.acceptance_report import render_table
from k6fast.bench.roofline import CEILINGS, Steps, row_ceiling, steady_step_s, step_ceiling
from k6fast.dit.config import DiTConfig, video_gemm_shapes
from k6fast.dit.model import flops_per_block
from k6fast.switches import load_options
from k6fast.testing.synthetic import transformer_config

ROOT = Path(__file__).resolve().parents[1]
H200 = CEILINGS[0]
W1_TOKENS = 31 * 30 * 54
PRO = DiTConfig.from_dict(transformer_config("pro-distill", None))
# A 10-step run: the process's first step, a cached step, the rest steady at 6.5 s, the last a little slower.
SECONDS = [17.0, 6.5, 6.6, 6.4, 6.5, 6.5, 6.5, 6.5, 0.01, 6.9]
STEPS = Steps(SECONDS, [s > 0.1 for s in SECONDS], dit_calls=9)


def test_the_ceilings_are_the_recorded_figures() -> None:
    exact = json.loads((ROOT / H200.sources[0]).read_text())
    fa4 = next(r for r in exact["w1"] if r["name"] == "flash_attn_4" and r["shape"] == "1x32x50220x128")
    assert math.isclose(H200.exact_attention_s, fa4["p50_ms"] / 1e3, rel_tol=1e-3)
    sparse = json.loads((ROOT / H200.sources[1]).read_text())
    measured = {r["density"]: (r["ms"] + r["mask_ms"]) / 1e3 for r in sparse["rows"] if r["impl"] == "fa4"}
    assert set(measured) == set(H200.sparse_attention_s)
    for density, seconds in H200.sparse_attention_s.items():
        assert math.isclose(seconds, measured[density], rel_tol=1e-3), density
    gemm = json.loads((ROOT / H200.sources[2]).read_text())
    assert gemm["env"]["gpu"] == H200.gpu
    variant = {"bf16": "cublas_bf16", "fp8": "fp8_gemm"}
    for fmt, shapes in H200.gemm_s.items():
        for (k, n), seconds in shapes.items():
            row = next(r for r in gemm["results"] if r["shape"] == f"M={W1_TOKENS} K={k} N={n}" and r["variant"]
                       == variant[fmt])  # fmt: skip
            assert math.isclose(seconds, row["p50_ms"] / 1e3, rel_tol=1e-3), (fmt, k, n)


def test_the_video_gemms_of_a_pro_block() -> None:
    assert video_gemm_shapes(PRO) == {(4096, 4096): 8, (4096, 16384): 1, (16384, 4096): 1, (4096, 2048): 2}
    # flops_per_block counts the same GEMMs: with no audio and no text tokens, the video GEMMs and self-attention.
    gemm = 2 * W1_TOKENS * (8 * 4096 * 4096 + 2 * 4096 * 2048 + 2 * 4096 * 16384)
    assert flops_per_block(PRO, W1_TOKENS, 0, 0) == gemm + 4 * W1_TOKENS * W1_TOKENS * 4096


def _expected(fmt: str, sparse_blocks: int, density: float) -> float:
    g = H200.gemm_s[fmt]
    block_gemm = 8 * g[(4096, 4096)] + g[(4096, 16384)] + g[(16384, 4096)] + 2 * g[(4096, 4096)] / 2
    attention = sparse_blocks * H200.sparse_attention_s.get(density, 0.0)
    return 60 * block_gemm + attention + (60 - sparse_blocks) * H200.exact_attention_s


def test_final_and_fast_against_their_ceilings() -> None:
    final = step_ceiling(PRO, load_options(environ={}, arm="final"), H200.gpu, W1_TOKENS, STEPS)
    assert final["steady_s"] == 6.5  # steps 2-10 but the cached one: the first is not steady, final has no exact last
    assert math.isclose(final["ceiling_s"], _expected("bf16", 0, 0.0), rel_tol=1e-3)
    assert math.isclose(final["share"], final["ceiling_s"] / 6.5, rel_tol=1e-3)
    fast = step_ceiling(PRO, load_options(environ={}, arm="fast"), H200.gpu, W1_TOKENS, STEPS)
    # fast: FP8 GEMMs; sparse at 0.25 in all but the first and last 2 of the 60 blocks; its last step is exact.
    assert math.isclose(fast["ceiling_s"], _expected("fp8", 56, 0.25), rel_tol=1e-3)
    assert fast["steady_s"] == 6.5  # steps 2-9 but the cached one: fast's last step is exact
    wider = load_options(environ={"K6_EXACT_ATTN_BLOCKS": "6"}, arm="fast")
    assert math.isclose(step_ceiling(PRO, wider, H200.gpu, W1_TOKENS, STEPS)["ceiling_s"], _expected("fp8", 48, 0.25),
                        rel_tol=1e-3)  # fmt: skip


@pytest.mark.parametrize(
    "gpu, tokens, environ",
    [
        ("NVIDIA GeForce RTX 5090", W1_TOKENS, {}),  # nothing measured on that GPU here
        (H200.gpu, 31 * 22 * 40, {}),  # another geometry: the attention figures are for W1
        (H200.gpu, W1_TOKENS, {"K6_SPARSE_ATTN": "0.3"}),  # a density never measured
        (H200.gpu, W1_TOKENS, {"K6_ATTN": "k6", "K6_SPARSE_ATTN": "0"}),  # quantized video attention
        (H200.gpu, W1_TOKENS, {"K6_GEMM": "fp16acc"}),  # a GEMM format without a ceiling
    ],
)
def test_no_ceiling_where_none_was_measured(gpu: str, tokens: int, environ: dict) -> None:
    assert step_ceiling(PRO, load_options(environ=environ, arm="final"), gpu, tokens, STEPS) is None


def test_the_steady_step() -> None:
    assert steady_step_s(STEPS, 1, 0) == 6.5
    assert steady_step_s(STEPS, 1, 1) == 6.5
    four = Steps([9.0, 3.0, 0.02, 3.2, 3.1, 5.5], [True, True, False, True, True, True], 5)
    assert steady_step_s(four, 1, 1) == 3.1  # the first, the exact last and the cached step left out
    assert steady_step_s(four, 2, 1) is None  # two steady steps: too few for a figure
    # Most steps cached (a step cache skipping two in a row): the called ones still give the figure.
    sparse_calls = Steps([17, 6.5, 0.01, 0.01, 6.6, 0.01, 0.01, 6.4, 0.01, 0.01], [i % 3 == 1 for i in range(10)], 4)
    sparse_calls.called[0] = True
    assert steady_step_s(sparse_calls, 1, 0) == 6.5
    assert steady_step_s(Steps([17.0, 15.6, 3.0], [True] * 3, 3), 1, 0) is None  # a short run


def test_cfg_doubles_the_ceiling_and_a_sage_arm_has_one() -> None:
    final = load_options(environ={}, arm="final")
    one = step_ceiling(PRO, final, H200.gpu, W1_TOKENS, STEPS)
    two = step_ceiling(PRO, final, H200.gpu, W1_TOKENS, Steps(SECONDS, STEPS.called, dit_calls=18))
    assert math.isclose(two["ceiling_s"], 2 * one["ceiling_s"], rel_tol=1e-4)  # both rounded to 0.1 ms
    assert step_ceiling(PRO, final, H200.gpu, W1_TOKENS, Steps(SECONDS, STEPS.called, dit_calls=13)) is None
    sage = load_options(environ={"K6_ATTN": "sage"}, arm="fast")  # sparse video attention; sage need not be here
    assert math.isclose(step_ceiling(PRO, sage, H200.gpu, W1_TOKENS, STEPS)["ceiling_s"], _expected("fp8", 56, 0.25),
                        rel_tol=1e-3)  # fmt: skip


def test_a_sidecar_and_the_table_column() -> None:
    sidecar = json.loads((ROOT / "measurements/sessions/2026-12-02_acceptance-envelope3/sidecars/final-32-warm.json")
                         .read_text())  # fmt: skip
    ceiling = row_ceiling(sidecar, PRO)  # a sidecar from before step_called: its PiFlow cache steps say which ran
    assert ceiling["steady_s"] == pytest.approx(6.5524, abs=1e-3) and 0.9 < ceiling["share"] < 1.0
    assert row_ceiling({**sidecar, "gpu_name": "cpu"}, PRO) is None
    for request in ({"image": True}, {"audio": False}):  # other token counts than the measured shapes
        assert row_ceiling({**sidecar, "request": {**sidecar["request"], **request}}, PRO) is None
    telemetry = sidecar["telemetry"]
    assert row_ceiling({**sidecar, "telemetry": {**telemetry, "dit_calls": 8}}, PRO) is None  # the cache steps disagree
    called = [s > 0.1 for s in telemetry["step_s"]]
    assert row_ceiling({**sidecar, "telemetry": {**telemetry, "step_called": called}}, PRO) == ceiling
    plan = {"model": "m", "geometry": "864x480x121", "steps": 10, "argv": ["k6fast"]}
    row = {"run": "final @ 32 GiB, warm", "arm": "final", "passed": True, "request_s": 72.2,
           "phases_s": {"denoise": 61.6}, "step_ceiling": ceiling}  # fmt: skip
    table = render_table([row, {**row, "run": "cpu", "step_ceiling": None}], plan)
    assert "DiT step vs ceiling" in table
    assert f"| {ceiling['share']:.0%} ({ceiling['ceiling_s']:.2f} of 6.55 s) |" in table
    assert "DiT step vs ceiling" not in render_table([{**row, "step_ceiling": None}], plan)
