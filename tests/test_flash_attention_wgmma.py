"""The exact Gluon attention for sm_90 (kernels/flash_attention_wgmma.py) and its place in the attention dispatch.

CPU: the kernel compiles for sm_90a with the installed Triton (catches Gluon API drift) into register-reallocated
partitions with 16-bit wgmmas, P·V kept in flight over the next softmax (`wait_group 1`), shared memory within an
H100/H200 block's 227 KiB, and ptxas neither serializing the wgmmas nor spilling; the 2-D views the TMA loads tile
address every head and token of each layout; inputs it cannot run are refused with what it expected; with the switch
on, a CPU run still goes to SDPA. GPU (`-m gpu`, sm_90): the flash-attention
rule against FP32 attention (no worse than twice SDPA's error) at ragged shapes, in every layout the kernel takes,
both head dims, both dtypes, both key tiles; the op under torch.compile; the dispatch routing unmasked calls to it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import assert_ptxas_sm90a_clean, compile_gluon_sm90, needs_cuda, needs_gluon, needs_sm90_gluon

from k6fast.dit.attention import AttentionDispatch
from k6fast.kernels import flash_attention_wgmma as fa
from k6fast.kernels.quant_attention import attention_fp32
from k6fast.switches import Options

MAX_DYNAMIC_SMEM = 232448  # bytes per block on sm_90 (227 KiB)


def _compile_sm90(block_n: int, head_dim: int, stages: int, dtype: str):
    gl = fa.gl
    gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]
    layout = gl.NVMMASharedLayout.get_default_for
    sig = {
        "q_desc": f"tensordesc<{dtype}[64, {head_dim}],{layout([64, head_dim], gdt)!r}>",
        "k_desc": f"tensordesc<{dtype}[{block_n}, {head_dim}],{layout([block_n, head_dim], gdt)!r}>",
        "v_desc": f"tensordesc<{dtype}[{block_n}, {head_dim}],{layout([block_n, head_dim], gdt)!r}>",
        "Out": f"*{dtype}", "stride_ob": "i32", "stride_om": "i32", "stride_oh": "i32",
        "H": "i32", "M": "i32", "N": "i32", "Q_ROWS_B": "i32", "KV_ROWS_B": "i32", "ROWS_H": "i32", "COL_H": "i32",
        "qk_scale": "fp32", "STAGES": "constexpr", "CONSUMER_REGS": "constexpr", "num_warps": "constexpr",
    }  # fmt: skip
    const = {"STAGES": stages, "CONSUMER_REGS": 240, "num_warps": 4}
    return compile_gluon_sm90(fa._flash_attention_kernel, sig, const, 4)


@needs_gluon
@pytest.mark.parametrize(("block_n", "head_dim", "dtype"), [(128, 128, "bf16"), (64, 128, "fp16"), (128, 64, "bf16")])
def test_compiles_for_sm90_without_spills(tmp_path: Path, block_n, head_dim, dtype):
    kernel = _compile_sm90(block_n, head_dim, fa.DEFAULT_STAGES, dtype)
    ptx = kernel.asm["ptx"]
    assert "setmaxnreg.inc.sync.aligned.u32 \t240;" in ptx, "the consumer warpgroups must get 240 registers"
    mmas = [line for line in ptx.splitlines() if "wgmma.mma_async" in line]
    ptx_type = {"bf16": "bf16", "fp16": "f16"}[dtype]
    assert mmas and all(f".f32.{ptx_type}.{ptx_type}" in line for line in mmas), mmas[:2]
    assert "wgmma.wait_group.sync.aligned 1;" in ptx, "P·V must stay in flight over the next tile's softmax"
    assert kernel.metadata.shared <= MAX_DYNAMIC_SMEM
    assert_ptxas_sm90a_clean(ptx, tmp_path)


def test_rejects_inputs_it_cannot_run():
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    assert not fa.flash_attention_supported(q, q, q)
    with pytest.raises(ValueError, match="expected an sm_90 GPU with Gluon and \\[B, N, H, D\\] bf16/fp16"):
        fa.flash_attention(q, q, q)


@pytest.mark.parametrize("layout", ["token_major", "head_major", "fused_qkv", "odd_strides"])
def test_rows_view_addresses_every_head_and_token(layout):
    """The producer's coordinates: x[b, t, h] is row b·rows + h·ROWS_H·N + t of the 2-D view, from column h·COL_H."""
    b, n, h, d = 2, 5, 3, 64
    x = torch.randn(b, n, h, d)
    if layout == "head_major":
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    elif layout == "fused_qkv":
        x = torch.randn(b, n, 3, h, d)[:, :, 1]
    elif layout == "odd_strides":  # channels not contiguous: copied to the projections' layout
        x = torch.randn(b, n, d, h).permute(0, 1, 3, 2)
    view, rows, rows_h, col_h = fa._rows_view(x)
    assert view.stride(1) == 1 and view.stride(0) % 8 == 0  # TMA: unit inner stride, 16-byte rows
    for bi in range(b):
        for hi in range(h):
            r0 = bi * rows + hi * rows_h * n
            torch.testing.assert_close(view[r0 : r0 + n, hi * col_h : hi * col_h + d], x[bi, :, hi], rtol=0, atol=0)


