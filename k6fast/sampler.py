"""The denoising loop: PiFlow for distilled checkpoints, flow-matching Euler with CFG for base ones.

The step maths are diffusers' schedulers (`PiflowScheduler`, `FlowMatchEulerDiscreteScheduler`), one instance per
modality so video and audio keep their own step counters, as in the reference pipeline. The loop around them is
k6fast's: image tail-frame conditioning, CFG, the PiFlow step cache, progress, cancellation and step timing.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .cancel import Cancelled, check_stop
from .switches import validate_cache_steps
from .text import TextConditioning

DiTFn = Callable[..., tuple[Tensor, Tensor | None]]


@dataclass(frozen=True)
class StepEvent:
    index: int  # 0-based step just finished
    total: int
    dit_called: bool
    seconds: float


@dataclass
class SampleResult:
    video: Tensor  # [B, T, H, W, C] latents (tail frame removed)
    audio: Tensor | None  # [B, L, C]
    dit_calls: int = 0
    step_seconds: list[float] = field(default_factory=list)


def image_conditioning(
    latents: Tensor, first_frame: Tensor, patch: tuple[int, int, int]
) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor, Tensor]]:
    """Append the clean reference-frame latent as an extra frame with token type 1 that reuses temporal RoPE
    position 0. latents: [B, T, H, W, C]; first_frame: [B, H, W, C] → (latents [B, T+1, ...], token types [B, T+1],
    per-axis RoPE positions)."""
    b, t, h, w, _ = latents.shape
    device = latents.device
    latents = torch.cat([latents, first_frame[:, None]], dim=1)
    token_types = torch.zeros((b, t + 1), dtype=torch.long, device=device)
    token_types[:, -1] = 1
    pt, ph, pw = patch
    positions = (
        torch.cat([torch.arange(t // pt, device=device), torch.zeros(1, dtype=torch.long, device=device)]),
        torch.arange(h // ph, device=device),
        torch.arange(w // pw, device=device),
    )
    return latents, token_types, positions


def sample(
    dit: DiTFn,
    scheduler,
    *,
    num_steps: int,
    guidance: float,
    cond: TextConditioning,
    uncond: TextConditioning | None,
    latents: Tensor,
    audio_latents: Tensor | None,
    first_frame: Tensor | None = None,
    visual_cond: bool = True,
    patch: tuple[int, int, int] = (1, 2, 2),
    cache_steps: tuple[int, ...] = (),
    on_step: Callable[[StepEvent], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> SampleResult:
    """Run the schedule. latents: [B, T, H, W, C] noise; audio_latents: [B, L, Ca] noise or None (no audio);
    first_frame: [B, H, W, C] clean reference-frame latent or None. CFG runs when `guidance > 1` (needs `uncond`)."""
    validate_cache_steps(cache_steps, num_steps)
    do_cfg = guidance > 1.0
    if do_cfg and uncond is None:
        raise ValueError(f"guidance {guidance} > 1 needs a negative prompt conditioning")
    scheduler = copy.deepcopy(scheduler)
    scheduler.set_timesteps(num_steps, device=latents.device)
    audio_scheduler = copy.deepcopy(scheduler) if audio_latents is not None else None
    timesteps = scheduler.timesteps
    if len(timesteps) != num_steps:
        raise ValueError(f"the scheduler produced {len(timesteps)} timesteps for {num_steps} steps")

    token_types = rope_pos = None
    if first_frame is not None:
        latents, token_types, rope_pos = image_conditioning(latents, first_frame, patch)

    result = SampleResult(video=latents, audio=audio_latents)
    prediction: tuple[Tensor, Tensor | None] | None = None
    batch = latents.shape[0]
    for i, t in enumerate(timesteps):
        check_stop(should_stop, "denoise", f"before step {i + 1} of {num_steps}")
        start = time.perf_counter()
        model_input = latents
        if visual_cond:
            # Channels: [latent | conditioning latent (always zero) | mask]; the reference frame itself rides as the
            # appended tail frame and is reset to the clean latent before every call.
            mask = torch.zeros((*latents.shape[:-1], 1), dtype=latents.dtype, device=latents.device)
            if first_frame is not None:
                latents[:, -1] = first_frame
                mask[:, -1] = 1
            model_input = torch.cat([latents, torch.zeros_like(latents), mask], dim=-1)

        called = i not in cache_steps
        if called and hasattr(dit, "begin_step"):
            dit.begin_step(i, num_steps)
        if called:
            timestep = t.expand(batch)
            common = dict(
                hidden_states=model_input,
                audio_hidden_states=audio_latents,
                timestep=timestep,
                visual_rope_pos=rope_pos,
                visual_token_type_ids=token_types,
            )
            try:
                prediction = dit(
                    encoder_hidden_states=cond.embeds,
                    pooled_projections=cond.pooled,
                    encoder_attention_mask=cond.mask,
                    **common,
                )
                result.dit_calls += 1
                if do_cfg:
                    negative = dit(
                        encoder_hidden_states=uncond.embeds,
                        pooled_projections=uncond.pooled,
                        encoder_attention_mask=uncond.mask,
                        **common,
                    )
                    result.dit_calls += 1
                    prediction = tuple(
                        None if c is None else n + guidance * (c - n) for c, n in zip(prediction, negative, strict=True)
                    )
            except Cancelled as exc:  # a DiT that checks between its blocks (K6DiT.should_stop): add the step
                raise Cancelled("denoise", f"step {i + 1} of {num_steps}, {exc.where}") from None
        # A cached step reuses `prediction` from the last called step (both CFG branches, combined).
        latents = scheduler.step(prediction[0], t, latents, return_dict=False)[0]
        if audio_latents is not None:
            audio_latents = audio_scheduler.step(prediction[1], t, audio_latents, return_dict=False)[0]
        if latents.is_cuda:
            torch.cuda.synchronize(latents.device)
        seconds = time.perf_counter() - start
        result.step_seconds.append(seconds)
        if on_step is not None:
            on_step(StepEvent(i, num_steps, called, seconds))

    result.video = latents[:, :-1] if first_frame is not None else latents
    result.audio = audio_latents
    return result
