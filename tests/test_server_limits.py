"""`k6fast serve` at its defaults: limits that fit the device (the GPU's API limits, the CPU's small ones, each
given option kept), and a request the VRAM budget cannot fit refused with a 400 naming what fits, before it is
queued."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402
from server_testing import budget_fitting, check_error_body, tiny_server_config, until  # noqa: E402

from k6fast.pipeline import Pipeline  # noqa: E402
from k6fast.server.app import create_app  # noqa: E402
from k6fast.server.cli import config_from_args, register  # noqa: E402
from k6fast.server.config import CPU_LIMITS, GPU_LIMITS, device_limits  # noqa: E402
from k6fast.switches import Options, load_options  # noqa: E402


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_limits_fit_the_device_and_given_options_win(tiny_distill: Path, tmp_path: Path) -> None:
    assert device_limits(cpu=False) == GPU_LIMITS and device_limits(cpu=True) == CPU_LIMITS
    assert device_limits(cpu=True, max_frames=97).max_frames == 97
    # On the CPU a 1280x720, 241-frame request ran for minutes: the CPU's defaults are small.
    cpu = config_from_args(_args("--model", str(tiny_distill), "--device", "cpu"), tmp_path)
    assert (cpu.max_size, cpu.max_frames, cpu.max_steps) == (CPU_LIMITS.max_size, 33, 20)
    assert cpu.max_size[0] * cpu.max_size[1] * cpu.max_frames < 1280 * 720 * 241 / 100
    given = config_from_args(_args("--model", str(tiny_distill), "--device", "cpu", "--max-frames", "65"), tmp_path)
    assert given.max_frames == 65 and given.max_size == CPU_LIMITS.max_size


def test_a_request_the_budget_cannot_fit_gets_a_400_naming_what_fits(tiny_distill: Path, tmp_path: Path) -> None:
    budget_gb = budget_fitting(tiny_distill, 512, 512, 65)
    pipeline = Pipeline(tiny_distill, load_options({"K6_VRAM_BUDGET_GB": repr(budget_gb)}), device="cpu")
    config = tiny_server_config(tmp_path / "data", max_size=(768, 768), max_frames=97)
    app = create_app(config, Options(), load=lambda: pipeline)
    try:
        with TestClient(app) as client:
            until(lambda: client.get("/health").status_code == 200, "the server to become ready")
            fields = {"prompt": "a fox", "size": "768x768", "num_frames": "97", "num_inference_steps": "2"}
            response = client.post("/v1/videos", files=[(k, (None, v)) for k, v in fields.items()])
            assert response.status_code == 400, response.text
            error = check_error_body(response.json())
            assert error["param"] == "size" and error["code"] == "invalid_value"
            assert error["message"].startswith("768x768 with 97 frames does not fit the VRAM budget")
            assert "at most" in error["message"]
            assert client.app.state.k6.store.queue_depth() == 0  # refused before it was queued
            ok = {"prompt": "a fox", "size": "64x64", "num_frames": "17", "num_inference_steps": "1"}
            accepted = client.post("/v1/videos", files=[(k, (None, v)) for k, v in ok.items()])
            assert accepted.status_code == 200, accepted.text
    finally:
        pipeline.close()
