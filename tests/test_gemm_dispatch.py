"""What K6_GEMM / K6_ATTN resolve to per architecture (k6fast/dit/arch.py), `k6fast switches`' resolution table, the
quantized weights of the block-scaled formats, and LinearDispatch's new GEMM kinds (CPU paths; one `gpu` test)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from k6fast.cli import main
from k6fast.dit import arch
from k6fast.dit.linear import LinearDispatch, QuantizedWeight, bind_quantized
from k6fast.switches import Options

SM90, SM100, SM120, SM89, CPU = arch.TARGETS
SM86 = arch.Target("sm_86 (RTX 30, GeForce)", (8, 6), geforce=True)


@pytest.mark.parametrize(
    ("gemm", "attn", "target", "expected"),
    [
        ("auto", "auto", SM120, ("fp16acc", "k6")),
        ("auto", "auto", SM89, ("fp16acc", "k6")),
        ("auto", "auto", SM86, ("fp16acc", "exact")),
        ("auto", "auto", SM90, ("bf16", "exact")),
        ("auto", "auto", SM100, ("bf16", "exact")),
        ("auto", "auto", CPU, ("bf16", "exact")),
        ("auto-lossy", "k6", SM120, ("mxfp8", "k6")),
        ("auto-lossy", "k6", SM100, ("mxfp8", "k6")),
        ("auto-lossy", "k6", SM90, ("fp8", "k6")),
        ("auto-lossy", "k6", SM89, ("fp8-fp16acc", "k6")),
        ("auto-lossy", "k6", SM86, ("bf16", "k6")),
        ("auto-lossy", "exact", CPU, ("bf16", "exact")),
        ("fp8", "exact", SM120, ("fp8-fp16acc", "exact")),
        ("fp8", "exact", SM90, ("fp8", "exact")),
        ("mxfp8", "exact", SM90, ("bf16", "exact")),
        ("nvfp4", "exact", SM89, ("bf16", "exact")),
        ("nvfp4", "exact", SM120, ("nvfp4", "exact")),
        ("fp8-fp16acc", "exact", SM90, ("fp8-fp16acc", "exact")),  # explicit: runs anywhere with FP8 MMA
        ("fp8-fp16acc", "exact", SM86, ("bf16", "exact")),
    ],
)
def test_choices_per_target(gemm, attn, target, expected, monkeypatch):
    monkeypatch.setattr(arch, "torchao_available", lambda: True)
    resolved = arch.resolve_for(Options().replace(gemm=gemm, attn=attn), target)
    assert (resolved.gemm, resolved.attn) == expected


def test_auto_lossy_without_torchao_takes_fp8(monkeypatch):
    monkeypatch.setattr(arch, "torchao_available", lambda: False)
    assert arch.resolve_for(Options().replace(gemm="auto-lossy"), SM120).gemm == "fp8-fp16acc"


def test_a_choice_the_device_cannot_run_is_said_once(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    arch.say_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="k6fast.dit.arch"):
        for _ in range(3):
            assert arch.resolve_auto(Options().replace(gemm="mxfp8"), torch.device("cuda", 0)).gemm == "bf16"
    assert caplog.text.count("K6_GEMM=mxfp8 on sm_90 (NVIDIA H200) runs bf16: no block-scaled tensor cores") == 1
    with pytest.raises(ValueError, match="K6_GEMM=auto-lossy must be resolved"):
        LinearDispatch(Options().replace(gemm="auto-lossy"))


def test_switches_prints_the_resolution_per_target(capsys, monkeypatch):
    monkeypatch.setattr(arch, "torchao_available", lambda: True)
    assert main(["switches", "--arm", "final"]) == 0
    out = capsys.readouterr().out
    assert "K6_GEMM=auto and K6_ATTN=auto resolve to" in out
    lines = {line.split("K6_GEMM=")[0].strip(): line for line in out.splitlines() if "  K6_GEMM=" in line}
    assert "K6_GEMM=fp16acc      K6_ATTN=k6" in lines["sm_120 (RTX 50, GeForce)"]
    assert "K6_GEMM=bf16         K6_ATTN=exact" in lines["sm_90 (H100/H200)"]
    assert set(lines) >= {t.name for t in arch.TARGETS}
    assert main(["switches", "--arm", "fast"]) == 0
    assert "K6_GEMM=mxfp8" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------------------
# Quantized weights of the block-scaled formats
# ---------------------------------------------------------------------------------------------------------------


def test_mxfp8_weight_binds_and_behaves_as_its_dequantized_tensor():
    pytest.importorskip("torchao")
    from k6fast.kernels.blockscaled import dequantize_mxfp8, quantize_mxfp8

    w = torch.randn(48, 96)
    wq, scale = quantize_mxfp8(w)
    tensors = bind_quantized({"l.weight": wq, "l.weight_scale": scale}, torch.float32)
    qw = tensors["l.weight"]
    assert isinstance(qw, QuantizedWeight) and qw.fmt == "mxfp8" and qw.shape == (48, 96)
    dense = dequantize_mxfp8(wq, scale)
    x = torch.randn(5, 96)
    assert torch.equal(F.linear(x, qw), F.linear(x, dense))
    dispatch = LinearDispatch(Options().replace(gemm="mxfp8", gemm_min_rows=1))
    assert torch.equal(dispatch(x, qw, None, name="l"), F.linear(x, dense))  # CPU: dequantized + F.linear
    assert dispatch.counts == {"mxfp8-dequantized": 1}
    with pytest.raises(ValueError, match=r"found \(torch.float8_e4m3fn, torch.float16\)"):
        bind_quantized({"l.weight": wq, "l.weight_scale": scale.half()}, torch.float32)


def test_new_kinds_take_bf16_on_the_cpu():
    x, w = torch.randn(4096, 64), torch.randn(32, 64)
    for kind in ("mxfp8", "nvfp4", "fp8-fp16acc"):
        dispatch = LinearDispatch(Options().replace(gemm=kind))
        assert torch.equal(dispatch(x, w, None, name="video_dec_block.feed_forward.net.2"), F.linear(x, w))
        assert dispatch.counts == {"bf16": 1}
        assert dispatch.use_fast(4096, (32, 64), "video_dec_block.feed_forward.net.2")
        assert dispatch.use_fast(4096, (32, 48), "x") is (kind == "fp8-fp16acc")  # K not a multiple of 32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_fp16acc_kind_runs_the_fp16_chunk_gemm_gpu():
    # The kernel wherever Triton has FP8 MMA (an H200 too), so its numerics are checked before a GeForce card; older
    # GPUs run its reference emulation, held to the same bound.
    from k6fast.kernels.fp8_fp16acc import fp8_fp16acc_linear_ref

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 4096, device="cuda", generator=g).bfloat16()
    w = (torch.randn(1024, 4096, device="cuda", generator=g) * 0.02).bfloat16()
    dispatch = LinearDispatch(Options().replace(gemm="fp8-fp16acc", fp8_outlier_channels="0"))
    y = dispatch(x, w, None, name="video_dec_block.feed_forward.net.2").float()
    assert dispatch.counts == {"fp8-fp16acc": 1}
    exact = x.float() @ w.float().t()
    assert ((y - exact).norm() / exact.norm()).item() <= 0.045
    del fp8_fp16acc_linear_ref
