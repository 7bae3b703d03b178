"""The Gluon FP16-accumulate GEMM for sm_90 (k6fast/kernels/fp16acc_wgmma.py).

CPU: the kernel compiles for sm_90a with the installed Triton (Gluon is experimental; this catches API drift), its
MMAs accumulate in fp16 and stay in flight (a `wgmma.wait_group 1` in the loop), and ptxas neither serializes the
wgmmas (warning C7514) nor spills. GPU (`-m gpu`, sm_90): results against the reference at ragged shapes, and
`fp16acc_linear` on sm_90 running this kernel.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kernel_testing import assert_ptxas_sm90a_clean, compile_gluon_sm90, needs_cuda, needs_gluon, needs_sm90_gluon

from k6fast.kernels import aot
from k6fast.kernels import fp16acc_wgmma as wg
from k6fast.kernels.fp16acc_linear import fp16acc_linear, fp16acc_linear_ref
from k6fast.testing.bounds import rel_l2


def _compile_sm90(tile: wg.WgmmaTile):
    gl = wg.gl
    la = gl.NVMMASharedLayout.get_default_for([tile.block_m, wg.BLOCK_K], gl.float16)
    lb = gl.NVMMASharedLayout.get_default_for([tile.block_n, wg.BLOCK_K], gl.float16)
    sig = {
        "a_desc": f"tensordesc<fp16[{tile.block_m}, {wg.BLOCK_K}],{la!r}>",
        "b_desc": f"tensordesc<fp16[{tile.block_n}, {wg.BLOCK_K}],{lb!r}>",
        "y_ptr": "*bf16", "bias_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_ym": "i32",
        "HAS_BIAS": "constexpr", "STAGES": "constexpr", "GROUP_M": "constexpr", "num_warps": "constexpr",
    }  # fmt: skip
    const = {"HAS_BIAS": True, "STAGES": tile.stages, "GROUP_M": tile.group_m, "num_warps": tile.num_warps}
    return compile_gluon_sm90(aot.body("fp16acc_wgmma"), sig, const, tile.num_warps)


@needs_gluon
@pytest.mark.parametrize("tile", [wg.DEFAULT_TILE, wg.WgmmaTile(128, 128, 4, 3, 8)], ids=["default", "128x128"])
def test_compiles_for_sm90_with_async_fp16_wgmma(tmp_path: Path, tile):
    ptx = _compile_sm90(tile).asm["ptx"]
    mmas = [line for line in ptx.splitlines() if "wgmma.mma_async" in line]
    assert mmas and all(".f16.f16.f16" in line for line in mmas), "expected fp16-accumulator wgmma only"
    assert "wgmma.wait_group.sync.aligned 1;" in ptx, "the second half's MMAs must stay in flight"
    assert_ptxas_sm90a_clean(ptx, tmp_path)


@needs_gluon
def test_not_supported_for_cpu_tensors():
    x = torch.zeros(4, 64, dtype=torch.float16)
    assert not wg.fp16acc_wgmma_supported(x, torch.zeros(8, 64, dtype=torch.float16))  # CPU tensors


def test_rejects_non_fp16_operands():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="expected fp16 x and w"):
        wg.fp16acc_wgmma(x, torch.zeros(8, 64, dtype=torch.float16))


@pytest.mark.gpu
@needs_cuda
@needs_sm90_gluon
@pytest.mark.parametrize("tile", [wg.DEFAULT_TILE, wg.WgmmaTile(128, 128, 4, 3, 8)], ids=["default", "128x128"])
@pytest.mark.parametrize(
    ("m", "k", "n", "with_bias"),
    [(217, 136, 200, True), (1, 4096, 4096, False), (3000, 4104, 120, True), (50220, 64, 72, False)],
)
def test_matches_reference_gpu(tile, m, k, n, with_bias):
    g = torch.Generator(device="cuda").manual_seed(m + k + n)
    x = torch.randn(m, k, device="cuda", generator=g).half()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.05).half()
    bias = torch.randn(n, device="cuda", generator=g) if with_bias else None
    y = wg.fp16acc_wgmma(x, w, bias, tile=tile, out_dtype=torch.float32)
    # fp16 rounding of each 64-wide chunk sum: 1.5e-4 to 3.3e-4 measured on an H200
    assert rel_l2(y, fp16acc_linear_ref(x, w, bias, out_dtype=torch.float32)) < 1e-3


@pytest.mark.gpu
@needs_cuda
@needs_sm90_gluon
def test_fp16acc_linear_runs_the_wgmma_kernel_on_sm90_gpu():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 300, 512, device="cuda", generator=g).bfloat16()
    w = (torch.randn(384, 512, device="cuda", generator=g) * 0.05).bfloat16()
    direct = wg.fp16acc_wgmma(x.reshape(-1, 512).half(), w.half()).reshape(2, 300, 384)
    assert torch.equal(fp16acc_linear(x, w, k_chunk=64), direct)
