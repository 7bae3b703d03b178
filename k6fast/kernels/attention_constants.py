"""Constants shared by the attention kernels (the quantized attention's prologue, its Triton and Gluon cores) and the
launch-device guard they all use.

The softmax bit tricks (`MAGIC_I`, `MAGIC_F`, `LOG2_FP8_MAX`) are `tl.constexpr` so that Triton and Gluon kernels can
read them as globals.
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton.language as tl

from .formats import E4M3_MAX

Q_BLOCK = 128  # query rows per Q scale
K_BLOCK = 64  # default key rows per K scale (QuantAttentionConfig.block_n, QuantizedQKV.k_block). The K scale block
# is also the kernel's key tile and its online-softmax update granularity, so quantization and kernel must agree.
K_BLOCKS = (64, 128)
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)

LOG2E = 1.4426950408889634
FP8_MAX = E4M3_MAX  # what P and V are scaled to for the FP8 P·V: e4m3's whole range
# FP16-accumulate P·V (GeForce): each 32-key chunk's P·V is one FP8 MMA (m16n8k32) summed into an FP16 accumulator,
# so V is quantized to ±2.25 instead of ±FP8_MAX: a chunk's partial sums stay within 32 · FP8_MAX · 2.25 = 32,256 <
# 65,504 (P·FP8_MAX <= FP8_MAX after the saturating e4m3 conversion), whatever the data. SageAttention2++ (arXiv
# 2505.21136) bound.
PV_CHUNK = 32
V_FP16_ACC_MAX = 2.25

# An int32 x with |x| < 2**22 plus the bits of 1.5 * 2**23 is the fp32 1.5 * 2**23 + x exactly. This replaces the
# int32 -> fp32 conversion (I2F runs at 16/clk/SM on sm_90, as slow as exp2) by an integer add. |Q·Kᵀ| <= 127² · 128
# = 2,064,512 < 2**22.
MAGIC_I = tl.constexpr(0x4B400000)
MAGIC_F = tl.constexpr(12582912.0)
LOG2_FP8_MAX = tl.constexpr(math.log2(FP8_MAX))


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device, which need not be the tensors': make it theirs."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
