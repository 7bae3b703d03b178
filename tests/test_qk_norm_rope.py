"""k6fast/kernels/qk_norm_rope.py: per-head RMSNorm + RoPE of queries and keys in one pass.

CPU: the reference is the DiT forward's sequence, the public op's CPU path, its checks, compile tracing and the
backend switch. Interpreter: the Triton kernel at tiny shapes (fp32 tightly, bf16 to one or two units in the last
place: the interpreter does not round fp32 → bf16 to nearest). GPU: W1 shapes (50,220 video tokens × 32 heads × 128)
and the audio shapes, bf16, judged against fp32 math of the same sequence.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import interpreter_suite, needs_cuda, needs_interpreter

from k6fast.dit.backend import ExactBackend, SwitchedBackend
from k6fast.dit.rope import rope_1d
from k6fast.kernels import qk_norm_rope
from k6fast.kernels.qk_norm_rope import apply_rope, rms_norm_rope, rms_norm_rope_ref, rms_norm_rope_triton
from k6fast.switches import Options
from k6fast.testing.bounds import assert_within_baseline_error, rel_l2

# (B, N, H, D): D a power of two, D/2 not one (48 pairs: masked lanes), one token, a batch of two.
SHAPES = [(1, 7, 3, 128), (2, 5, 2, 96), (1, 1, 4, 64), (1, 33, 2, 64)]


def _inputs(shape, dtype=torch.bfloat16, device="cpu", seed=0, rope=True):
    g = torch.Generator(device=device).manual_seed(seed)
    b, n, h, d = shape
    # A projection's output: per-channel scales differ a lot (what the norm is for), a few large channels.
    x = torch.randn(shape, generator=g, device=device) * (0.5 + torch.rand(d, generator=g, device=device) * 3)
    weight = 1.0 + 0.3 * torch.randn(d, generator=g, device=device)
    cos, sin = rope_1d(torch.arange(n, device=device) * 3 + 1, d) if rope else (None, None)
    return x.to(dtype), weight.to(dtype), cos, sin


def _truth(x, weight, cos, sin, eps):
    """fp32 maths of the sequence, no intermediate rounding."""
    xf = x.double()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    return y if cos is None else apply_rope(y, cos.double(), sin.double())


def test_reference_is_the_forwards_sequence():
    x, weight, cos, sin = _inputs((1, 7, 3, 128))
    expected = apply_rope(F.rms_norm(x, (128,), weight.to(x.dtype)), cos, sin)
    assert torch.equal(rms_norm_rope_ref(x, weight, cos, sin, torch.finfo(torch.float32).eps), expected)
    assert torch.equal(ExactBackend().norm_rope(x, weight, (cos, sin)), expected)
    assert torch.equal(ExactBackend().norm_rope(x, weight, None), F.rms_norm(x, (128,), weight))


@pytest.mark.parametrize("rope", [True, False])
def test_public_op_on_cpu_equals_the_reference(rope):
    x, weight, cos, sin = _inputs((2, 5, 2, 96), rope=rope)
    eps = torch.finfo(torch.float32).eps
    assert torch.equal(rms_norm_rope(x, weight, cos, sin), rms_norm_rope_ref(x, weight, cos, sin, eps))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda x, w, c, s: rms_norm_rope(x.int(), w, c, s), "expected x bfloat16, float16 or float32"),
        (lambda x, w, c, s: rms_norm_rope(x[..., :95], w, c, s), r"expected x \[B, N, H, D\] with D even"),
        (lambda x, w, c, s: rms_norm_rope(x.transpose(1, 2), w, c[:2], s[:2]), "expected a contiguous x"),
        (lambda x, w, c, s: rms_norm_rope(x, w[:64], c, s), r"expected weight \(96,\)"),
        (lambda x, w, c, s: rms_norm_rope(x, w, c, None), "cos and sin both given or both None"),
        (lambda x, w, c, s: rms_norm_rope(x, w, c[:4], s[:4]), r"expected cos fp32 contiguous \(5, 48\)"),
        (lambda x, w, c, s: rms_norm_rope(x, w, c.double(), s), r"expected cos fp32 contiguous"),
    ],
)
def test_errors_say_expected_and_found(call, message):
    x, weight, cos, sin = _inputs((2, 5, 2, 96))
    with pytest.raises(ValueError, match=message):
        call(x, weight, cos, sin)


def test_custom_op_passes_opcheck_and_compiles_without_graph_breaks():
    x, weight, cos, sin = _inputs((1, 7, 3, 128))
    torch.library.opcheck(torch.ops.k6fast.rms_norm_rope.default, (x, weight, cos, sin, 1e-6))
    torch.library.opcheck(torch.ops.k6fast.rms_norm_rope.default, (x, weight, None, None, 1e-6))
    compiled = torch.compile(lambda x: rms_norm_rope(x, weight, cos, sin) * 2, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), rms_norm_rope(x, weight, cos, sin) * 2)


def test_backends_route_norm_rope(monkeypatch):
    x, weight, cos, sin = _inputs((1, 7, 3, 128))
    expected = rms_norm_rope_ref(x, weight, cos, sin)
    assert torch.equal(ExactBackend().norm_rope(x, weight, (cos, sin)), expected)
    cpu = torch.device("cpu")
    plain = SwitchedBackend(Options(), cpu)
    fused = SwitchedBackend(Options().replace(fused_elementwise=True), cpu)
    assert torch.equal(fused.norm_rope(x, weight, (cos, sin)), expected)  # on CPU tensors: the reference
    # Where the fused kernels apply (CUDA tensors; pretended here), the fused backend calls the kernel, with the rope
    # tables or with none; the plain backend never does.
    calls = []
    monkeypatch.setattr(qk_norm_rope, "rms_norm_rope", lambda *args, **kw: calls.append(args) or args[0])
    monkeypatch.setattr(SwitchedBackend, "fused_for", lambda self, t: self.fused)
    assert fused.norm_rope(x, weight, (cos, sin)) is x and fused.norm_rope(x, weight, None) is x
    assert [tuple(a is b for a, b in zip(c, (x, weight, cos, sin), strict=True)) for c in calls[:1]] == [(True,) * 4]
    assert calls[1][2] is None and calls[1][3] is None
    assert torch.equal(plain.norm_rope(x, weight, (cos, sin)), expected) and len(calls) == 2


# ---------------------------------------------------------------------------------------------------------------
# Interpreter
# ---------------------------------------------------------------------------------------------------------------


test_triton_kernel_under_interpreter = interpreter_suite(__file__)


@pytest.mark.interpret
@needs_interpreter
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rope", [True, False])
def test_kernel_interpreted_fp32(shape, rope):
    x, weight, cos, sin = _inputs(shape, dtype=torch.float32, rope=rope)
    got = rms_norm_rope_triton(x, weight, cos, sin, 1e-6)
    torch.testing.assert_close(got, rms_norm_rope_ref(x, weight, cos, sin, 1e-6), rtol=2e-6, atol=2e-6)


@pytest.mark.interpret
@needs_interpreter
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_interpreted_bf16(shape):
    x, weight, cos, sin = _inputs(shape)
    eps = torch.finfo(torch.float32).eps
    got = rms_norm_rope_triton(x, weight, cos, sin, eps).float()
    expected = rms_norm_rope_ref(x, weight, cos, sin, eps).float()
    # Two roundings to bf16 (after the norm, after the rotation), truncating under the interpreter: about two units
    # in the last place of values of order one (normalised rows); a wrong pair, token or scale is off by O(1).
    assert ((got - expected).abs() <= 2.0**-6 * (expected.abs() + 1.0)).all()
    assert rel_l2(got, expected) < 1e-2


# ---------------------------------------------------------------------------------------------------------------
# GPU: W1 and audio shapes, bf16, against fp32 maths (the flash-attention rule: no worse than 2x the reference's
# own error plus a rounding floor); most elements bit-identical to the reference.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("shape", "rope"), [((1, 50220, 32, 128), True), ((1, 218, 16, 128), True),
                                             ((1, 50220, 32, 128), False), ((2, 37, 3, 96), True)])  # fmt: skip
def test_kernel_gpu(shape, rope):
    x, weight, cos, sin = _inputs(shape, device="cuda", rope=rope)
    eps = torch.finfo(torch.float32).eps
    got = rms_norm_rope(x, weight, cos, sin)
    reference = rms_norm_rope_ref(x, weight, cos, sin, eps)
    truth = _truth(x, weight, cos, sin, eps)
    assert_within_baseline_error(got, reference, truth, metric="rel_l2", atol=1e-6, what=f"{shape} rope={rope}")
    assert (got != reference).float().mean().item() < 0.02, "differs from the reference beyond last-bit rounding"
