"""The FP16-accumulate FP8 P·V of the quantized attention (GeForce sm_89/sm_12x; SageAttention2++'s scheme).

On those GPUs the prologue quantizes V per channel to ±V_FP16_ACC_MAX (2.25) instead of ±448, and the Triton core sums
each 32-key chunk of P·V in FP16 (one m16n8k32 FP8 MMA from zero), the chunks in FP32. P·448 <= 448 after its
saturating e4m3 conversion, so a chunk's partial sums stay within 32 · 448 · 2.25 = 32,256 < 65,504 for any input.

CPU: `attention_quantized_ref` with `pv_fp16_acc` is the emulation (exact products of the e4m3 values, each 32-key
chunk's exact sum rounded once to FP16, FP32 across chunks; float64 sums, exact for 32 such products). Measured here
with it (not a GPU record): against exact FP32 attention 3.1-3.6 % relative L2 on zero-mean random V, 0.2-0.5 % with
per-channel V offsets, the same as the FP32-accumulate path on the same inputs to within 0.1 %; the FP16 rounding
alone (the same quantized operands, FP16 against FP32 sums) about 0.1 %. What the ±2.25 range costs: e4m3 is
subnormal below 2^-6, i.e. below 0.7 % of a channel's absmax (0.003 % at ±448), so only channels whose bulk sits two
decades under their outliers lose bits: with a few keys at 100x / 300x the others' magnitude, the others' V error
grows from 2.7 % to 4.2 % / 11.7 % (the attention output's, dominated by the outliers, from 2.8 % to 2.9 %).
Bounds: the FP8 path's (4.5 %, 3 % with V offsets), no worse than the FP32-accumulate path by more than 10 % + 0.2
points, the FP16 rounding alone <= 0.3 %. The adversarial input (every P of a tile 448, V at ±max, chunks of one
sign) must stay finite and within the FP8 bound, and the same operands quantized to ±448 must overflow under the
emulation, so the emulation can see an overflow.

GPU (`-m gpu`): the Triton core with the path forced (`pv_fp16_acc=True`) on whatever GPU is present (it builds for
sm_90 as well: QGMMA.*.F16.E4M3.E4M3 with Triton 3.6 and 3.8), against the emulation and exact FP32 attention at
W1-like and ragged shapes, and on the adversarial input. Without FP8 tensor cores (sm_80-87) the path is refused.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_quant_attention import (
    FP8_PV_VS_FP32,
    FP8_PV_VS_FP32_V_OFFSET,
    SEEDS,
    assert_kernel_vs_ref,
    assert_vs_fp32,
    cosine_and_rel_l2,
    dit_like_qkv,
)

from k6fast.kernels import quant_attention as qa
from k6fast.kernels import quant_attention_core as qc
from k6fast.kernels import quant_attention_prologue as qp
from k6fast.kernels.attention_constants import FP8_MAX, PV_CHUNK, V_FP16_ACC_MAX
from k6fast.kernels.formats import E4M3_MAX

FP16_MAX = 65504.0
FP16_ROUNDING_ALONE = 3e-3
ADVERSARIAL_CHANNEL = 0.03

SHAPES = [  # (b, h, m, n, d): N a multiple of neither 32 nor 128, a single key, W1-like ragged lengths
    (1, 2, 218, 218, 64),
    (1, 2, 218, 218, 128),
    (1, 2, 1, 1, 128),
    (1, 8, 1, 77, 64),
    (1, 2, 37, 1000, 128),
    (1, 2, 130, 4001, 64),
]


def _ref(q, k, v, *, fp16_acc: bool, k_block: int = qa.K_BLOCK) -> torch.Tensor:
    return qc.attention_quantized_ref(qa.quantize_qkv_ref(q, k, v, pv_fp8=True, k_block=k_block, pv_fp16_acc=fp16_acc))


@pytest.mark.parametrize("k_block", qa.K_BLOCKS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("v_offset", [0.0, 1.0])
def test_emulation_close_to_fp32_and_to_the_fp32_accumulate_path(shape, k_block, v_offset):
    for seed in SEEDS[:2]:
        q, k, v = dit_like_qkv(*shape, seed=seed, dtype=torch.bfloat16, v_offset=v_offset)
        exact = qa.attention_fp32(q, k, v)
        out = _ref(q, k, v, fp16_acc=True, k_block=k_block)
        assert out.shape == q.shape and out.dtype == q.dtype and torch.isfinite(out).all()
        what = f"{shape} k_block {k_block} v_offset {v_offset} seed {seed}"
        assert_vs_fp32(out, exact, FP8_PV_VS_FP32_V_OFFSET if v_offset else FP8_PV_VS_FP32, what)
        err16 = cosine_and_rel_l2(out, exact)[1]
        err32 = cosine_and_rel_l2(_ref(q, k, v, fp16_acc=False, k_block=k_block), exact)[1]
        assert err16 <= 1.1 * err32 + 2e-3, f"{what}: FP16 accumulation {err16:.4f} vs FP32 {err32:.4f}"


@pytest.mark.parametrize("k_block", qa.K_BLOCKS)
@pytest.mark.parametrize("seed", SEEDS)
def test_fp16_rounding_alone(k_block, seed):
    # The same quantized operands summed both ways: what the FP16 accumulators cost by themselves.
    q, k, v = dit_like_qkv(1, 4, 256, 3001, 128, seed=seed, dtype=torch.bfloat16)
    x = qa.quantize_qkv_ref(q, k, v, pv_fp8=True, k_block=k_block, pv_fp16_acc=True)
    fp16 = qc.attention_quantized_ref(x)
    fp32 = qc.attention_quantized_ref(dataclasses.replace(x, pv_fp16_acc=False))
    cos, rel = cosine_and_rel_l2(fp16, fp32)
    assert not torch.equal(fp16, fp32), "the emulation did not round anything to FP16"
    assert rel <= FP16_ROUNDING_ALONE, f"seed {seed}: FP16 vs FP32 sums differ by {rel:.5f} (cosine {cos:.7f})"


def test_chunk_emulation_rounds_each_32_key_sum_once():
    # Two chunks whose exact sums are 2049 (not an FP16 value: it rounds to 2048) and 1: the emulation must give
    # 2048 + 1, not fp16(2050) or the exact 2050.
    p = torch.zeros(1, 1, 64)
    v = torch.zeros(1, 64, 1)
    p[0, 0, :3], v[0, :3, 0] = torch.tensor([E4M3_MAX, E4M3_MAX, 1.0]), torch.tensor([2.25, 2.25, 33.0])  # 2016 + 33
    p[0, 0, 40], v[0, 40, 0] = 1.0, 1.0
    assert qc.pv_fp16_chunks_ref(p, v).item() == 2048.0 + 1.0
    assert PV_CHUNK == 32


def _adversarial_qkv(n: int, d: int, dtype=torch.bfloat16):
    """Keys in 128-key blocks of alternating sign (channel 0 of K and channel 1 of V are +1 / -1): the query attends
    to the + blocks only, with equal scores, so every P there is 1 (448 in e4m3) and V's channel 1 is at +max."""
    g = torch.Generator().manual_seed(0)
    sign = 1.0 - 2.0 * ((torch.arange(n) // 128) % 2).float()
    q = torch.zeros(1, 1, 16, d)
    q[..., 0] = 200.0  # scores of the - keys 50 below the + keys' (sm_scale 1/8 at d = 64): their P is 0
    k = torch.zeros(1, 1, n, d)
    k[..., 0] = sign
    v = torch.randn(1, 1, n, d, generator=g)
    v[..., 1] = sign
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _assert_adversarial_output(out, q, k, v) -> None:
    assert torch.isfinite(out).all(), "FP16-accumulate P·V overflowed on the adversarial input"
    assert_vs_fp32(out, qa.attention_fp32(q, k, v), FP8_PV_VS_FP32, "adversarial input")
    # Exactly +1 at n = 4096; at 4001 the smoothed +1 (0.976 of the channel's absmax) rounds in e4m3 (by 2.4 %).
    assert (out[..., 1].float() - 1.0).abs().max() <= ADVERSARIAL_CHANNEL, "the attended keys' V channel 1 is +1"


@pytest.mark.parametrize("n", [4096, 4001])
@pytest.mark.parametrize("k_block", qa.K_BLOCKS)
def test_adversarial_chunks_stay_finite(n, k_block):
    q, k, v = _adversarial_qkv(n, 64)
    x = qa.quantize_qkv_ref(q, k, v, pv_fp8=True, k_block=k_block, pv_fp16_acc=True)
    # The chunk sums this input produces (P = 448 on the + keys) reach the bound the V range is chosen for.
    vt = x.vt[0, 0, 1, : n // 128 * 128].float().view(-1, PV_CHUNK)
    chunk_max = (FP8_MAX * vt.clamp_min(0).sum(dim=1)).max().item()
    assert 0.99 * PV_CHUNK * FP8_MAX * V_FP16_ACC_MAX <= chunk_max < FP16_MAX, f"max chunk sum {chunk_max}"
    out = qc.attention_quantized_ref(x)
    _assert_adversarial_output(out, q, k, v)
    # Against FP32 sums of the same operands: these chunk sums (1008 · 32) are FP16 values, so only the random
    # channels' FP16 roundings differ.
    fp32_sums = qc.attention_quantized_ref(dataclasses.replace(x, pv_fp16_acc=False))
    assert cosine_and_rel_l2(out, fp32_sums)[1] <= FP16_ROUNDING_ALONE
    # The same operands quantized to ±448 overflow under the same emulation: it sees an overflow when there is one.
    x448 = qa.quantize_qkv_ref(q, k, v, pv_fp8=True, k_block=k_block, pv_fp16_acc=False)
    assert not torch.isfinite(qc.attention_quantized_ref(dataclasses.replace(x448, pv_fp16_acc=True))).all()


@pytest.mark.parametrize("k_block", qa.K_BLOCKS)
def test_prologue_ref_scales_v_to_the_fp16_accumulate_range(k_block):
    q, k, v = dit_like_qkv(1, 2, 130, 70, 64, seed=SEEDS[0], dtype=torch.float16, v_offset=1.0)
    x = qa.quantize_qkv_ref(q, k, v, pv_fp8=True, k_block=k_block, pv_fp16_acc=True)
    assert x.pv_fp16_acc and x.vt.dtype == torch.float8_e4m3fn
    vq = x.vt.float()
    assert vq.abs().amax(dim=(-1,)).max() == V_FP16_ACC_MAX  # each channel's absmax maps to 2.25 exactly
    assert (vq.abs().amax(dim=-1) == V_FP16_ACC_MAX).all()
    plain = qa.quantize_qkv_ref(q, k, v, pv_fp8=True, k_block=k_block, pv_fp16_acc=False)
    torch.testing.assert_close(x.v_scale * V_FP16_ACC_MAX, plain.v_scale * FP8_MAX, rtol=1e-6, atol=0)
    v_back = vq[..., :70].transpose(-1, -2) * x.v_scale[:, :, None, :] + x.v_offset[:, :, None, :]
    assert v_back.sub(v.float()).norm() / v.float().norm() < 0.03


def test_choice_by_capability_and_refusals(monkeypatch):
    expected = {(8, 0): False, (8, 6): False, (8, 9): True, (9, 0): False, (10, 0): False, (12, 0): True, (12, 1): True}
    assert {cap: qp.pv_fp16_acc_on(cap) for cap in expected} == expected
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce RTX 5090")
    for cap, on in expected.items():
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cap=cap: cap)
        assert qp.resolve_pv_fp16_acc(None, True, torch.device("cuda", 0)) is on
        assert qp.resolve_pv_fp16_acc(None, False, torch.device("cuda", 0)) is False
    q = torch.randn(1, 1, 8, 64, dtype=torch.float16)
    assert not qa.quantize_qkv_ref(q, q, q, pv_fp8=True).pv_fp16_acc  # CPU: the FP32-accumulate default
    with pytest.raises(ValueError, match="pv_fp16_acc=True: expected pv_fp8=True"):
        qa.quantize_qkv_ref(q, q, q, pv_fp8=False, pv_fp16_acc=True)
    fp16_v = dataclasses.replace(qa.quantize_qkv_ref(q, q, q, pv_fp8=False), pv_fp16_acc=True)
    with pytest.raises(ValueError, match="pv_fp16_acc=True expects pv_fp8=True"):
        qa.attention_quantized(fp16_v)


@pytest.mark.parametrize(
    ("name", "on"),
    [("NVIDIA GeForce RTX 4090", True), ("NVIDIA L40S", False), ("NVIDIA RTX 6000 Ada Generation", False)],
)
def test_default_needs_a_geforce_card_not_only_its_capability(monkeypatch, name, on):
    # sm_89 is GeForce Ada and datacenter Ada alike: only GeForce gets the lossier FP16-accumulate P·V by default.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert qp.resolve_pv_fp16_acc(None, True, torch.device("cuda", 0)) is on
    assert qp.resolve_pv_fp16_acc(True, True, torch.device("cuda", 0)) is True  # forcing it is still allowed


# ---------------------------------------------------------------------------------------------------------------------
# GPU: the Triton core with the path forced, on whatever GPU is present
# ---------------------------------------------------------------------------------------------------------------------

GPU_SHAPES = [  # (b, h, m, n, d): W1-like (1 x 4096 tokens x 8 heads x 128), ragged, head_dim 64
    (1, 8, 4096, 4096, 128),
    (1, 8, 4001, 4001, 128),
    (1, 8, 4096, 4096, 64),
    (1, 8, 4001, 4001, 64),
]


def _forced_qkv(q, k, v, k_block):
    return qa.quantize_qkv(q, k, v, pv_fp8=True, k_block=k_block, pv_fp16_acc=True)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _refused_here(q, k, v) -> bool:
    """Where the forced path cannot run, the prologue refuses it with its reason (`quant_attention` then runs the
    reference by itself): on the CPU (no CUDA tensors; under the interpreter, its wrong FP8 rounding) and on sm_80-87
    (no FP8 tensor cores). Checked, then True; False where the kernel runs."""
    if q.device.type == "cuda" and qp.has_fp8_tensor_cores(q.device):
        return False
    reason = "needs FP8 tensor cores" if q.device.type == "cuda" else "expected CUDA tensors|rounds FP8 wrongly"
    with pytest.raises(ValueError, match=reason):
        _forced_qkv(q, k, v, qa.K_BLOCK)
    return True


@pytest.mark.gpu
@pytest.mark.parametrize("k_block", qa.K_BLOCKS)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_forced_fp16_accumulate_core(shape, k_block):
    q, k, v = dit_like_qkv(*shape, seed=SEEDS[0], dtype=torch.bfloat16, device=DEVICE)
    if _refused_here(q, k, v):
        return
    x = _forced_qkv(q, k, v, k_block)
    want = qa.quantize_qkv_ref(q, k, v, pv_fp8=True, k_block=k_block, pv_fp16_acc=True)
    assert x.pv_fp16_acc and x.vt.float().abs().max() <= V_FP16_ACC_MAX
    torch.testing.assert_close(x.v_scale, want.v_scale, rtol=1e-5, atol=0)
    cfg = dataclasses.replace(qc.config_for(q.device, shape[4], True), block_n=k_block)
    out = qa.attention_quantized(x, config=cfg)
    what = f"{shape} k_block {k_block} {cfg}"
    assert_kernel_vs_ref(out, qc.attention_quantized_ref(x), True, what)
    assert_vs_fp32(out, qa.attention_fp32(q, k, v), FP8_PV_VS_FP32, what)
    q, k, v = dit_like_qkv(*shape, seed=SEEDS[0], dtype=torch.bfloat16, device=DEVICE, v_offset=1.0)
    out = qa.attention_quantized(_forced_qkv(q, k, v, k_block), config=cfg)
    assert_vs_fp32(out, qa.attention_fp32(q, k, v), FP8_PV_VS_FP32_V_OFFSET, f"{what}, V offsets")


@pytest.mark.gpu
@pytest.mark.parametrize("n", [4096, 4001])
@pytest.mark.parametrize("k_block", qa.K_BLOCKS)
def test_gpu_adversarial_chunks_stay_finite(n, k_block):
    q, k, v = (t.to(DEVICE) for t in _adversarial_qkv(n, 64))
    if _refused_here(q, k, v):
        return
    x = _forced_qkv(q, k, v, k_block)
    out = qa.attention_quantized(x, config=qa.QuantAttentionConfig(block_n=k_block))
    _assert_adversarial_output(out, q, k, v)
    assert_kernel_vs_ref(out, qc.attention_quantized_ref(x), True, f"adversarial n {n} k_block {k_block}")
