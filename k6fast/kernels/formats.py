"""The e4m3 number format every FP8 kernel quantizes to, defined once from PyTorch's own dtype table.

`E4M3_MAX` is float8_e4m3fn's largest finite magnitude: the range row-wise FP8 scales map each row's absmax to, the
bound NVFP4's block scales must fit and the quantized attention's P and V scale. `E4M3_VALUES` holds every finite
e4m3 value, built once at import, so that an argument check is a set lookup rather than a device round trip.
"""

from __future__ import annotations

import math

import torch

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)

E4M3_VALUES = frozenset(
    v for v in torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist() if math.isfinite(v)
)
