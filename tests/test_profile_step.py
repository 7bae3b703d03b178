"""measurements/profile_step.py on the CPU: kernel names fall in the right category (real CUDA kernel names as
torch.profiler reports them on Hopper), the interval arithmetic behind busy time and exposed copies is right, and
the --smoke run profiles a real request of the tiny checkpoint into a consistent record. The smoke test uses the
`step-cache` arm (a cached step, no torch.compile): compiling the block for the CPU costs ~30 s with a cold Inductor
cache, and `final` differs from it on the CPU only by that compile."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "measurements" / "profile_step.py"


@pytest.fixture(scope="module")
def prof():
    # Scripts run as `python measurements/<script>.py`, so they import bench_common from their own folder; the
    # module is registered while it executes because dataclasses look their module up.
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(SCRIPT.parent))
        spec = importlib.util.spec_from_file_location("profile_step", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        mp.setitem(sys.modules, spec.name, module)
        spec.loader.exec_module(module)
    return module


# Kernel names as torch.profiler reports them, by the category each must land in.
KERNEL_NAMES = {
    "gemm": [  # cuBLAS and CUTLASS on Hopper, Inductor's GEMM template, fp8 activation quantization (feeds the GEMM)
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"
        "__5x_cublas",
        "nvjet_tst_192x192_64x4_1x2_h_bz_coopB_NNT",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true>(...)",
        "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cute::tuple<int, int>, sm90...>>(...)",
        "void cutlass::device_kernel<...sm90...>",
        "ampere_bf16_s16816gemm_bf16_256x128_ldg8_f2f_stages_64x3_tn",
        "triton_tem_fused_addmm_0",
        "_quantize_rows_fp8_kernel",
    ],
    "attention": [  # cuDNN, FlashAttention 2/3, memory-efficient, k6fast's and SageAttention's quantized kernels
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x128_4x1x1_kernel0_0",
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, bf16>>",
        "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<...>>>(...)",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>::Params)",
        "_quant_attn_fwd_kernel",
        "_quant_attention_kernel",
        "_kv_quantize_kernel",
        "quant_per_block_int8_kernel",
    ],
    "fused_elementwise": [  # k6fast's Triton kernels and Inductor's
        "_layernorm_modulate_kernel",
        "_gated_residual_kernel",
        "_gated_residual_modulate_kernel",
        "triton_poi_fused_add_mul_0",
        "triton_red_fused__to_copy_add_native_layer_norm_1",
        # An Inductor layout copy feeding SDPA is named after it, but it is elementwise work.
        "triton_poi_fused__scaled_dot_product_cudnn_attention_3",
    ],
    "elementwise": [
        "void at::native::vectorized_elementwise_kernel<...>",
        "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float>>(...)",
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>(...)",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<...>>>(...)",
        "Memcpy DtoD (Device -> Device)",
        "Memset (Device)",
    ],
    "memcpy_h2d_d2h": ["Memcpy HtoD (Pinned -> Device)", "Memcpy DtoH (Device -> Pageable)"],
    "other": ["void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<...>(...)"],
}
KERNEL_CASES = [(name, category) for category, names in KERNEL_NAMES.items() for name in names]


@pytest.mark.parametrize(("name", "category"), KERNEL_CASES, ids=[n[:40] for n, _ in KERNEL_CASES])
def test_cuda_kernel_names(prof, name, category) -> None:
    assert prof.categorise(name) == category


@pytest.mark.parametrize(
    ("name", "category"),
    [
        ("aten::addmm", "gemm"),
        ("aten::mm", "gemm"),
        ("aten::matmul", "gemm"),
        ("aten::_scaled_mm", "gemm"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        ("aten::scaled_dot_product_attention", "attention"),
        ("aten::native_layer_norm", "elementwise"),
        ("aten::mul", "elementwise"),
        ("aten::copy_", "elementwise"),
        ("aten::view", "other"),
        ("aten::empty_strided", "other"),
        ("TorchDynamo Cache Lookup", "other"),
        ("## Call CompiledFxGraph fattnxmmagemmflash ##", "other"),
    ],
)
def test_cpu_op_names(prof, name, category) -> None:
    assert prof.categorise(name) == category


def test_every_k6fast_triton_kernel_has_its_category(prof) -> None:
    # A kernel added to k6fast/kernels/ without an entry would silently fall into "other" on the H200.
    jitted = set()
    for source in (ROOT / "k6fast" / "kernels").glob("*.py"):
        jitted |= set(re.findall(r"@triton\.jit\s*\n\s*def (\w+_kernel)\(", source.read_text()))
    assert jitted and jitted == set(prof.K6_KERNELS)
    assert set(prof.K6_KERNELS.values()) <= set(prof.CATEGORIES)


def test_breakdown_on_two_streams(prof) -> None:
    A = prof.Activity
    acts = [
        A("sm90_xmma_gemm_bf16_cublas", 0, 40, 40),
        A("sm90_xmma_gemm_bf16_cublas", 100, 130, 30),
        A("_layernorm_modulate_kernel", 30, 50, 20),  # overlaps the first GEMM (another stream): busy counts it once
        A("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 60, 90, 30),
        A("Memcpy HtoD (Pinned -> Device)", 80, 120, 40),  # 90..100 has no compute under it
    ]
    wall_s = 200e-6
    out = prof.breakdown(acts, wall_s)
    cats = out["categories"]
    assert set(cats) == set(prof.CATEGORIES)
    assert cats["gemm"] == pytest.approx({"s": 70e-6, "count": 2, "share_of_compute": 70 / 120})
    assert cats["fused_elementwise"]["s"] == pytest.approx(20e-6)
    assert cats["attention"]["s"] == pytest.approx(30e-6)
    assert cats["memcpy_h2d_d2h"]["s"] == pytest.approx(40e-6) and cats["memcpy_h2d_d2h"]["share_of_compute"] is None
    assert out["kernel_s"] == pytest.approx(160e-6) and out["compute_s"] == pytest.approx(120e-6)
    assert out["busy_s"] == pytest.approx(110e-6)  # [0, 50] + [60, 90] + [100, 130]
    assert out["gap_s"] == pytest.approx(90e-6)
    assert out["copy_exposed_s"] == pytest.approx(10e-6)
    top_two = [k["name"] for k in out["top_kernels"]][:2]
    assert top_two == ["sm90_xmma_gemm_bf16_cublas", "Memcpy HtoD (Pinned -> Device)"]
    assert out["top_kernels"][0]["count"] == 2


def test_interval_helpers(prof) -> None:
    merged = prof.merge([(5, 7), (0, 2), (1, 3), (3, 4)])
    assert merged == [(0, 4), (5, 7)] and prof.length(merged) == 6
    assert prof.overlap(merged, [(3.5, 6)]) == pytest.approx(1.5)
    assert prof.overlap([], merged) == 0


def test_default_step_follows_the_arm(prof) -> None:
    from k6fast.switches import load_options

    final = load_options(environ={}, arm="final")
    assert prof.default_step(final, 10, final.piflow_cache_steps) == 1
    fast = load_options(environ={"K6_EXACT_ATTN_STEPS": "2"}, arm="fast")  # cache steps 5, 8
    assert prof.default_step(fast, 10, fast.piflow_cache_steps) == 2
    assert prof.default_step(fast, 10, (2, 3)) == 4  # the cached steps given, not the arm's
    assert prof.default_step(load_options(environ={}, arm="reference"), 1, ()) == 0


@pytest.mark.slow
def test_smoke_profiles_one_step_of_a_real_request(prof, tiny_distill, tmp_path, capsys) -> None:
    out, trace = tmp_path / "out" / "prof.json", tmp_path / "trace.json"
    argv = ["--smoke", "--model", str(tiny_distill), "--arm", "step-cache", "--out", str(out), "--trace", str(trace)]
    prof.main(argv)
    printed = capsys.readouterr().out
    record = json.loads(out.read_text())

    assert record["arm"] == "step-cache" and record["geometry"] == "64x64x9" and record["steps"] == 10
    assert record["provenance"]["switches"]["K6_PIFLOW_CACHE_STEPS"] == "8"
    assert record["environment"]["torch"] == torch.__version__ and record["environment"]["device"] == "cpu"

    req = record["request"]
    assert {"text_encode", "denoise", "video_decode", "audio_decode", "mux"} <= set(req["phases_s"])
    assert all(s > 0 for s in req["phases_s"].values()) and req["load_s"] > 0
    assert sum(req["phases_s"].values()) + req["unaccounted_s"] == pytest.approx(req["wall_s"])
    assert len(req["step_s"]) == 10 and req["cached_steps"] == 1 and req["dit_calls"] == 9
    assert sum(req["step_s"]) <= req["phases_s"]["denoise"]

    step = record["step"]
    assert step["measure"] == "cpu_op_self_time" and step["index"] == 1
    assert step["wall_s"] > 0 and step["unprofiled_wall_s"] == req["step_s"][1]
    cats = step["categories"]
    assert list(cats) == ["attention", "gemm", "fused_elementwise", "elementwise", "memcpy_h2d_d2h", "other"]
    # The tiny DiT's linear layers and SDPA ran inside the step and were recognised as such.
    assert cats["gemm"]["s"] > 0 and cats["attention"]["s"] > 0 and cats["elementwise"]["s"] > 0
    assert cats["memcpy_h2d_d2h"]["s"] == 0  # no host<->device copies on the CPU
    assert sum(c["s"] for c in cats.values()) == pytest.approx(step["kernel_s"])
    assert sum(c["s"] for n, c in cats.items() if n != "memcpy_h2d_d2h") == pytest.approx(step["compute_s"])
    assert sum(c["share_of_compute"] for n, c in cats.items() if n != "memcpy_h2d_d2h") == pytest.approx(1.0)
    assert sum(k["s"] for k in step["kernels"]) == pytest.approx(step["kernel_s"])
    assert sum(k["count"] for k in step["kernels"]) == sum(c["count"] for c in cats.values())
    # Self times of nested ops on one thread tile the time the ops ran, which lies inside the step.
    assert step["compute_s"] == pytest.approx(step["busy_s"], rel=0.02)
    assert 0 < step["busy_s"] <= step["wall_s"] and step["gap_s"] == pytest.approx(step["wall_s"] - step["busy_s"])

    top = step["top_kernels"]
    assert len(top) == 15 and top == step["kernels"][:15]
    assert [k["s"] for k in top] == sorted((k["s"] for k in top), reverse=True)
    assert all(k["category"] == prof.categorise(k["name"]) and k["count"] >= 1 for k in top)

    assert json.loads(trace.read_text())["traceEvents"]
    assert "step 1: wall" in printed and "top 15 by time" in printed and "aten::addmm" in printed


def test_without_cuda_it_asks_for_smoke(prof, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same on a GPU machine
    with pytest.raises(SystemExit, match="--smoke"):
        prof.main(["--model", "unused", "--arm", "final"])


def test_device_events_come_from_the_exported_chrome_trace(prof) -> None:
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "kernel", "name": "triton_poi_fused_add_0", "ts": 10.0, "dur": 5.0},
            {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 12.0, "dur": 8.0},
            {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 30.0, "dur": 1.0},
            {"ph": "X", "cat": "gpu_user_annotation", "name": "k6fast::dit", "ts": 9.0, "dur": 30.0},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 8.0, "dur": 2.5},
            {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 7.0, "dur": 4.0},
            {"ph": "i", "cat": "kernel", "name": "instant, not an interval", "ts": 1.0},
        ]
    }
    events = prof.trace_events(trace)
    kernels = prof.device_activities(events)
    assert [(k.name, k.start_us, k.end_us, k.time_us) for k in kernels] == [
        ("triton_poi_fused_add_0", 10.0, 15.0, 5.0),
        ("Memcpy HtoD (Pinned -> Device)", 12.0, 20.0, 8.0),
        ("Memset (Device)", 30.0, 31.0, 1.0),
    ]
    assert prof.launch_calls(events) == {"count": 1, "s": 2.5e-6}
    assert prof.device_event_types(events)["gpu_user_annotation"] == 1
