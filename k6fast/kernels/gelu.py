"""Exact (erf) GELU as an op that torch.compile leaves alone: the DiT feed-forward's activation.

Under torch.compile, Inductor generates its own kernel for `F.gelu`. At W1 (a 50,220 x 16,384 bf16 activation, 1.65 GB
read and 1.65 GB written) on an H200 that kernel is slower than ATen's called from a compiled graph, and a Triton
kernel written for this pass was slower in the block still and differed from `F.gelu` by more than one bf16 ulp where
erf saturates (its libdevice erff and ATen's differ in the last fp32 bit at times, which 1 + erf magnifies):
measurements/sessions/2026-11-29_block-fusions/README.md. So the fused path wraps ATen's kernel in a custom op, which
Inductor calls as it is. The result is `F.gelu`'s, bit for bit, on every device.
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
