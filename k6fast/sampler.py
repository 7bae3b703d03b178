"""The denoising loop: PiFlow for distilled checkpoints, flow-matching Euler with CFG for base ones.

The step maths are diffusers' schedulers (`PiflowScheduler`, `FlowMatchEulerDiscreteScheduler`), one instance per
modality so video and audio keep their own step counters, as in the reference pipeline. The loop around them is
k6fast's: image tail-frame conditioning, CFG, the step caches (PiFlow's fixed steps, MagCache's decision from the
predictions' magnitude ratios: `step_cache.py`), progress, cancellation and step timing.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from .cancel import Cancelled, check_stop
from .request import check_stop_after
from .step_cache import MagCache
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
    skipped_steps: list[int] = field(default_factory=list)
    # With `measure_ratios`: per series (`video.cond`, ...), gamma_i = mean |v_i| / |v_(i-1)| over tokens and the mean
    # cosine distance of the same pair, index 0 = (1.0, 0.0); what a MagCache calibration records.
    ratios: dict[str, list[float]] = field(default_factory=dict)
    cosine: dict[str, list[float]] = field(default_factory=dict)


class RatioMeter:
    """Measures each called step's predictions against the previous called step's, per series: the magnitude ratio
    mean |v_now| / |v_before| over tokens (MagCache's signal) and, with `cosine`, the mean cosine distance (the law's
    premise that directions barely change; it keeps whole predictions, not only their norms)."""

    def __init__(self, cosine: bool):
        self.cosine = cosine
        self.previous: dict[str, Tensor] = {}  # series → [tokens, C] fp32 predictions (cosine) or [tokens] norms
        self.step = -1  # the step `previous` came from

    def measure(self, step: int, predictions: dict[str, Tensor]) -> dict[str, tuple[float, float]]:
        """predictions: series → [B, ..., C]; returns series → (ratio, cosine distance or 0.0) against the previous
        call, or {} at the first."""
        tokens = {name: p.float().flatten(0, -2) for name, p in predictions.items()}  # [tokens, C]
        norms = {name: t.norm(dim=-1) for name, t in tokens.items()}
        out: dict[str, tuple[float, float]] = {}
        if self.previous:
            stats = []
            for name, now in tokens.items():
                before = self.previous[name]
                before_norms = before.norm(dim=-1) if self.cosine else before
                ratio = (norms[name] / before_norms.clamp_min(1e-12)).mean()
                cos = (
                    (1 - F.cosine_similarity(now, before, dim=-1, eps=1e-8)).mean()
                    if self.cosine
                    else ratio.new_zeros(())
                )
                stats.append(torch.stack([ratio, cos]))
            values = torch.stack(stats).tolist()  # one device sync for every series
            out = {name: (ratio, cos) for name, (ratio, cos) in zip(tokens, values, strict=True)}
        self.previous = tokens if self.cosine else norms
        self.step = step
        return out


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
    magcache: MagCache | None = None,
    measure_ratios: bool = False,
    on_step: Callable[[StepEvent], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    stop_after: int | None = None,
) -> SampleResult:
    """Run the schedule. latents: [B, T, H, W, C] noise; audio_latents: [B, L, Ca] noise or None (no audio);
    first_frame: [B, H, W, C] clean reference-frame latent or None. CFG runs when `guidance > 1` (needs `uncond`).
    A step in `cache_steps`, or one `magcache` skips, reuses the last called step's prediction (both CFG branches);
    `measure_ratios` records every series' magnitude ratios (a calibration run: give it no cache). `stop_after`: run
    only the schedule's first steps (a measurement of a long schedule's per-step cost); the latents are those steps'."""
    validate_cache_steps(cache_steps, num_steps)
    check_stop_after(stop_after, num_steps)
    if stop_after is not None and measure_ratios:
        raise ValueError("measuring the magnitude ratios (a calibration) needs every step to run: do not stop early")
    if magcache is not None and (cache_steps or magcache.num_steps != num_steps):
        raise ValueError(
            f"a MagCache for {magcache.num_steps} steps runs alone on its schedule, found {num_steps} steps"
        )
    if measure_ratios and (cache_steps or magcache is not None):
        raise ValueError("measuring the magnitude ratios (a calibration) needs every step to run: give it no cache")
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
    meter = RatioMeter(cosine=measure_ratios) if measure_ratios or magcache is not None else None
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

        called = i not in cache_steps and (magcache is None or magcache.call(i))
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
                branches = {"cond": prediction}
                if do_cfg:
                    negative = dit(
                        encoder_hidden_states=uncond.embeds,
                        pooled_projections=uncond.pooled,
                        encoder_attention_mask=uncond.mask,
                        **common,
                    )
                    result.dit_calls += 1
                    branches["uncond"] = negative
                    prediction = tuple(
                        None if c is None else n + guidance * (c - n) for c, n in zip(prediction, negative, strict=True)
                    )
            except Cancelled as exc:  # a DiT that checks between its blocks (K6DiT.should_stop): add the step
                raise Cancelled("denoise", f"step {i + 1} of {num_steps}, {exc.where}") from None
            if meter is not None:
                since = meter.step
                measured = meter.measure(i, _series(branches, first_frame is not None))
                if measure_ratios:
                    _append_ratios(result, i, measured)
                elif measured:
                    magcache.observe(i, since, {name: ratio for name, (ratio, _) in measured.items()})
        else:
            result.skipped_steps.append(i)
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
        if stop_after is not None and i + 1 == stop_after:
            break

    result.video = latents[:, :-1] if first_frame is not None else latents
    result.audio = audio_latents
    return result


def _series(branches: dict[str, tuple[Tensor, Tensor | None]], tail_frame: bool) -> dict[str, Tensor]:
    """The prediction series of one step (`video.cond`, `audio.uncond`, ...). The image tail frame's prediction is left
    out: that frame is reset to the clean latent before every call, so nothing uses it."""
    out = {}
    for branch, (video, audio) in branches.items():
        out[f"video.{branch}"] = video[:, :-1] if tail_frame else video
        if audio is not None:
            out[f"audio.{branch}"] = audio
    return out


def _append_ratios(result: SampleResult, step: int, measured: dict[str, tuple[float, float]]) -> None:
    """A calibration run: every step runs, so step i's ratio is against step i - 1 (step 0's is 1.0 by definition)."""
    if step == 0:
        return
    for name, (ratio, cos) in measured.items():
        result.ratios.setdefault(name, [1.0]).append(ratio)
        result.cosine.setdefault(name, [0.0]).append(cos)