def test_switch_on_cpu_still_runs_sdpa():
    dispatch = AttentionDispatch(Options().replace(exact_attn_kernel="k6"), torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 2, 64, generator=g) for n in (5, 7, 7))
    out = dispatch(q, k, v, site="video_self", mask=None)
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(out, ref)
    assert dispatch.counts == {("exact", "video_self"): 1}


# --- GPU -------------------------------------------------------------------------------------------------------------


def _qkv(b, h, m, n, d, dtype, seed=0):
    """DiT-like [B, N, H, D] inputs: K with per-channel offsets, as after the projections and RoPE."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, m, h, d, generator=g, device="cuda")
    k = torch.randn(b, n, h, d, generator=g, device="cuda") + 3.0 * torch.randn(h, d, generator=g, device="cuda")
    v = torch.randn(b, n, h, d, generator=g, device="cuda")
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _in_layout(q, k, v, layout: str):
    if layout == "token_major":  # the DiT's projections
        return q, k, v
    if layout == "head_major":  # contiguous [B, H, N, D] transposed to [B, N, H, D]
        return tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    if layout == "fused_qkv":  # slices of one [B, N, 3, H, D] projection: rows strided by 3·H·D
        assert q.shape == k.shape
        qkv = torch.stack((q, k, v), dim=2)
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    assert layout == "mixed"  # q token-major, k/v head-major: copied to one layout
    return q, *(t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))


def _assert_flash_rule(out, q, k, v):
    """No worse than twice SDPA's error against FP32 attention, in relative L2 and in max abs (+1e-6)."""
    exact = attention_fp32(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    diff, ref_diff = out.float() - exact, ref.float() - exact
    assert diff.norm() <= 2 * ref_diff.norm() + 1e-6 * exact.norm(), (diff.norm() / exact.norm()).item()
    assert diff.abs().max() <= 2 * ref_diff.abs().max() + 1e-6, diff.abs().max().item()


@needs_cuda
@needs_sm90_gluon
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("b", "h", "m", "n", "d", "dtype", "layout", "block_n", "stages"),
    [
        (2, 3, 218, 218, 128, torch.bfloat16, "token_major", 128, 3),
        (2, 3, 218, 218, 128, torch.bfloat16, "fused_qkv", 128, 3),
        (1, 2, 1, 1000, 128, torch.bfloat16, "head_major", 128, 3),
        (2, 2, 1000, 1, 64, torch.float16, "token_major", 128, 3),
        (2, 3, 300, 129, 128, torch.float16, "mixed", 64, 2),
        (1, 4, 129, 4100, 64, torch.bfloat16, "head_major", 128, 2),
        (2, 2, 385, 385, 128, torch.bfloat16, "fused_qkv", 64, 4),
        (1, 2, 4097, 2048, 128, torch.bfloat16, "token_major", 128, 3),
    ],
)
def test_flash_rule_against_fp32_gpu(b, h, m, n, d, dtype, layout, block_n, stages):
    q, k, v = _in_layout(*_qkv(b, h, m, n, d, dtype), layout)
    out = fa.flash_attention(q, k, v, block_n=block_n, stages=stages)
    _assert_flash_rule(out, q, k, v)


@needs_cuda
@needs_sm90_gluon
@pytest.mark.gpu
def test_op_under_compile_matches_eager_gpu():
    q, k, v = _qkv(1, 2, 300, 300, 128, torch.bfloat16)
    compiled = torch.compile(lambda q, k, v: fa.flash_attention_op(q, k, v) * 2.0, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), fa.flash_attention(q, k, v) * 2.0, rtol=0, atol=0)


@needs_cuda
@needs_sm90_gluon
@pytest.mark.gpu
def test_dispatch_routes_unmasked_calls_gpu():
    dispatch = AttentionDispatch(Options().replace(exact_attn_kernel="k6"), torch.device("cuda"))
    q, k, v = _qkv(1, 2, 200, 64, 128, torch.bfloat16)
    _assert_flash_rule(dispatch(q, k, v, site="video_self", mask=None), q, k, v)
    mask = torch.ones(1, 64, dtype=torch.bool, device="cuda")
    mask[:, 40:] = False
    masked = dispatch(q, k, v, site="video_text", mask=mask)
    torch.testing.assert_close(masked, fa.flash_attention(q, k[:, :40], v[:, :40]), rtol=2e-2, atol=2e-2)
    assert dispatch.counts == {("exact_k6", "video_self"): 1, ("exact", "video_text"): 1}
