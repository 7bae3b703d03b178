"""`k6fast quantize` and quantized checkpoints at run time: the written layout, validation at open, the DiT forward
(resident = streamed bit for bit, within the format's error of the unquantized forward), the dequantizing paths, and
the command's errors. CPU, on the tiny checkpoint (its fused-block linears have N, K in {32, 64, 128}: multiples of 16
and 32, so every one of them is quantized); one `gpu` test runs the stored GEMMs."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dit_testing import tiny_dit
from safetensors import safe_open

from k6fast.checkpoint import CheckpointError, open_checkpoint
from k6fast.dit.backend import SwitchedBackend
from k6fast.dit.config import QUANT_CONFIG_KEY, quantized_layer
from k6fast.dit.linear import LinearDispatch, QuantizedWeight
from k6fast.kernels.blockscaled import dequantize_mxfp8, quantize_mxfp8
from k6fast.kernels.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from k6fast.quantize import quantize_checkpoint
from k6fast.quantize_cli import register
from k6fast.switches import Options
from k6fast.testing.bounds import rel_l2

# mxfp8 checkpoints are quantized by torchao (the dev extra has it, so CI runs every format); a GPU machine without it
# runs the others, and test_mxfp8_without_torchao_says_how_to_get_it holds what a user without it is told.
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
FORMATS = ("fp8", "mxfp8", "nvfp4") if HAS_TORCHAO else ("fp8", "nvfp4")
# Relative L2 of the whole tiny DiT's outputs vs the unquantized fp32 forward (measured 1.6% / 7.3% on the video
# head for fp8 / nvfp4): e4m3 keeps 3 mantissa bits, E2M1 one, and the error of every quantized layer reaches the heads.
FORWARD_BOUND = {"fp8": 0.04, "mxfp8": 0.04, "nvfp4": 0.15}
BLOCK_LINEAR = "visual_transformer_blocks.1.video_dec_block.feed_forward.net.2.weight"
# The same weight as a resident fused block holds it (block 1, its name relative to the block).
RESIDENT_LINEAR = (1, "video_dec_block.feed_forward.net.2.weight")


@pytest.fixture(scope="module")
def quantized(tiny_distill, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantized")
    return {fmt: _quantize(tiny_distill, root / fmt, fmt) for fmt in FORMATS}


def test_mxfp8_without_torchao_says_how_to_get_it(tiny_distill, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torchao", None)  # as on a machine without it: `import torchao...` fails
    monkeypatch.setitem(sys.modules, "torchao.prototype.mx_formats", None)
    with pytest.raises(ImportError, match=r"needs torchao \(pip install 'k6fast\[blockscaled\]'\)"):
        quantize_checkpoint(tiny_distill, tmp_path / "mx", "mxfp8", log=lambda line: None)
    assert not (tmp_path / "mx").exists(), "a refused run writes nothing"


def _quantize(src: Path, dst: Path, fmt: str) -> Path:
    lines: list[str] = []
    report = quantize_checkpoint(src, dst, fmt, log=lines.append)
    assert report.layers > 0 and any("fused blocks" in line for line in lines) and lines[-1] == f"wrote {dst}"
    return dst


def _inputs(cfg, seed: int = 0, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(1, 3, 4, 6, cfg.visual_in_channels, generator=g).to(dtype),
        encoder_hidden_states=torch.randn(1, 5, cfg.in_text_dim, generator=g).to(dtype),
        pooled_projections=torch.randn(1, cfg.in_text_dim2, generator=g).to(dtype),
        timestep=torch.tensor([500.0]),
        audio_hidden_states=torch.randn(1, 4, cfg.in_audio_dim, generator=g).to(dtype),
    )


# ---------------------------------------------------------------------------------------------------------------
# What `k6fast quantize` writes
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_checkpoint_layout(tiny_distill, quantized, fmt):
    src, dst = open_checkpoint(tiny_distill), open_checkpoint(quantized[fmt])
    assert dst.quantization == fmt and src.quantization is None
    config = json.loads((quantized[fmt] / "transformer" / "config.json").read_text())
    assert config[QUANT_CONFIG_KEY] == {"format": fmt, "version": 1}
    assert [f.name for f in dst.transformer_files] == [f.name for f in src.transformer_files]

    def tensors(files):
        out = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
        return out

    before, after = tensors(src.transformer_files), tensors(dst.transformer_files)
    quantized_names = [n for n, t in before.items() if quantized_layer(n, tuple(t.shape), fmt)]
    assert len(quantized_names) == 2 * 28  # every linear of both fused blocks except the four modulations
    for name, t in before.items():
        if name not in quantized_names:
            assert torch.equal(after[name], t), f"{name} must be copied as stored"
            continue
        n, k = t.shape
        if fmt == "fp8":
            assert after[name].dtype == torch.float8_e4m3fn and after[name].shape == (n, k)
            assert after[f"{name}_scale"].dtype == torch.float32 and after[f"{name}_scale"].shape == (n,)
            back = after[name].float() * after[f"{name}_scale"][:, None]
        elif fmt == "mxfp8":
            assert after[name].dtype == torch.float8_e4m3fn and after[name].shape == (n, k)
            assert after[f"{name}_scale"].dtype == torch.uint8 and after[f"{name}_scale"].shape == (n, k // 32)
            back = dequantize_mxfp8(after[name], after[f"{name}_scale"])
            assert torch.equal(back, dequantize_mxfp8(*quantize_mxfp8(t)))  # torchao's bits, stored as they are
        else:
            assert after[name].dtype == torch.uint8 and after[name].shape == (n, k // 2)
            assert after[f"{name}_scale"].dtype == torch.float8_e4m3fn and after[f"{name}_scale"].shape == (n, k // 16)
            assert after[f"{name}_scale_2"].shape == ()
            back = dequantize_nvfp4(after[name], after[f"{name}_scale"], after[f"{name}_scale_2"], torch.float32)
        assert rel_l2(back, t) <= (0.04 if fmt == "fp8" else 0.12)
    assert not any("modulation" in n and n.endswith("_scale") for n in after)
    # Every other file is a hard link to the source's (no second copy of the text encoders).
    for file in (tiny_distill / "text_encoder").iterdir():
        assert (quantized[fmt] / "text_encoder" / file.name).stat().st_ino == file.stat().st_ino
    index_file = quantized[fmt] / "transformer" / "diffusion_pytorch_model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    assert set(index["weight_map"]) == set(after)


def test_diffusers_ignores_the_quantization_key(quantized):
    from diffusers import Kandinsky6Transformer3DModel

    config = json.loads((quantized["fp8"] / "transformer" / "config.json").read_text())
    # An unknown key is logged ("will be ignored") and not passed to __init__: the model builds as configured.
    model = Kandinsky6Transformer3DModel.from_config(config)
    assert model.config.model_dim == config["model_dim"]


# ---------------------------------------------------------------------------------------------------------------
# Running a quantized checkpoint
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_forward_streamed_equals_resident_and_tracks_the_unquantized_model(tiny_distill, quantized, fmt):
    base, ckpt = open_checkpoint(tiny_distill), open_checkpoint(quantized[fmt])
    reference = tiny_dit(base)
    resident, streamed = tiny_dit(ckpt), tiny_dit(ckpt, max_resident=0)
    switched = tiny_dit(ckpt, max_resident=1, backend=SwitchedBackend(Options(), torch.device("cpu")))
    try:
        assert isinstance(resident.dit.blocks.resident[RESIDENT_LINEAR[0]][RESIDENT_LINEAR[1]], QuantizedWeight)
        assert streamed.streamer is not None and switched.streamer is not None
        for seed in range(2):  # two forwards: the slots rotate
            want = reference.dit(**_inputs(base.dit, seed))
            a = resident.dit(**_inputs(ckpt.dit, seed))
            b = streamed.dit(**_inputs(ckpt.dit, seed))
            # LinearDispatch on CPU dequantizes and calls F.linear: what ExactBackend's F.linear on the wrapper does.
            c = switched.dit(**_inputs(ckpt.dit, seed))
            for got_a, got_b, got_c, ref in zip(a, b, c, want, strict=True):
                assert torch.equal(got_a, got_b) and torch.equal(got_a, got_c)
                assert rel_l2(got_a, ref) <= FORWARD_BOUND[fmt]
        counts = switched.dit.backend.gemm.counts
        assert counts[f"{fmt}-dequantized"] == 2 * 56 and counts[fmt] == 0
    finally:
        for rt in (reference, resident, streamed, switched):
            rt.close()


def test_bf16_compute_streams_the_stored_bytes(tiny_distill, quantized):
    ckpt = open_checkpoint(quantized["nvfp4"])
    base = tiny_dit(open_checkpoint(tiny_distill), "cpu", torch.bfloat16, max_resident=0)
    resident, streamed = tiny_dit(ckpt, "cpu", torch.bfloat16), tiny_dit(ckpt, "cpu", torch.bfloat16, max_resident=0)
    try:
        w = resident.dit.blocks.resident[RESIDENT_LINEAR[0]][RESIDENT_LINEAR[1]]
        assert w.dtype == torch.bfloat16 and w.qdata.dtype == torch.uint8 and w.scale_2.dtype == torch.float32
        # A device slot holds the stored bytes: 4.5 bits per quantized weight instead of the source's 32.
        assert streamed.streamer.slot_bytes < 0.45 * base.streamer.slot_bytes
        a = resident.dit(**_inputs(ckpt.dit, 0, torch.bfloat16))
        b = streamed.dit(**_inputs(ckpt.dit, 0, torch.bfloat16))
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[0].dtype == torch.bfloat16
    finally:
        for rt in (base, resident, streamed):
            rt.close()


def test_quantized_weight_behaves_as_its_dequantized_tensor():
    w = torch.randn(48, 96)
    qw = QuantizedWeight("nvfp4", *quantize_nvfp4(w), torch.float32)
    dense = dequantize_nvfp4(*quantize_nvfp4(w), dtype=torch.float32)
    x, bias = torch.randn(5, 96), torch.randn(48)
    assert qw.shape == (48, 96) and qw.dtype == torch.float32 and "nvfp4" in repr(qw)
    assert torch.equal(F.linear(x, qw, bias), F.linear(x, dense, bias))
    assert torch.equal(qw.dequantized(torch.bfloat16), dense.bfloat16())
    dispatch = LinearDispatch(Options().replace(gemm="fp8", gemm_min_rows=1))
    assert torch.equal(dispatch(x, qw, bias, name="video_dec_block.feed_forward.net.2"), F.linear(x, dense, bias))
    assert dispatch.counts == {"nvfp4-dequantized": 1}
    with pytest.raises(ValueError, match="expected a 2-D torch.float8_e4m3fn weight and no second scale"):
        QuantizedWeight("fp8", torch.zeros(48, 96, dtype=torch.uint8), torch.ones(48), None, torch.float32)


def test_quantized_weights_compile_without_graph_breaks():
    # compile_blocks traces fused blocks whose weight mapping holds QuantizedWeights: the wrapper flattens to its
    # stored tensors, so one graph serves every block (a second weight of the same format does not recompile).
    from k6fast.kernels.fp8_linear import quantize_weight_fp8

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    w, x = torch.randn(48, 96), torch.randn(5, 96)
    wq, ws = quantize_weight_fp8(w)
    dispatch = LinearDispatch(Options())
    layer = torch.compile(
        lambda x, w: dispatch(x, w, None, name="a.to_query") + F.linear(x, w), backend="aot_eager", fullgraph=True
    )
    for qw in (
        QuantizedWeight("fp8", wq, ws.reshape(-1), None, torch.float32),
        QuantizedWeight("nvfp4", *quantize_nvfp4(w), torch.float32),
        QuantizedWeight("nvfp4", *quantize_nvfp4(2 * w), torch.float32),
    ):
        torch.testing.assert_close(layer(x, qw), 2 * F.linear(x, qw.dequantized()), rtol=1e-6, atol=1e-6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


# ---------------------------------------------------------------------------------------------------------------
# Validation at open
# ---------------------------------------------------------------------------------------------------------------


def _edit_config(ckpt: Path, change) -> None:
    path = ckpt / "transformer" / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


def test_open_rejects_a_format_that_does_not_match_the_tensors(quantized, tmp_path):
    ckpt = tmp_path / "fp8-claims-nvfp4"
    shutil.copytree(quantized["fp8"], ckpt)
    _edit_config(ckpt, lambda c: c[QUANT_CONFIG_KEY].update(format="nvfp4"))
    with pytest.raises(CheckpointError, match=r"tensors missing \(e.g. \['visual_transformer_blocks\..*_scale_2'"):
        open_checkpoint(ckpt)
    _edit_config(ckpt, lambda c: c.pop(QUANT_CONFIG_KEY))
    with pytest.raises(CheckpointError, match="need a 'k6fast_quantization' entry"):
        open_checkpoint(ckpt)
    _edit_config(ckpt, lambda c: c.update({QUANT_CONFIG_KEY: {"format": "int4", "version": 1}}))
    with pytest.raises(CheckpointError, match="k6fast_quantization must be"):
        open_checkpoint(ckpt)


def test_open_rejects_a_quantized_dtype_it_does_not_expect(quantized, tmp_path):
    ckpt = tmp_path / "bad-dtype"
    shutil.copytree(quantized["fp8"], ckpt)
    for shard in open_checkpoint(ckpt).transformer_files:
        raw = shard.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + n])
        names = [k for k in header if k.endswith(".weight_scale")]
        if names:
            break
    header[names[0]]["dtype"] = "I32"  # the same item size, so the byte offsets stay valid
    text = json.dumps(header, separators=(",", ":")).encode()
    shard.write_bytes(raw[:8] + text + b" " * (n - len(text)) + raw[8 + n :])
    with pytest.raises(CheckpointError, match=rf"{names[0]} has dtype I32, expected F32 \(a k6fast fp8 checkpoint\)"):
        open_checkpoint(ckpt)


# ---------------------------------------------------------------------------------------------------------------
# The command and its errors
# ---------------------------------------------------------------------------------------------------------------


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="k6fast")
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_command_refuses_bad_arguments(tiny_distill, quantized, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parse(["quantize", "--format", "int4", str(tiny_distill), str(tmp_path / "out")])
    assert exit_info.value.code == 2 and "invalid choice: 'int4'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="expected --format one of fp8, mxfp8, nvfp4, found 'int4'"):
        quantize_checkpoint(tiny_distill, tmp_path / "out", "int4")
    args = _parse(["quantize", "--format", "fp8", str(tmp_path / "missing"), str(tmp_path / "out")])
    with pytest.raises(CheckpointError, match="missing is not a checkpoint directory"):
        args.func(args)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    args = _parse(["quantize", "--format", "nvfp4", str(tiny_distill), str(busy)])
    with pytest.raises(FileExistsError, match="found a non-empty directory"):
        args.func(args)
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]
    with pytest.raises(CheckpointError, match="already stored as fp8"):
        quantize_checkpoint(quantized["fp8"], tmp_path / "twice", "nvfp4")
    with pytest.raises(CheckpointError, match="lies inside SRC"):
        quantize_checkpoint(tiny_distill, tiny_distill / "quantized", "fp8")
    assert not (tmp_path / "out").exists() and not (tmp_path / "twice").exists()
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            _parse(["quantize", "--format", "fp8", str(tiny_distill), str(tmp_path / "out"), "--device", "cuda"])
        assert "--device: cuda: CUDA is not available here; use --device cpu" in capsys.readouterr().err


def test_an_interrupted_run_leaves_nothing(tiny_distill, tmp_path, monkeypatch):
    import k6fast.quantize as quantize_module

    def fail(w, fmt):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(quantize_module, "quantize_weight", fail)
    with pytest.raises(RuntimeError, match="interrupted"):
        quantize_checkpoint(tiny_distill, tmp_path / "out", "fp8", log=lambda line: None)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------------------------
# GPU: the stored GEMMs run
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", FORMATS)
def test_stored_gemm_runs_on_gpu(quantized, fmt):
    ckpt = open_checkpoint(quantized[fmt])
    fast = SwitchedBackend(Options().replace(gemm_min_rows=1), torch.device("cuda"))
    runs = [tiny_dit(ckpt, "cuda", torch.bfloat16, backend=b) for b in (None, fast)]
    try:
        inputs = {k: v.cuda() for k, v in _inputs(ckpt.dit, 0, torch.bfloat16).items()}
        dequantized, stored = (rt.dit(**inputs) for rt in runs)
        blockscaled = torch.cuda.get_device_capability()[0] in (10, 12)
        if fmt == "fp8" or (fmt == "mxfp8" and blockscaled):
            assert fast.gemm.counts[fmt] == 56 and f"{fmt}-dequantized" not in fast.gemm.counts
            for a, b in zip(stored, dequantized, strict=True):
                assert rel_l2(a, b) <= 0.06  # the activations are quantized too (≈2.5% per layer)
        else:
            # nvfp4 layers (without K6_GEMM=nvfp4), and mxfp8 layers without block-scaled MMA, are dequantized on the
            # GPU and multiplied by cuBLAS: the same computation as the reference backend's, so the same bits.
            assert fast.gemm.counts[f"{fmt}-dequantized"] == 56 and fmt not in fast.gemm.counts
            for a, b in zip(stored, dequantized, strict=True):
                assert torch.equal(a, b)
    finally:
        for rt in runs:
            rt.close()
