"""What the `auto` GEMM and attention choices resolve to on a device, and why (the `final` arm uses them, so one arm
file serves every card).

- GEMMs: FP16-accumulate only on GeForce cards (sm_80 and newer), where FP16-accumulate MMA runs at twice the
  FP32-accumulate rate; on datacenter cards it has no rate advantage (0.6x cuBLAS on an H200,
  measurements/sessions/2026-11-29_h200-followup), so cuBLAS bf16 stays.
- Attention: k6fast's quantized kernel only on GeForce Ada/Blackwell (sm_89, sm_120: FP8 P·V), where quantized
  attention was 2.5x cuDNN for the best peer; on the H200 it only matches cuDNN (1.03x,
  measurements/sessions/2026-11-29_kernels), so attention stays exact there. Neither GeForce gain is measured here.
"""

from __future__ import annotations

import torch


def is_geforce(device: torch.device) -> bool:
    return device.type == "cuda" and "GeForce" in torch.cuda.get_device_name(device)


def auto_gemm(device: torch.device) -> str:
    return "fp16acc" if is_geforce(device) and torch.cuda.get_device_capability(device) >= (8, 0) else "bf16"


def auto_attn(device: torch.device) -> str:
    return "k6" if is_geforce(device) and torch.cuda.get_device_capability(device) >= (8, 9) else "exact"


def resolve_auto(options, device: torch.device):
    """Options with `auto` GEMM and attention choices replaced by what they mean on `device`."""
    changes = {}
    if options.gemm == "auto":
        changes["gemm"] = auto_gemm(device)
    if options.attn == "auto":
        changes["attn"] = auto_attn(device)
    return options.replace(**changes) if changes else options
