"""The Gluon attention core for sm_90 (k6fast/kernels/quant_attention_wgmma.py).

CPU: the kernel compiles for sm_90a with the installed Triton (Gluon is experimental; this catches API drift) into
three partitions with register reallocation (`setmaxnreg`), INT8 and FP8 wgmma, and ptxas neither serializes the
wgmmas (warning C7514) nor spills, at both key tiles and head dims, and the softmax's row reductions in its SASS are
trees (no long dependent chains). GPU (`-m gpu`, sm_90): against the same-scheme FP32 reference and exact FP32
attention at ragged shapes, both key tiles, both head dims.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kernel_testing import (
    assert_ptxas_sm90a_clean,
    compile_gluon_sm90,
    longest_dependent_chain,
    needs_cuda,
    needs_gluon,
    needs_sm90_gluon,
    sass_loop_body,
)
from test_quant_attention import FP8_PV_VS_FP32, SEEDS, assert_kernel_vs_ref, assert_vs_fp32, dit_like_qkv

from k6fast.kernels import aot
from k6fast.kernels import quant_attention as qa
from k6fast.kernels import quant_attention_wgmma as wa


def _compile_sm90(block_n: int, head_dim: int, stages: int):
    gl = wa.gl
    layout = gl.NVMMASharedLayout.get_default_for
    sig = {
        "q_desc": f"tensordesc<i8[64, {head_dim}],{layout([64, head_dim], gl.int8)!r}>",
        "k_desc": f"tensordesc<i8[{block_n}, {head_dim}],{layout([block_n, head_dim], gl.int8)!r}>",
        "v_desc": f"tensordesc<fp8e4nv[{head_dim}, {block_n}],{layout([head_dim, block_n], gl.float8e4nv)!r}>",
        "QS": "*fp32", "KS": "*fp32", "VS": "*fp32", "VO": "*fp32", "Out": "*bf16",
        "stride_ob": "i32", "stride_oh": "i32", "stride_om": "i32", "stride_od": "i32",
        "H": "i32", "M": "i32", "N": "i32", "M_PAD": "i32", "N_PAD": "i32",
        "Q_BLK": "constexpr", "STAGES": "constexpr", "CONSUMER_REGS": "constexpr", "PINGPONG": "constexpr",
        "num_warps": "constexpr",
    }  # fmt: skip
    const = {"Q_BLK": qa.Q_BLOCK, "STAGES": stages, "CONSUMER_REGS": 240, "PINGPONG": False}
    const["num_warps"] = 4
    return compile_gluon_sm90(aot.body("quant_attention_wgmma"), sig, const, 4)


@needs_gluon
@pytest.mark.parametrize(("block_n", "head_dim"), [(128, 128), (64, 128), (128, 64)])
def test_compiles_for_sm90_without_spills(tmp_path: Path, block_n, head_dim):
    ptx = _compile_sm90(block_n, head_dim, stages=wa.DEFAULT_STAGES).asm["ptx"]
    assert "setmaxnreg.inc.sync.aligned.u32 \t240;" in ptx, "the consumer warpgroups must get 240 registers"
    mmas = [line for line in ptx.splitlines() if "wgmma.mma_async" in line]
    assert any(".s32.s8.s8" in line for line in mmas) and any(".e4m3.e4m3" in line for line in mmas), mmas[:4]
    assert_ptxas_sm90a_clean(ptx, tmp_path)
    # The softmax's row max and sum are trees (`gluon_hopper.row_reduce`), 7 deep at 128 keys. Under Triton 3.6 (the
    # GPU machine's) `gl.max`/`gl.sum` alone compile to one dependent chain of block_n / 4 + 1 instructions per row
    # (33 at 128 keys) on the softmax's critical path; Triton 3.8 builds trees itself.
    loop = sass_loop_body(tmp_path / "k.cubin", "QGMMA")
    assert longest_dependent_chain(loop, {"FMNMX", "IMNMX", "VIMNMX", "VIMNMX3"}) <= 8
    assert longest_dependent_chain(loop, {"FADD"}) <= 8


def test_rejects_inputs_it_cannot_run():
    q, k, v = dit_like_qkv(1, 1, 128, 64, 64, seed=0)
    with pytest.raises(ValueError, match="expected a pv_fp8 QuantizedQKV"):
        wa.attention_quantized_wgmma(qkv=qa.quantize_qkv_ref(q, k, v, pv_fp8=False, k_block=64))
    fp8 = qa.quantize_qkv_ref(q, k, v, pv_fp8=True, k_block=64)
    with pytest.raises(ValueError, match="stages must be >= 2"):
        wa.attention_quantized_wgmma(fp8, stages=1)
    with pytest.raises(ValueError, match="expected an sm_90 GPU with Gluon"):  # CPU tensors
        wa.attention_quantized_wgmma(fp8)


@pytest.mark.gpu
@needs_cuda
@needs_sm90_gluon
@pytest.mark.parametrize("k_block", [128, 64])
@pytest.mark.parametrize(
    ("b", "h", "m", "n", "d"),
    [(1, 2, 218, 218, 128), (1, 2, 1, 1000, 128), (1, 2, 1000, 1, 128), (2, 3, 300, 129, 64), (1, 2, 1000, 4100, 128)],
)
@pytest.mark.parametrize("v_key_perm", [True, False])
def test_matches_reference_gpu(k_block, b, h, m, n, d, v_key_perm):
    q, k, v = dit_like_qkv(b, h, m, n, d, seed=SEEDS[0], dtype=torch.bfloat16, device="cuda")
    qkv = qa.quantize_qkv(q, k, v, pv_fp8=True, k_block=k_block, v_key_perm=v_key_perm)
    assert wa.wgmma_attention_supported(qkv)
    out = wa.attention_quantized_wgmma(qkv)
    assert_kernel_vs_ref(out, qa.attention_quantized_ref(qkv), True, f"gluon core k_block={k_block}")
    assert_vs_fp32(out, qa.attention_fp32(q, k, v), FP8_PV_VS_FP32, "gluon core vs fp32")


@pytest.mark.gpu
@needs_cuda
@needs_sm90_gluon
@pytest.mark.parametrize(("stages", "pingpong"), [(2, False), (3, False), (4, True)])
def test_launch_options_match_reference_gpu(stages, pingpong):
    q, k, v = dit_like_qkv(1, 2, 300, 1000, 128, seed=SEEDS[0], dtype=torch.bfloat16, device="cuda")
    qkv = qa.quantize_qkv(q, k, v, pv_fp8=True, k_block=128, v_key_perm=True)
    out = wa.attention_quantized_wgmma(qkv, stages=stages, pingpong=pingpong)
    assert_kernel_vs_ref(out, qa.attention_quantized_ref(qkv), True, f"stages {stages}, pingpong {pingpong}")


@pytest.mark.gpu
@needs_cuda
@needs_sm90_gluon
@pytest.mark.parametrize("d", [128, 64])
def test_quant_attention_runs_the_gluon_core_gpu(d):
    q, k, v = dit_like_qkv(1, 2, 300, 700, d, seed=SEEDS[0], dtype=torch.bfloat16, device="cuda")
    got = qa.quant_attention(q, k, v)
    qkv = qa.quantize_qkv(q, k, v, pv_fp8=True, k_block=qa.GLUON_K_BLOCK, v_key_perm=True)
    assert torch.equal(got, wa.attention_quantized_wgmma(qkv))
    assert_vs_fp32(got, qa.attention_fp32(q, k, v), FP8_PV_VS_FP32, "quant_attention vs fp32")
