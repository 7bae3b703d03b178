"""k6fast/kernels/groupnorm_silu.py: GroupNorm from given statistics + SiLU into a strided destination.

CPU tests of the reference against PyTorch's GroupNorm + SiLU and of the public op's CPU path; `interpret` tests of
the Triton kernel at small odd shapes (a subprocess with TRITON_INTERPRET=1, so the setting never leaks into this
process), in both layouts, into a window of a padded buffer; `gpu` tests at a W1 slab's shape.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import interpreter_suite, needs_cuda, needs_interpreter

from k6fast.kernels.groupnorm_silu import groupnorm_silu, groupnorm_silu_ref, groupnorm_silu_triton

# [B, C, T, H, W], groups: one frame, odd sizes, W not a power of two, two samples.
SHAPES = [((1, 8, 1, 3, 5), 4), ((1, 12, 3, 5, 7), 3), ((2, 16, 2, 4, 9), 8), ((1, 32, 2, 3, 33), 32)]
LAYOUTS = {"ncdhw": torch.contiguous_format, "ndhwc": torch.channels_last_3d}


def _case(shape, groups, dtype=torch.bfloat16, fmt=torch.contiguous_format, device="cpu", seed=0):
    """x with a non-zero mean and uneven channels, and the (scale, shift) of GroupNorm with random affine."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    b, c = shape[:2]
    x = (torch.randn(shape, generator=g) * torch.linspace(0.5, 4.0, c).view(1, c, 1, 1, 1) + 1.5).to(device)
    weight, bias = torch.randn(c, generator=g).to(device), torch.randn(c, generator=g).to(device)
    x = x.to(dtype).contiguous(memory_format=fmt)
    var, mean = torch.var_mean(x.float().unflatten(1, (groups, c // groups)), dim=(2, 3, 4, 5), correction=0)
    rstd = (var + 1e-6).rsqrt().repeat_interleave(c // groups, dim=1)
    scale = (weight * rstd).contiguous()
    shift = (bias - mean.repeat_interleave(c // groups, dim=1) * scale).contiguous()
    return x, weight, bias, scale, shift


def _padded_window(shape, dtype, fmt, device="cpu"):
    """A [B, C, T+2, H+2, W+2] buffer and its interior window: where the decoder writes a convolution's input."""
    b, c, t, h, w = shape
    buf = torch.full((b, c, t + 2, h + 2, w + 2), float("nan"), dtype=dtype, device=device)
    buf = buf.contiguous(memory_format=fmt)
    return buf, buf[:, :, 2:, 1 : h + 1, 1 : w + 1]


@pytest.mark.parametrize(("shape", "groups"), SHAPES)
def test_ref_is_group_norm_then_silu(shape, groups):
    x, weight, bias, scale, shift = _case(shape, groups, dtype=torch.float32)
    expected = F.silu(F.group_norm(x, groups, weight, bias, eps=1e-6))
    out = groupnorm_silu_ref(x, scale, shift, torch.empty_like(x))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    plain = groupnorm_silu_ref(x, scale, shift, torch.empty_like(x), act=False)
    torch.testing.assert_close(plain, F.group_norm(x, groups, weight, bias, eps=1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_public_op_writes_only_its_window_on_cpu(layout):
    shape, groups = SHAPES[1]
    x, _, _, scale, shift = _case(shape, groups, fmt=LAYOUTS[layout])
    buf, window = _padded_window(shape, torch.bfloat16, LAYOUTS[layout])
    assert groupnorm_silu(x, scale, shift, window) is window
    torch.testing.assert_close(window, groupnorm_silu_ref(x, scale, shift, torch.empty_like(x)), rtol=0, atol=0)
    window.fill_(0)
    assert buf.isnan().sum().item() == buf.numel() - x.numel()


def test_invalid_inputs_say_what_was_expected():
    x, _, _, scale, shift = _case(SHAPES[0][0], SHAPES[0][1])
    with pytest.raises(ValueError, match=r"expected scale contiguous fp32 \[1, 8\]"):
        groupnorm_silu(x, scale.double(), shift, torch.empty_like(x))
    with pytest.raises(ValueError, match=r"expected x and out \[B, C, T, H, W\] alike"):
        groupnorm_silu(x, scale, shift, torch.empty_like(x)[:, :, :, :, :2])
    with pytest.raises(ValueError, match="expected x and out unit-stride along W or C"):
        groupnorm_silu_triton(x, scale, shift, torch.empty_like(x).transpose(3, 4).contiguous().transpose(3, 4))


# ---------------------------------------------------------------------------------------------------------------
# Interpreter: the kernel at small shapes. The interpreter does not round fp32 → bf16 to nearest, so bf16 outputs
# are checked to one unit in the last place (fp32 outputs tightly).
# ---------------------------------------------------------------------------------------------------------------


def _assert_bf16_within_one_ulp(actual, expected):
    a, e = actual.float(), expected.float()
    _, exponent = torch.frexp(torch.maximum(a.abs(), e.abs()))
    ulp = torch.ldexp(torch.ones_like(a), exponent - 8).clamp_min(2.0**-133)
    excess = (a - e).abs() - ulp
    assert excess.max() <= 0, f"{(excess > 0).sum().item()} of {a.numel()} elements differ by more than one ulp"


test_triton_kernel_under_interpreter = interpreter_suite(__file__)


@pytest.mark.interpret
@needs_interpreter
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("shape", "groups"), SHAPES)
@pytest.mark.parametrize("act", [True, False])
def test_kernel_interpreted(shape, groups, layout, act):
    fmt = LAYOUTS[layout]
    for dtype in (torch.bfloat16, torch.float32):
        x, _, _, scale, shift = _case(shape, groups, dtype=dtype, fmt=fmt)
        buf, window = _padded_window(shape, dtype, fmt)
        groupnorm_silu_triton(x, scale, shift, window, act=act)
        expected = groupnorm_silu_ref(x, scale, shift, torch.empty_like(x), act=act)
        if dtype == torch.float32:
            torch.testing.assert_close(window, expected, rtol=1e-6, atol=1e-6)
        else:
            _assert_bf16_within_one_ulp(window, expected)
        window.fill_(0)
        assert buf.isnan().sum().item() == buf.numel() - x.numel(), "wrote outside its window"


# ---------------------------------------------------------------------------------------------------------------
# GPU: a W1 slab (256 channels, 4 frames of 480x864 at the last up block), both layouts, into a padded window.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_at_w1_slab_on_gpu(layout):
    shape, fmt = (1, 256, 4, 480, 864), LAYOUTS[layout]
    x, _, _, scale, shift = _case(shape, 32, fmt=fmt, device="cuda")
    buf, window = _padded_window(shape, torch.bfloat16, fmt, device="cuda")
    groupnorm_silu(x, scale, shift, window)
    expected = groupnorm_silu_ref(x, scale, shift, torch.empty_like(x))
    # Both round an fp32 value once to bf16; the sigmoid differs from PyTorch's silu by fp32 rounding only.
    torch.testing.assert_close(window.float(), expected.float(), rtol=2**-7, atol=1e-6)
