"""`k6fast doctor`: machine facts, the residency plan from the headers alone, advice with reasons, no PyTorch."""

from __future__ import annotations

import json
import stat
import subprocess
import sys

import torch

from k6fast.doctor import GB, Gpu, Report, advise, dit_plan, measure_read, read_gpus, render, run_doctor
from k6fast.stream.plan import GiB


def _fake_smi(tmp_path, line: str) -> str:
    path = tmp_path / "nvidia-smi"
    path.write_text(f"#!/bin/sh\necho '{line}'\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_doctor_imports_no_torch_and_no_model_code() -> None:
    heavy = "('torch', 'diffusers', 'transformers')"
    code = f"import sys, k6fast.doctor; print(sorted(m for m in sys.modules if m.split('.')[0] in {heavy}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_gpus_are_read_from_nvidia_smi(tmp_path) -> None:
    smi = _fake_smi(tmp_path, "NVIDIA GeForce RTX 5090, 12.0, 32607, 580.95")
    (gpu,) = read_gpus(smi)
    assert gpu == Gpu("NVIDIA GeForce RTX 5090", "12.0", 32607 * 2**20, "580.95") and gpu.geforce
    assert read_gpus(str(tmp_path / "absent")) == []


def test_plan_from_the_headers_matches_the_runtime_plan(tiny_distill) -> None:
    import torch

    from k6fast.checkpoint import open_checkpoint
    from k6fast.request import W1, dit_tokens
    from k6fast.stream.runtime import build_dit
    from k6fast.text_phase import TextPhase
    from k6fast.vae_geometry import audio_rate

    plan = dit_plan(tiny_distill, 32 * GiB)
    ckpt = open_checkpoint(tiny_distill)
    tokens = dit_tokens(*W1, audio_rate(ckpt.root))  # a W1 request at the checkpoint's audio rate, as doctor plans
    # What the runtime plans for the same budget and geometry, bf16 compute, the exact arm, beside its text phase.
    text = TextPhase(ckpt.root, torch.device("cpu"), torch.bfloat16)
    text_bytes = text.device_bytes()
    text.close()
    runtime = build_dit(ckpt.transformer_files, ckpt.dit, torch.device("cpu"), torch.bfloat16,
                        budget_bytes=32 * GiB, tokens=tokens, text_bytes=text_bytes)  # fmt: skip
    runtime.close()
    assert {k: plan[k] for k in runtime.plan.as_dict()} == runtime.plan.as_dict()
    assert plan["resident_blocks"] == plan["num_blocks"] == ckpt.dit.num_visual_blocks and plan["slots"] == 0


def test_advice_on_a_consumer_machine_names_the_page_cache_and_the_smallest_step_out() -> None:
    report = Report([Gpu("NVIDIA GeForce RTX 5090", "12.0", 32 * GiB, "580")], 60 * 10**9, 50 * 10**9, 200 * 10**9, "/")
    report.read_gb_s = 2.0
    plan = {"resident_blocks": 17, "num_blocks": 60, "slots": 2, "block_bytes": int(1.04 * GiB)}
    advice = "\n".join(advise(report, int(56.14 * GiB), plan))
    assert "arm: final (GeForce card" in advice
    # The lossless way first: the DF11 copy (~42 GB) fits the page cache of a 60 GB host beside the process.
    assert "do not fit beside 60 GB of RAM" in advice and "a DF11 checkpoint" in advice and "lossless, ~42 GB" in advice
    assert "fp8" not in advice
    smaller = Report([Gpu("NVIDIA GeForce RTX 5090", "12.0", 32 * GiB, "580")], 48 * 10**9, 40 * 10**9, 10**12, "/")
    advice_48 = "\n".join(advise(smaller, int(56.14 * GiB), None))  # DF11 would not fit there; fp8 (lossy) would
    assert "an fp8 checkpoint (`k6fast quantize --format fp8`, lossy, ~35 GB) would fit" in advice_48
    assert "DF11" not in advice_48
    stored = "\n".join(advise(report, int(56.14 * GiB), plan, compressed=True))
    assert "do not fit beside 60 GB" in stored and "more RAM would help" in stored and "quantize" not in stored
    assert "a step that misses the page cache reads 48 GB: 24.0 s of reading per step" in advice
    big = Report([Gpu("NVIDIA H200", "9.0", 140 * GiB, "580")], 128 * 10**9, 120 * 10**9, 200 * 10**9, "/")
    assert "fit in 128 GB of RAM" in "\n".join(advise(big, int(56.14 * GiB), None))
    assert "no NVIDIA GPU" in advise(Report([], 8 * 10**9, 4 * 10**9, 10**9, "/"), 1, None)[0]


def test_read_speed_and_a_whole_report(tiny_distill, tmp_path) -> None:
    data = tmp_path / "blob"
    data.write_bytes(b"\0" * (4 << 20))
    speed, note = measure_read(data)
    assert speed > 0 and "4 MiB of blob" in note
    (tmp_path / "small").write_bytes(b"\0" * (300 << 10))  # a tiny checkpoint's file: not "0 MiB"
    assert "0.293 MiB of small" in measure_read(tmp_path / "small")[1]
    report = run_doctor(str(tiny_distill))
    text = render(report)
    assert report.plan is not None and report.read_gb_s is not None and report.host_ram_bytes > GB
    assert "residency plan" in text and "checkpoint read speed" in text


def test_the_largest_clip_per_arm_is_what_the_runtime_accepts(tiny_distill) -> None:
    """The doctor's per-arm capacity, from the headers alone, equals the longest clip the pipeline itself lets
    through at the same budget (its DiT check; the decode is streamed here so that only the DiT decides)."""
    from k6fast.checkpoint import open_checkpoint
    from k6fast.fit import largest_frames
    from k6fast.pipeline import Pipeline
    from k6fast.request import dit_tokens
    from k6fast.safetensors_index import index_safetensors
    from k6fast.stream.plan import RESERVE_BYTES, activation_estimate, index_footprint
    from k6fast.switches import load_options

    cfg = open_checkpoint(tiny_distill).dit
    fixed, block = index_footprint(index_safetensors(open_checkpoint(tiny_distill).transformer_files),
                                   cfg.num_visual_blocks, 2)  # fmt: skip
    act = activation_estimate(*dit_tokens(864, 480, 41), cfg.model_dim, cfg.model_dim_a, ff_dim=cfg.ff_dim)
    budget_gb = (fixed + act + RESERVE_BYTES + 2 * block) / GiB + 1e-6
    report = run_doctor(str(tiny_distill), budget_gb, measure=False)
    capacity = report.plan["capacity"]
    assert set(capacity) >= {"reference", "final", "fast"}
    assert capacity["reference"]["864x480"] == 41
    env = {"K6_VRAM_BUDGET_GB": repr(budget_gb), "K6_VIDEO_DECODE": "streamed"}
    pipe = Pipeline(tiny_distill, load_options(env), device="cpu", dtype=torch.bfloat16)
    try:
        for size in ("864x480", "1280x720"):
            w, h = map(int, size.split("x"))
            assert largest_frames(pipe.fits, w, h) == capacity["reference"][size]
    finally:
        pipe.close()
    assert "largest clip, arm reference: 864x480 up to 41 frames" in render(report)


def test_doctor_plans_with_the_switches_generate_would_use(tiny_distill) -> None:
    """K6_VRAM_BUDGET_GB (where --budget-gb is not given) and K6_HOST_CACHE_GB from the environment: doctor planned
    with the whole card and the tier at auto whatever the user had set (the newcomer pass found it)."""
    plain = run_doctor(str(tiny_distill), measure=False)
    assert plain.switches == {} and "switches from the environment" not in render(plain)
    environ = {"K6_VRAM_BUDGET_GB": "4", "K6_HOST_CACHE_GB": "0", "HOME": "/elsewhere", "K6_API_KEY": "hunter2"}
    report = run_doctor(str(tiny_distill), measure=False, environ=environ)
    assert report.plan["budget_bytes"] == 4 * GiB
    # A secret is shown as set, never its value (the report is printed, and written as JSON with --json).
    assert report.switches == {"K6_VRAM_BUDGET_GB": "4", "K6_HOST_CACHE_GB": "0", "K6_API_KEY": "<set>"}
    assert "hunter2" not in render(report) and "hunter2" not in json.dumps(report.as_dict())
    assert "switches from the environment: K6_API_KEY=<set>, K6_HOST_CACHE_GB=0, K6_VRAM_BUDGET_GB=4" in render(report)
    given = run_doctor(str(tiny_distill), 5.0, measure=False, environ=environ)
    assert given.plan["budget_bytes"] == 5 * GiB  # --budget-gb over the variable


def test_the_disk_prediction_follows_the_host_tier_setting() -> None:
    from k6fast.doctor import predict_disk_per_step
    from k6fast.memory import HOST_OS_BYTES, PROCESS_HOST_BYTES

    plan = {"variant": "pro-distill", "dit_file_bytes": 60 * 10**9, "describe": "plan", "text_describe": "text",
            "resident_blocks": 17, "num_blocks": 60, "block_bytes": int(1.2 * GB),
            "streamed_stored_bytes": [10**9] * 43}  # fmt: skip
    available = 30 * 10**9 + PROCESS_HOST_BYTES + HOST_OS_BYTES  # 30 GB for the page cache and the tier
    off = predict_disk_per_step(plan, available, 2.0, setting=0.0)
    assert off["host_blocks"] == 0 and off["with_tier_bytes"] == off["without_tier_bytes"] == 43 * 10**9
    some = predict_disk_per_step(plan, available, 2.0, setting=10 * 10**9 / GiB)  # 10 GB of blocks
    assert (some["host_blocks"], some["with_tier_bytes"]) == (10, 33 * 10**9)
    too_much = predict_disk_per_step(plan, available, 2.0, setting=40.0)
    assert (
        too_much["with_tier_bytes"] is None and "K6_HOST_CACHE_GB=40 is more than this host" in too_much["tier_refused"]
    )
    report = Report([], 64 * 10**9, available, 10**12, "/", read_gb_s=2.0, plan=plan, disk_per_step=off)
    assert "43.0 GB (>= 21.5 s a step at 2.00 GB/s) (K6_HOST_CACHE_GB=0: the host tier is off" in render(report)
    report.disk_per_step = too_much
    assert "K6_HOST_CACHE_GB=40 would be refused at start" in render(report)
