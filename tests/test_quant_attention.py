"""Tests of k6fast/kernels/quant_attention.py (SageAttention-2-style INT8 Q·Kᵀ, FP8/FP16 P·V attention).

Three tiers (markers declared in pyproject.toml):
- plain CPU tests: the PyTorch reference against exact FP32 attention, K-smoothing invariance, the quantized
  tensors' layout and bounds, input validation.
- ``interpret``: the Triton kernels at tiny shapes under TRITON_INTERPRET=1, FP16 inputs and FP16 P·V only (bf16 and
  FP8 conversions are wrong in the interpreter). A plain ``pytest`` runs them in a subprocess with the variable set
  (Triton reads it at import); ``TRITON_INTERPRET=1 pytest -m interpret tests/test_quant_attention.py`` runs them in
  process.
- ``gpu``: K6 shapes (1×32×50220×128, 218 audio tokens, cross attention) and odd ones; skipped without CUDA.
  ``pytest -m gpu tests/test_quant_attention.py`` on the GPU machine.

Inputs are DiT-like (K carries per-channel offsets ~ N(0, 3), which only smoothing keeps out of INT8's range) and
drawn from fixed seeds, so a run is repeatable; the bounds below hold for every seed used with margin. The reference's
(FP32 closeness, V offsets, K smoothing) were checked over seeds 0-24 and 3106072417: at most 1.42 % (FP16 P·V),
3.62 % (FP8 P·V), 0.26 % (V offsets). The interpreted FP8 path against its reference: at most 0.97 % over seeds
2-61, 1.08 % at seed 3106072417 (which broke the earlier 1 % bound), hence 1.5 %. A failure message names the seed.

Error budget against exact FP32 attention, relative L2 (diffuse attention over zero-mean random V, the worst case
for a relative metric; measured on CPU with the reference):
- FP16 P·V: INT8 Q·Kᵀ only, about 1.3%          -> bound 2%, cosine >= 0.999.
- FP8 P·V: plus e4m3 rounding of P and of V, each about 2.6% relative whatever the scale -> about 3.6% in all, from
  218 to 50,220 keys (cosine 0.9993) -> bound 4.5%, cosine >= 0.999. The brief's 3% is out of reach for FP8 P and V
  on zero-mean random V; with per-channel V offsets (as DiT values carry) about 0.3% -> bound 3%.
Kernel against reference: the same quantized operands; differences come from exp2.approx, the kernel's one-FMA
score (its bias carries one fp32 rounding of 1.5·2**23·scale), which flips a few FP8 roundings of P, and the output's
bf16/fp16 rounding -> relative L2 <= 1% (FP8) / 0.3% (FP16).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from kernel_testing import interpreter_suite

from k6fast.kernels import quant_attention as qa
from k6fast.kernels import quant_attention_core as qc
from k6fast.kernels import quant_attention_prologue as qp

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()

FP16_PV_VS_FP32 = 0.02
FP8_PV_VS_FP32 = 0.045
FP8_PV_VS_FP32_V_OFFSET = 0.03
MIN_COSINE = 0.999
KERNEL_VS_REF = {False: 3e-3, True: 1e-2}  # by pv_fp8
KERNEL_VS_REF_MIN_COSINE = 0.9999

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


# Cheap CPU tests run each of these; the slow interpreted and GPU ones the first (the FP8 path test all three).
SEEDS = (0, 1, 3106072417)


def dit_like_qkv(
    b: int, h: int, m: int, n: int, d: int, *, seed: int, dtype=torch.float16, device="cpu", v_offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q: [b, h, m, d], k, v: [b, h, n, d]; k = randn + offset[channel] with offsets ~ N(0, 3)."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, h, m, d, generator=g, device=device)
    k = torch.randn(b, h, n, d, generator=g, device=device) + 3.0 * torch.randn(d, generator=g, device=device)
    v = torch.randn(b, h, n, d, generator=g, device=device) + v_offset * torch.randn(d, generator=g, device=device)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def cosine_and_rel_l2(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    out, ref = out.double().flatten(), ref.double().flatten()
    cos = torch.nn.functional.cosine_similarity(out, ref, dim=0).item()
    return cos, ((out - ref).norm() / ref.norm()).item()


def assert_vs_fp32(out: torch.Tensor, exact: torch.Tensor, bound: float, what: str) -> None:
    cos, rel = cosine_and_rel_l2(out, exact)
    assert cos >= MIN_COSINE and rel <= bound, (
        f"{what}: cosine {cos:.6f} (>= {MIN_COSINE}), rel L2 {rel:.4f} (<= {bound})"
    )


def assert_kernel_vs_ref(out: torch.Tensor, ref: torch.Tensor, pv_fp8: bool, what: str) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (
        f"{what}: {out.shape} {out.dtype} vs {ref.shape} {ref.dtype}"
    )
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    cos, rel = cosine_and_rel_l2(out, ref)
    bound = KERNEL_VS_REF[pv_fp8]
    assert cos >= KERNEL_VS_REF_MIN_COSINE and rel <= bound, (
        f"{what}: kernel vs reference cosine {cos:.7f} (>= {KERNEL_VS_REF_MIN_COSINE}), rel L2 {rel:.5f} (<= {bound})"
    )


# ---------------------------------------------------------------------------------------------------------------------
# CPU: the reference
# ---------------------------------------------------------------------------------------------------------------------

REF_SHAPES = [  # (b, h, m, n, d)
    (1, 2, 218, 218, 64),
    (1, 2, 218, 218, 128),
    (1, 2, 1, 1, 128),
    # One query row: 8 heads so the error is measured over 512 outputs. With one head (64 outputs) the FP8 error of
    # a fresh seed passed 4.5 % about once in 75 runs (up to 5.2 % in a CI run; 8 heads: at most 3.8 % in 1000 seeds).
    (1, 8, 1, 218, 64),
    (1, 2, 37, 1000, 128),
    (2, 1, 300, 218, 128),
]


@pytest.mark.parametrize("pv_fp8", [False, True])
@pytest.mark.parametrize("shape", REF_SHAPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_ref_close_to_fp32(shape, pv_fp8, seed):
    q, k, v = dit_like_qkv(*shape, seed=seed, dtype=torch.bfloat16)
    out = qa.quant_attention_ref(q, k, v, pv_fp8=pv_fp8)
    assert out.shape == q.shape and out.dtype == q.dtype
    bound = FP8_PV_VS_FP32 if pv_fp8 else FP16_PV_VS_FP32
    assert_vs_fp32(out, qa.attention_fp32(q, k, v), bound, f"ref pv_fp8={pv_fp8} {shape} seed {seed}")


@pytest.mark.parametrize("seed", SEEDS)
def test_ref_fp8_with_v_offsets_meets_3_percent(seed):
    q, k, v = dit_like_qkv(1, 2, 256, 1000, 128, seed=seed, dtype=torch.bfloat16, v_offset=1.0)
    out = qa.quant_attention_ref(q, k, v, pv_fp8=True)
    assert_vs_fp32(out, qa.attention_fp32(q, k, v), FP8_PV_VS_FP32_V_OFFSET, f"ref fp8, V offsets, seed {seed}")


@pytest.mark.parametrize("pv_fp8", [False, True])
@pytest.mark.parametrize("seed", SEEDS)
def test_ref_k_smoothing_invariance(pv_fp8, seed):
    # Adding a per-channel constant c to K adds q·c to every score of a row: softmax ignores it, and so must the
    # quantization, because smoothing removes it before INT8. Without smoothing, c ~ N(0, 8) would widen K's INT8 step
    # eightfold. fp16 keeps k + c precise (bf16 would round it coarsely).
    q, k, v = dit_like_qkv(1, 2, 128, 300, 64, seed=seed, dtype=torch.float16)
    c = 8.0 * torch.randn(64, generator=torch.Generator().manual_seed(seed + 1))
    shifted = (k.float() + c).half()
    exact = qa.attention_fp32(q, k, v)
    out, out_shifted = (qa.quant_attention_ref(q, kk, v, pv_fp8=pv_fp8) for kk in (k, shifted))
    err, err_shifted = cosine_and_rel_l2(out, exact)[1], cosine_and_rel_l2(out_shifted, exact)[1]
    assert err_shifted <= 1.15 * err + 2e-3, (
        f"seed {seed}: shifting K raised the error from {err:.4f} to {err_shifted:.4f}"
    )
    if not pv_fp8:  # with FP8 P, the two runs differ by P's rounding noise (~2.6%) even when their scores agree
        cos, rel = cosine_and_rel_l2(out_shifted, out)
        assert rel <= 0.01, f"seed {seed}: shifting K moved the output: cosine {cos:.6f}, rel L2 {rel:.4f}"


@pytest.mark.parametrize("pv_fp8", [False, True])
@pytest.mark.parametrize("k_block", qa.K_BLOCKS)
@pytest.mark.parametrize("seed", SEEDS)
def test_quantize_ref_layout_and_bounds(pv_fp8, k_block, seed):
    b, h, m, n, d = 1, 2, 130, 70, 64
    q, k, v = dit_like_qkv(b, h, m, n, d, seed=seed, dtype=torch.float16, v_offset=1.0)
    x = qa.quantize_qkv_ref(q, k, v, pv_fp8=pv_fp8, sm_scale=0.125, k_block=k_block)
    assert x.k_block == k_block
    assert x.q8.shape == (b, h, 256, d) and x.q_scale.shape == (b, h, 2)
    assert x.k8.shape == (b, h, 128, d) and x.k_scale.shape == (b, h, 128 // k_block)
    assert x.vt.shape == (b, h, d, 128) and x.vt.dtype == (torch.float8_e4m3fn if pv_fp8 else torch.float16)
    assert x.q8.abs().max() <= 127 and x.k8.abs().max() <= 127
    assert not x.q8[:, :, m:].any() and not x.k8[:, :, n:].any() and not x.vt[:, :, :, n:].float().any()
    # Q's scale carries sm_scale·log2(e); undo it and check the rounding error is at most half a step.
    step = (x.q_scale / (0.125 * qa.LOG2E)).repeat_interleave(qa.Q_BLOCK, dim=2)[:, :, :m, None]
    # Half a step, plus the two fp32 roundings (127 / absmax, then x times it) of a value up to 127 steps: without
    # that allowance an element within ~1e-5 of a rounding tie fails now and then (seen with fresh seeds).
    slack = 0.5 * step * (1 + 1e-5) + q.float().abs() * 2.0**-21
    assert ((x.q8[:, :, :m].float() * step - q.float()).abs() <= slack).all()
    k_smooth = k.float() - k.float().mean(dim=2, keepdim=True)
    k_step = x.k_scale.repeat_interleave(k_block, dim=2)[:, :, :n, None]
    assert ((x.k8[:, :, :n].float() * k_step - k_smooth).abs() <= 0.5 * k_step * (1 + 1e-4) + 1e-6).all()
    v_back = x.vt[:, :, :, :n].float().transpose(-1, -2)
    if pv_fp8:
        v_back = v_back * x.v_scale[:, :, None, :] + x.v_offset[:, :, None, :]
        assert v_back.sub(v.float()).norm() / v.float().norm() < 0.03
    else:
        assert torch.equal(v_back, v.float())


def test_input_validation():
    q = torch.randn(1, 2, 8, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="head_dim"):
        qa.quant_attention_ref(*(torch.randn(1, 2, 8, 96, dtype=torch.float16),) * 3)
    with pytest.raises(ValueError, match="dtype"):
        qa.quant_attention_ref(q.float(), q.float(), q.float())
    with pytest.raises(ValueError, match="4-D"):
        qa.quant_attention_ref(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="equal shapes"):
        qa.quant_attention_ref(q, q, q[:, :, :4])
    with pytest.raises(ValueError, match="to match q"):
        qa.quant_attention_ref(q, q[:, :1], q[:, :1])
    with pytest.raises(ValueError, match="sm_scale"):
        qa.quant_attention_ref(q, q, q, sm_scale=-1.0)
    with pytest.raises(ValueError, match="exp2_poly"):
        qa.QuantAttentionConfig(unroll=1, exp2_poly=True)
    with pytest.raises(ValueError, match=r"block_n: expected one of \(64, 128\), found 32"):
        qa.QuantAttentionConfig(block_n=32)
    with pytest.raises(ValueError, match="pipeline needs unroll=1"):
        qa.QuantAttentionConfig(unroll=2, pipeline=True)
    with pytest.raises(ValueError, match=r"k_block: expected one of \(64, 128\), found 96"):
        qa.quantize_qkv_ref(q, q, q, pv_fp8=False, k_block=96)
    x = qa.quantize_qkv_ref(q, q, q, pv_fp8=False, k_block=128)
    with pytest.raises(ValueError, match="config.block_n: expected 128, the k_block qkv was quantized with, found 64"):
        qa.attention_quantized(x, config=qa.QuantAttentionConfig(block_n=64))


@pytest.mark.skipif(INTERPRETED, reason="the fallback is taken on CPU without the interpreter")
def test_cpu_falls_back_to_reference():
    q, k, v = dit_like_qkv(1, 1, 5, 7, 64, seed=SEEDS[0])
    assert torch.equal(qa.quant_attention(q, k, v), qa.quant_attention_ref(q, k, v))
    with pytest.raises(ValueError, match="expected CUDA tensors"):
        qa.quantize_qkv(q, k, v, pv_fp8=False)


# ---------------------------------------------------------------------------------------------------------------------
# Interpreter: the Triton kernels on CPU
# ---------------------------------------------------------------------------------------------------------------------

INTERPRET_SHAPES = [  # (b, h, m, n, d): one ragged tile, a single token, full tiles + tail, cross attention
    (1, 2, 37, 37, 64),
    (1, 1, 1, 1, 128),
    (1, 1, 5, 130, 128),
    (2, 1, 130, 200, 64),
]
interpreted_only = pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (see the subprocess test)")


test_interpreter_suite_in_subprocess = interpreter_suite(__file__, timeout=900)


@pytest.mark.interpret
@interpreted_only
@pytest.mark.parametrize("shape", INTERPRET_SHAPES)
@pytest.mark.parametrize("k_block", qa.K_BLOCKS)
@pytest.mark.parametrize("v_key_perm", [False, True])
def test_prologue_matches_ref_interpreted(shape, k_block, v_key_perm):
    seed = SEEDS[0]
    q, k, v = dit_like_qkv(*shape, seed=seed)
    got = qa.quantize_qkv(q, k, v, pv_fp8=False, k_block=k_block, v_key_perm=v_key_perm)
    want = qa.quantize_qkv_ref(q, k, v, pv_fp8=False, k_block=k_block, v_key_perm=v_key_perm)
    assert got.v_key_perm == want.v_key_perm == v_key_perm
    assert got.k_block == want.k_block == k_block and got.k_scale.shape == want.k_scale.shape
    assert torch.equal(got.q8, want.q8), f"seed {seed}"
    torch.testing.assert_close(got.q_scale, want.q_scale, rtol=1e-6, atol=0)
    # K's mean is summed in a different order: a rounding tie may land one step apart.
    assert (got.k8.int() - want.k8.int()).abs().max() <= 1, f"seed {seed}"
    assert (got.k8 != want.k8).float().mean() <= 1e-3, f"seed {seed}"
    torch.testing.assert_close(got.k_scale, want.k_scale, rtol=1e-5, atol=0)
    assert torch.equal(got.vt, want.vt), f"seed {seed}"


@pytest.mark.interpret
@interpreted_only
@pytest.mark.parametrize("shape", INTERPRET_SHAPES)
def test_kernel_matches_ref_interpreted(shape):
    seed = SEEDS[0]
    q, k, v = dit_like_qkv(*shape, seed=seed)
    out = qa.quant_attention(q, k, v)
    assert_kernel_vs_ref(out, qa.quant_attention_ref(q, k, v), False, f"{shape} seed {seed}")
    assert_vs_fp32(out, qa.attention_fp32(q, k, v), FP16_PV_VS_FP32, f"{shape} seed {seed}")


@pytest.mark.interpret
@interpreted_only
@pytest.mark.parametrize("config", qa.CANDIDATE_CONFIGS, ids=str)
@pytest.mark.parametrize("k_block", qa.K_BLOCKS)
def test_configs_match_ref_interpreted(config, k_block):
    # n = 200 = 3 full 64-key tiles + a ragged one (one full 128-key tile + a ragged one): exercises the unrolled
    # pair, the odd leftover tile and the masked tail.
    seed = SEEDS[0]
    q, k, v = dit_like_qkv(1, 1, 130, 200, 64, seed=seed)
    x = qa.quantize_qkv_ref(q, k, v, pv_fp8=False, k_block=k_block)
    config = dataclasses.replace(config, block_n=k_block)
    out = qa.attention_quantized(x, config=config)
    assert_kernel_vs_ref(out, qa.attention_quantized_ref(x), False, f"{config} seed {seed}")


@pytest.mark.interpret
@interpreted_only
@pytest.mark.parametrize("n", [1, 64, 128, 129, 300])
@pytest.mark.parametrize("k_block", qa.K_BLOCKS)
def test_pipelined_loop_edges_interpreted(n, k_block):
    # The pipelined loop has a prologue (first tile's scores), a steady state and an epilogue (last full tile), and
    # the masked tail after it: key counts with no full tile, exactly one, one plus a ragged tail, and several.
    seed = SEEDS[0]
    q, k, v = dit_like_qkv(1, 1, 70, n, 64, seed=seed)
    x = qa.quantize_qkv_ref(q, k, v, pv_fp8=False, k_block=k_block)
    config = qa.QuantAttentionConfig(64, 4, 3, block_n=k_block, pipeline=True)
    out = qa.attention_quantized(x, config=config)
    assert_kernel_vs_ref(out, qa.attention_quantized_ref(x), False, f"n {n} k_block {k_block} seed {seed}")


@pytest.mark.interpret
@interpreted_only
def test_sm_scale_interpreted():
    seed = SEEDS[0]
    q, k, v = dit_like_qkv(1, 2, 37, 90, 128, seed=seed)
    out = qa.quant_attention(q, k, v, sm_scale=0.3)
    assert_kernel_vs_ref(out, qa.quant_attention_ref(q, k, v, sm_scale=0.3), False, f"sm_scale 0.3 seed {seed}")
    # 0.3 is 3.4x the default 1/sqrt(128): the INT8 score error grows with it, so does the output's (about 2.2%).
    assert_vs_fp32(out, qa.attention_fp32(q, k, v, sm_scale=0.3), 0.04, f"sm_scale 0.3 seed {seed}")


@pytest.mark.interpret
@interpreted_only
def test_strided_inputs_interpreted():
    seed = SEEDS[0]
    q, k, v = dit_like_qkv(1, 2, 40, 70, 64, seed=seed)
    # BNHD storage viewed as BHND, as the DiT's projections produce them.
    q2, k2, v2 = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not q2.is_contiguous()
    assert torch.equal(qa.quant_attention(q2, k2, v2), qa.quant_attention(q, k, v)), f"seed {seed}"


@pytest.mark.interpret
@interpreted_only
@pytest.mark.parametrize(
    "config",
    [
        qa.QuantAttentionConfig(),
        qa.QuantAttentionConfig(unroll=2, exp2_poly=True),
        qa.QuantAttentionConfig(64, 4, 3, pipeline=True),
    ],
    ids=str,
)
@pytest.mark.parametrize("seed", SEEDS)
def test_fp8_path_logic_interpreted(config, monkeypatch, seed):
    # The interpreter's fp32 -> e4m3 conversion is not the GPU's (no subnormals, no carry on rounding up), so the
    # public API refuses FP8 there. The kernel's FP8 bookkeeping (P's 448 folded into exp2 and l, the per-tile FP32
    # add, V's scale and smoothing) is still checked here: the reference is given the interpreter's own conversion.
    import numpy as np
    import triton.language as tl
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    def interpreter_fp8(p448: torch.Tensor) -> torch.Tensor:
        a = p448.float().contiguous().numpy()
        bits = interpreter._convert_float(a, tl.float32, tl.float8e4nv, ir.ROUNDING_MODE.RTNE)
        return (
            torch.from_numpy(np.asarray(bits).view(np.uint8).reshape(a.shape).copy()).view(torch.float8_e4m3fn).float()
        )

    q, k, v = dit_like_qkv(1, 2, 130, 200, 64, seed=seed, v_offset=1.0)
    x = qa.quantize_qkv_ref(q, k, v, pv_fp8=True)
    out = qc.launch_attention(x, config)
    monkeypatch.setattr(qc, "p_to_fp8_ref", interpreter_fp8)
    ref = qa.attention_quantized_ref(x)
    mean = x.v_offset[:, :, None].half()  # compare the attention-dependent part, not the offset common to both
    cos, rel = cosine_and_rel_l2(out - mean, ref - mean)
    assert cos >= 0.9999 and rel <= 0.015, f"{config} seed {seed}: cosine {cos:.6f}, rel L2 {rel:.5f}"


@pytest.mark.interpret
@interpreted_only
def test_fp8_refused_interpreted():
    q, k, v = dit_like_qkv(1, 1, 4, 4, 64, seed=0)
    with pytest.raises(ValueError, match="interpreter"):
        qa.quant_attention(q, k, v, pv_fp8=True)


# ---------------------------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------------------------

GPU_SHAPES = [  # (b, h, m, n, d)
    (1, 32, 50220, 50220, 128),  # W1 video self-attention
    (1, 16, 218, 218, 128),  # audio self-attention
    (1, 32, 50220, 218, 128),  # video queries over audio keys
    (1, 16, 218, 50220, 128),  # audio queries over video keys
    (1, 2, 1, 1, 128),
    (1, 4, 1000, 1000, 64),
    (2, 3, 1000, 777, 128),
]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("pv_fp8", [None, False], ids=["pv_default", "pv_fp16"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_matches_ref_and_fp32(shape, pv_fp8):
    seed = SEEDS[0]
    q, k, v = dit_like_qkv(*shape, seed=seed, dtype=torch.bfloat16, device="cuda")
    fp8 = qp.resolve_pv_fp8(pv_fp8, q.device)
    out = qa.quant_attention(q, k, v, pv_fp8=pv_fp8)
    what = f"{shape} pv_fp8={fp8} seed {seed}"
    assert_kernel_vs_ref(out, qa.quant_attention_ref(q, k, v, pv_fp8=fp8), fp8, what)
    assert_vs_fp32(out, qa.attention_fp32(q, k, v), FP8_PV_VS_FP32 if fp8 else FP16_PV_VS_FP32, what)


@pytest.mark.gpu
@gpu
def test_gpu_fp8_with_v_offsets_meets_3_percent():
    seed = SEEDS[0]
    q, k, v = dit_like_qkv(1, 32, 50220, 50220, 128, seed=seed, dtype=torch.bfloat16, device="cuda", v_offset=1.0)
    out = qa.quant_attention(q, k, v)
    bound = FP8_PV_VS_FP32_V_OFFSET if qp.resolve_pv_fp8(None, q.device) else FP16_PV_VS_FP32
    assert_vs_fp32(out, qa.attention_fp32(q, k, v), bound, f"V offsets, seed {seed}")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("pv_fp8", [True, False])
@pytest.mark.parametrize("k_block", qa.K_BLOCKS)
@pytest.mark.parametrize("v_key_perm", [False, True])
def test_gpu_prologue_matches_ref(pv_fp8, k_block, v_key_perm):
    # Without FP8 tensor cores (sm_80-87) the FP8 variant checks the FP16 prologue instead.
    pv_fp8 = pv_fp8 and qp.has_fp8_tensor_cores(torch.device("cuda"))
    seed = SEEDS[0]
    q, k, v = dit_like_qkv(2, 3, 1000, 3001, 128, seed=seed, dtype=torch.bfloat16, device="cuda", v_offset=1.0)
    got = qa.quantize_qkv(q, k, v, pv_fp8=pv_fp8, k_block=k_block, v_key_perm=v_key_perm)
    want = qa.quantize_qkv_ref(q, k, v, pv_fp8=pv_fp8, k_block=k_block, v_key_perm=v_key_perm)
    assert (got.q8.int() - want.q8.int()).abs().max() <= 1 and (got.q8 != want.q8).float().mean() <= 1e-4
    torch.testing.assert_close(got.q_scale, want.q_scale, rtol=1e-6, atol=0)
    assert (got.k8.int() - want.k8.int()).abs().max() <= 1 and (got.k8 != want.k8).float().mean() <= 1e-3
    torch.testing.assert_close(got.k_scale, want.k_scale, rtol=1e-5, atol=0)
    if pv_fp8:
        # A V_q rounding that lands one step apart (see below) moves the channel's offset by up to ~1e-4.
        torch.testing.assert_close(got.v_offset, want.v_offset, rtol=1e-5, atol=1e-3)
        torch.testing.assert_close(got.v_scale, want.v_scale, rtol=1e-5, atol=0)
        # V's mean is summed in a different order: a value on an e4m3 rounding boundary may land one step apart.
        assert (got.vt.float() != want.vt.float()).float().mean() <= 1e-3, f"seed {seed}"
        torch.testing.assert_close(got.vt.float(), want.vt.float(), rtol=0.13, atol=2.0**-9)
    else:
        assert torch.equal(got.vt, want.vt), f"seed {seed}"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("config", qa.CANDIDATE_CONFIGS, ids=str)
def test_gpu_configs_match_ref(config):
    seed = SEEDS[0]
    q, k, v = dit_like_qkv(1, 4, 1000, 3001, 128, seed=seed, dtype=torch.bfloat16, device="cuda")
    fp8 = qp.resolve_pv_fp8(None, q.device)
    x = qa.quantize_qkv_ref(q, k, v, pv_fp8=fp8)
    out = qa.attention_quantized(x, config=config)
    assert_kernel_vs_ref(out, qa.attention_quantized_ref(x), fp8, f"{config} seed {seed}")


@pytest.mark.gpu
@gpu
def test_gpu_strided_inputs_and_fp16():
    seed = SEEDS[0]
    q, k, v = dit_like_qkv(1, 8, 777, 1000, 128, seed=seed, dtype=torch.float16, device="cuda")
    q2, k2, v2 = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    out = qa.quant_attention(q2, k2, v2)
    assert out.dtype == torch.float16
    # Same values, same kernels (the strides share Triton's specialization), so this should be bit-exact; the bound
    # only leaves room for a compiler that picks another reduction order for another stride pattern.
    cos, rel = cosine_and_rel_l2(out, qa.quant_attention(q, k, v))
    assert rel <= 1e-3, f"seed {seed}: strided vs contiguous inputs differ, rel L2 {rel:.2e}"


def test_quantized_qkv_is_frozen():
    x = qa.quantize_qkv_ref(*dit_like_qkv(1, 1, 3, 3, 64, seed=0), pv_fp8=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        x.num_q = 4


def test_the_compiled_op_matches_the_eager_entry_point() -> None:
    # The DiT's compiled blocks call `quant_attention_op` (opaque to Dynamo); its fake must promise what it returns.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 37, 64, generator=g).bfloat16() for _ in range(3))
    eager = qa.quant_attention(q, k, v)
    compiled = torch.compile(lambda a, b, c: qa.quant_attention_op(a, b, c) * 1.0, fullgraph=True)(q, k, v)
    assert torch.equal(compiled, eager) and compiled.is_contiguous()
    torch.library.opcheck(qa.quant_attention_op, (q, k, v))


# ---------------------------------------------------------------------------------------------------------------------
# CPU: the Gluon core's key order of Vᵀ
# ---------------------------------------------------------------------------------------------------------------------


def test_v_key_order_maps_keys_as_the_a_operand_wants():
    keys = torch.arange(96).view(1, 96)  # three 32-key blocks
    ordered = qa.v_key_order(keys)[0]
    for pos in range(96):
        blk, r = divmod(pos, 32)
        i1, q, i0, e = r // 16, (r // 4) % 4, (r // 2) % 2, r % 2  # position 16·i1 + 4q + 2·i0 + e
        assert ordered[pos] == 32 * blk + 16 * i1 + 8 * i0 + 2 * q + e  # holds key 16·i1 + 8·i0 + 2q + e
    x = torch.randn(2, 3, 8, 256)
    assert torch.equal(qa.v_token_order(qa.v_key_order(x)), x)


def test_ref_reads_key_ordered_vt():
    q, k, v = dit_like_qkv(1, 2, 70, 300, 64, seed=SEEDS[0])
    plain = qa.quantize_qkv_ref(q, k, v, pv_fp8=True, k_block=128)
    keyed = qa.quantize_qkv_ref(q, k, v, pv_fp8=True, k_block=128, v_key_perm=True)
    assert keyed.v_key_perm and torch.equal(keyed.vt.float(), qa.v_key_order(plain.vt).float())
    assert torch.equal(qa.attention_quantized_ref(keyed), qa.attention_quantized_ref(plain))


def test_triton_core_refuses_key_ordered_vt():
    q, k, v = dit_like_qkv(1, 1, 64, 64, 64, seed=0)
    qkv = qa.quantize_qkv_ref(q, k, v, pv_fp8=False, k_block=64, v_key_perm=True)
    with pytest.raises(ValueError, match="expected vt in token order"):
        qa.attention_quantized(qkv)
