"""Exact (erf) GELU as an op that torch.compile leaves alone: the DiT feed-forward's activation.

Under torch.compile, Inductor generates its own kernel for `F.gelu`. At W1 (a 50,220 x 16,384 bf16 activation, 1.65 GB
read and 1.65 GB written) on an H200 that kernel takes 1.170 ms where ATen's takes 1.050 ms called from a compiled
graph (measurements/sessions/2026-11-29_block-fusions/elementwise.json); inside the compiled Pro block ATen's took
1.20 ms. A Triton kernel written for this pass took 1.28 ms in the block and differed from `F.gelu` by more than one
bf16 ulp where erf saturates (its libdevice erff and ATen's differ in the last fp32 bit at times, which 1 + erf
magnifies; `triton_gelu_*` files of that record), so the fused path wraps ATen's kernel in a custom op, which Inductor
calls as it is. The result is `F.gelu`'s, bit for bit, on every device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@torch.library.custom_op("k6fast::gelu", mutates_args=())
def _gelu_op(x: Tensor) -> Tensor:
    return F.gelu(x)


@_gelu_op.register_fake
def _(x: Tensor) -> Tensor:
    return torch.empty_like(x)


def gelu_ref(x: Tensor) -> Tensor:
    """`F.gelu(x)`, exact erf form: x [...] bf16/fp16/fp32 → [...] x.dtype."""
    return F.gelu(x)


def gelu(x: Tensor) -> Tensor:
    """GELU, exact erf form, through ATen's kernel even under torch.compile. x: [...] bf16/fp16/fp32 → x.dtype."""
    if x.dtype not in _DTYPES:
        raise ValueError(f"gelu: expected x bfloat16, float16 or float32, found {x.dtype}")
    return _gelu_op(x)
