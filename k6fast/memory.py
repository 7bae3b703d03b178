"""One memory budget: every reserve k6fast keeps inside the VRAM budget, decided here and nowhere else.

The budget (K6_VRAM_BUDGET_GB, or the card's free memory) caps PyTorch's caching allocator. Inside it:
- what CUDA adds outside the allocator once work starts (cuBLAS/cuDNN handles, kernel images of Triton and
  flash-attn-4): taken off the card's free memory when the budget is chosen (`allocator.device_budget`);
- the residency planner's reserve beside the DiT's weights and activations: the allocator's rounding and the
  workspaces of the DiT phase (`stream.plan`);
- the video decode's reserve and workspace inside the room it is given (`video_decode.plan`);
- the text phase's peak, planned beside the DiT's weights while the activation room is free (`text_plan`).

Plain arithmetic, no PyTorch: `k6fast doctor` plans with the same figures as the runtime.
"""

from __future__ import annotations

GiB = 2**30

# What CUDA adds outside PyTorch's caching allocator. The full-size acceptance run saw nvidia-smi's use exceed the
# allocator's reserved peak by the CUDA context plus this much (measurements/sessions/2026-12-01_acceptance-full).
OUTSIDE_ALLOCATOR_BYTES = GiB // 2

# Beside the DiT's weights and activations: the allocator's rounding, cuBLAS/cuDNN workspaces.
PLANNER_RESERVE_BYTES = 2 * GiB

# The video decode keeps this share of its room for cuDNN's workspace and the allocator's rounding, within bounds:
# workspaces and rounding do not grow with the budget (an unbudgeted CPU run has 2^62 B).
DECODE_RESERVE_FRACTION = 0.08
DECODE_RESERVE_MIN_BYTES = 256 << 20
DECODE_RESERVE_MAX_BYTES = 4 << 30


def decode_reserve(room_bytes: int) -> int:
    """What the video decode leaves unplanned inside `room_bytes`."""
    return min(DECODE_RESERVE_MAX_BYTES, max(DECODE_RESERVE_MIN_BYTES, int(room_bytes * DECODE_RESERVE_FRACTION)))


def decode_workspace(room_bytes: int) -> int:
    """The cuDNN workspace one decode convolution is assumed to take inside `room_bytes`."""
    return max(64 << 20, min(1 << 30, room_bytes // 16))
