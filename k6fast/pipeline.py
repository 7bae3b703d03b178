"""One request, top to bottom: text → denoise → audio decode → video decode. The pipeline owns which model holds
the device in each phase: the text encoders are loaded for the text phase and dropped before denoising.

`Pipeline.generate` returns frames and audio in memory, and hands them to a frame sink as they are decoded if given
one; writing the MP4 (with provenance) is `output.py`'s job (`generate_to_mp4` encodes while the video decodes).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from diffusers.utils.torch_utils import randn_tensor

from .allocator import device_budget, held_after_release, resolve_device
from .cancel import StopCheck, check_stop
from .checkpoint import Checkpoint, open_checkpoint
from .dit_load import DiTAhead, build_planned_dit, compute_dtype, dit_build_args
from .fit import oversize_message, vram_budget
from .frame_sink import FrameSink
from .memory import GiB
from .prompt_cache import PromptCache
from .request import (
    W1,
    Request,
    RequestError,
    check_stop_after,
    dit_tokens,
    resolve_request,
)
from .sampler import StepEvent, sample
from .step_cache import StepCacheError, plan_run
from .stream.plan import ResidencyError
from .stream.runtime import DiTRuntime
from .switches import Options
from .telemetry import Telemetry
from .text import DEFAULT_NEGATIVE_PROMPT
from .text_phase import TextAhead, TextPhase
from .vae import decode_audio, decode_video, encode_image, load_audio_decoder, load_video_vae
from .vae_geometry import AudioRate, audio_length, audio_rate, latent_frames, latent_size
from .video_decode import VideoDecodePlan, decode_video_fast, plan_video_decode
from .video_decode.plan import exact_decode_fits


@dataclass
class Result:
    frames: np.ndarray  # float32 [F, H, W, 3] in [0, 1]
    audio: np.ndarray | None  # float32 [N] mono, raw decoder output (not normalised)
    sample_rate: int
    fps: float
    steps: int
    guidance: float
    telemetry: Telemetry
    # The denoised latents before decoding, on the CPU: video [1, T, H, W, C], audio [1, L, C] or absent. What the
    # acceptance run compares between arms (the whole chain's numerical cost, before the decoders).
    latents: dict[str, torch.Tensor] = field(default_factory=dict)


def negative_prompt(request: Request, guidance: float) -> str | None:
    """The negative prompt a request is encoded with: the user's or the default one under CFG, none without."""
    return (request.negative_prompt or DEFAULT_NEGATIVE_PROMPT) if guidance > 1.0 else None


class Pipeline:
    """Loads a checkpoint once and serves requests. The DiT, the decoders and the text phase (its weights streamed
    through the device per new prompt, its results cached) stay loaded."""

    def __init__(
        self,
        model: str | Path | Checkpoint,
        options: Options,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        plan_geometry: tuple[int, int, int] = W1,
        prompt_cache_dir: str | Path | None = None,
        first_request: Request | None = None,
        dit_ahead: DiTAhead | None = None,
    ):
        """plan_geometry: the request the DiT's resident blocks are planned for (a larger one streams more of them
        for its own run; one the budget cannot fit is refused by `resolve`). prompt_cache_dir: where encoded prompts
        are kept across processes (None: in memory only). first_request: the request the caller runs first (the
        CLI's): its prompt is encoded on a thread while the DiT and the decoders load. dit_ahead: the DiT's build for
        these same arguments, already started (the CLI's, beside its imports): taken instead of a build here, and
        closed if the pipeline fails. Nothing here changes the process: an entry point caps the allocator at the
        budget and sets the compile caches first (`k6fast.entry.prepare_pipeline_process`)."""
        self._ahead: TextAhead | None = None
        self._dit_ahead = dit_ahead
        try:
            self._set_up(model, options, device, dtype, plan_geometry, prompt_cache_dir, first_request)
        except BaseException:
            self.settle_text()  # its thread must not run on while the caller handles the error
            if self._dit_ahead is not None:
                self._dit_ahead.close()
                self._dit_ahead = None
            raise

    def _set_up(self, model, options, device, dtype, plan_geometry, prompt_cache_dir, first_request) -> None:
        self.ckpt = model if isinstance(model, Checkpoint) else open_checkpoint(model)
        self.options = options
        self.device = resolve_device(device)
        self.dtype = compute_dtype(self.device, dtype)
        ahead = self._dit_ahead
        if ahead is not None and not ahead.matches(self.ckpt, options, self.device, self.dtype, plan_geometry):
            raise ValueError("dit_ahead was started for another checkpoint, options, device, dtype or plan geometry")
        self.load_seconds = 0.0
        # Of `load_seconds`, those the DiT's build ran beside the caller's work before this pipeline (`dit_ahead`).
        self.load_overlapped_s = 0.0
        telemetry = Telemetry(device=str(self.device))
        # With `dit_ahead`, the budget it read before its build took any of the card.
        budget = ahead.budget_bytes if ahead is not None else device_budget(self.device, options.vram_budget_gb)
        self.budget_bytes = budget
        self.kept_mapped = False  # the last free_budget counted the allocator's memory without giving it back
        self.audio_rate = audio_rate(self.ckpt.root)  # what requests are planned and their audio latents drawn for
        # The text phase never evicts the DiT: its layers stream through the room the denoising activations take
        # later, which the residency plan keeps free for the larger of the two.
        self.load_parts: dict[str, float] = {}  # seconds per part of the load: `k6fast generate`'s start-up profile
        started = time.perf_counter()
        self.text = TextPhase(self.ckpt.root, self.device, self.dtype, cache=PromptCache(directory=prompt_cache_dir))
        self.load_parts["text_setup"] = time.perf_counter() - started
        if ahead is None:
            tokens = dit_tokens(*plan_geometry, self.audio_rate)
            self._dit_args = dit_build_args(options, self.device, budget_bytes=self.budget_bytes, tokens=tokens,
                                            text_bytes=self.text.device_bytes())  # fmt: skip
        elif ahead.args["text_bytes"] != self.text.device_bytes():  # `text_device_bytes` is the same arithmetic
            raise RuntimeError(f"the DiT was planned for a text phase of {ahead.args['text_bytes']} bytes on the "
                               f"device; the text phase takes {self.text.device_bytes()}")  # fmt: skip
        else:
            self._dit_args = ahead.args  # one dict: a fallback to the smallest request's tokens holds for reloads
        self.runtime: DiTRuntime | None = None
        self._host_tier = None  # the DiT's host tier while the DiT is off the device (`drop_dit`)
        self.runtime_plan = None
        if first_request is not None:  # beside the load: the text phase's room is free until the first denoise
            _, guidance = resolve_request(self.ckpt, options, first_request)
            self._ahead = TextAhead(self.text, first_request.prompt, negative_prompt(first_request, guidance))
        self._load(telemetry)
        self.load_seconds = telemetry.phases["load"] + self.load_overlapped_s

    def _load(self, telemetry: Telemetry) -> None:
        """The DiT (its residency plan and resident blocks), the decoders and the scheduler."""
        with telemetry.phase("load"):
            self._load_dit()
            self.load_parts.update(self.runtime.load_s)
            started = time.perf_counter()
            self.vae = load_video_vae(self.ckpt.root, self.device, self.dtype)
            self.audio_vae, self.vocoder = load_audio_decoder(self.ckpt.root, self.device, self.dtype)
            loaded = AudioRate(int(self.audio_vae.config.sample_rate), int(self.audio_vae.latent_hop_length))
            if loaded != self.audio_rate:  # the plan read the config; the loaded VAE must run at the same rate
                raise ValueError(f"the audio VAE runs at {loaded}; its config reads as {self.audio_rate}")
            self._decoder_bytes = sum(  # what stays on the device whatever else leaves it
                t.numel() * t.element_size()
                for module in (self.vae, self.audio_vae, self.vocoder)
                for t in (*module.parameters(), *module.buffers())
            )
            self.scheduler = self._load_scheduler()
            self.load_parts["decoders"] = time.perf_counter() - started  # and the scheduler

    def _load_scheduler(self):
        from diffusers import FlowMatchEulerDiscreteScheduler, PiflowScheduler

        cls = PiflowScheduler if self.ckpt.distilled else FlowMatchEulerDiscreteScheduler
        return cls.from_pretrained(self.ckpt.root / "scheduler")

    def _load_dit(self) -> None:
        if self.runtime is None:
            ahead, self._dit_ahead = self._dit_ahead, None
            if ahead is not None:
                self.runtime, self.load_overlapped_s = ahead.take()
            else:
                self.runtime = build_planned_dit(self.ckpt, self.device, self.dtype, self._dit_args, self.audio_rate,
                                                 self._host_tier)  # fmt: skip
            self._host_tier = None  # the runtime's now
            self.dit = self.runtime.dit
            self.runtime_plan = self.runtime.plan  # kept when the DiT leaves the device (the plan does not change)
            self._dit_planner = self.runtime.planner

    def fits(self, width: int, height: int, frames: int) -> bool:
        """Whether a request of this geometry fits the VRAM budget: the DiT with every block streamed if need be,
        and (K6_VIDEO_DECODE=exact) the whole-clip decode beside the decoders. Arithmetic only."""
        return self.dit_fits(width, height, frames) and self._exact_decode_fits(width, height, frames)

    def dit_fits(self, width: int, height: int, frames: int) -> bool:
        """Whether the DiT alone fits this geometry (every block streamed if need be). Arithmetic only."""
        try:
            self._dit_planner(dit_tokens(width, height, frames, self.audio_rate))
        except ResidencyError:
            return False
        return True

    def _exact_decode_fits(self, width: int, height: int, frames: int) -> bool:
        """Whether the decode of this geometry would be exact (`plan_video_decode(...).exact`), from the whole-clip
        decode's estimate alone: a fit table asks this thousands of times."""
        if self.options.video_decode != "exact":
            return True
        shape = (latent_frames(frames), *latent_size(height, width))
        try:
            return exact_decode_fits(
                self.vae, shape, budget_bytes=self.budget_bytes - self._decoder_bytes, dtype=self.dtype
            )
        except ValueError:
            return False

    def check_fits(self, request: Request) -> None:
        """Refuse, before any work, a request that cannot fit this pipeline's budget, naming what fits instead."""
        if not self.fits(request.width, request.height, request.frames):
            w, h, f = request.width, request.height, request.frames
            budget = vram_budget([self.budget_bytes])
            raise RequestError(oversize_message(self.fits, w, h, f, budget, dit_fits=self.dit_fits))

    def drop_dit(self, release: bool = True) -> None:
        """Send the DiT off the device (its runtime closed); the next request reloads it. release: give its memory
        back to the driver now; the video decode keeps it mapped and reuses it (`free_budget`)."""
        if self.runtime is not None:
            self._host_tier = self.runtime.take_host_tier()  # host memory: the next load serves from it again
            self.runtime.close()
            self.runtime = self.dit = None
            if release and self.device.type == "cuda":
                torch.cuda.empty_cache()

    def free_budget(self) -> int:
        """What the budget leaves on the device now: the budget less what the caching allocator would still hold
        after `empty_cache` (the budget caps what it reserves, and free room inside a partly used segment is not there
        for a new large tensor), counted without giving the rest back where that can be relied on
        (`allocator.held_after_release`)."""
        if self.device.type != "cuda":
            return self.budget_bytes
        held = held_after_release(self.device)
        self.kept_mapped = held is not None  # the sidecar's video_decode says which (a first decode's seconds differ)
        if held is None:
            torch.cuda.empty_cache()
            held = torch.cuda.memory_reserved(self.device)
        return max(0, self.budget_bytes - held)

    def plan_decode(self, shape: tuple[int, int, int]) -> VideoDecodePlan | None:
        """The decode's plan inside what the budget leaves now; None where not even a streamed decode fits."""
        try:
            return plan_video_decode(self.vae, shape, budget_bytes=self.free_budget())
        except ValueError:
            return None

    def decode_video_latents(
        self,
        latents: torch.Tensor,
        telemetry: Telemetry,
        should_stop: StopCheck | None = None,
        on_frames: Callable[[int, int, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """latents [1, T, H, W, C] → frames [1, F, 8H, 8W, 3] in [0, 1], by K6_VIDEO_DECODE (see the switch).
        `should_stop` is checked between the decode's ops (diffusers' tiled decode runs whole). `on_frames(f0, f1,
        frames [f1 - f0, 8H, 8W, 3])` is handed the frames as they are final (`decode_video_fast`; all at the end
        for the tiled decode)."""
        mode = self.options.video_decode
        if mode == "tiled":
            telemetry.video_decode = "tiled (diffusers)"
            frames = decode_video(self.vae, latents, tiled=True)
            if on_frames is not None:
                on_frames(0, frames.shape[1], frames[0])
            return frames
        shape = tuple(latents.shape[1:4])
        plan = self.plan_decode(shape)
        # What the decode may send away when it needs the room: the DiT's resident blocks (the next request reloads
        # them, its "dit_load" phase), then text encoders kept resident. `exact` needs the whole clip (most of a 32 GB
        # card at W1); `streamed` only needs something to fit.
        dropped = plan is None or not (plan.exact or mode == "streamed")
        if dropped:
            self.drop_dit(release=False)  # its memory stays mapped for the decode (`free_budget`)
            plan = self.plan_decode(shape)
        if plan is None or (mode == "exact" and not plan.exact):
            free = self.free_budget() / GiB
            raise RequestError(
                f"the {'exact ' if mode == 'exact' else ''}video decode of {shape[0]}x{shape[1]}x{shape[2]} latents "
                f"does not fit the {free:.1f} GiB the VRAM budget leaves with the DiT off the "
                "device; expected a larger K6_VRAM_BUDGET_GB, a smaller geometry, or K6_VIDEO_DECODE=streamed "
                "(slabs with running GroupNorm statistics) or tiled"
            )
        cuda = latents.is_cuda
        telemetry.video_decode = plan.describe(peak=cuda)
        if dropped and cuda:
            kept = "kept mapped for it" if self.kept_mapped else "given back first (empty_cache)"
            telemetry.video_decode += f"; the DiT's memory {kept}"
        # Channels-last activations and the fused GroupNorm+SiLU kernel: the fastest variant measured on an H200
        # (measurements/sessions/2026-11-29_vae-decode); plain PyTorch on the CPU.
        return decode_video_fast(
            self.vae,
            latents,
            plan=plan,
            layout="ndhwc" if cuda else "ncdhw",
            triton_norm=cuda,
            should_stop=should_stop,
            on_frames=on_frames,
        )

    def settle_text(self) -> None:
        """Wait for an encode started at load that no request took (the caller is ending: an error, or close)."""
        if self._ahead is not None:
            self._ahead.wait()
            self._ahead = None

    def close(self) -> None:
        self.settle_text()
        self.drop_dit()
        if self._host_tier is not None:
            self._host_tier.close()
            self._host_tier = None
        self.text.close()

    @property
    def sample_rate(self) -> int:
        return self.audio_rate.sample_rate

    def resolve(self, request: Request) -> tuple[int, float]:
        """Validate the request against the checkpoint and this pipeline's budget; returns (steps, guidance)."""
        resolved = resolve_request(self.ckpt, self.options, request)
        self.check_fits(request)
        return resolved

    @torch.no_grad()
    def generate(
        self,
        request: Request,
        on_step: Callable[[StepEvent], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        initial_noise: tuple[torch.Tensor, torch.Tensor | None] | None = None,
        frame_sink: FrameSink | None = None,
        stop_after_steps: int | None = None,
    ) -> Result:
        """Run one request. `initial_noise` (video [1,T,H,W,C], audio [1,L,C]) replaces the seeded draw (tests).
        `stop_after_steps`: denoise only the schedule's first steps, then decode what they leave (a measurement of a
        long schedule's per-step cost, e.g. the 50-step base checkpoints'; not a finished clip).
        `should_stop` (k6fast.cancel) is checked before every phase, before every denoising step, between the DiT's
        fused blocks and between the video decode's ops; `Cancelled` says where it stopped. `frame_sink` (output.py's
        MP4 sink) is handed the audio, then the frames as the video decode finishes them."""
        steps, guidance = self.resolve(request)
        try:
            step_cache = plan_run(self.ckpt, self.options, steps, guidance, request.audio)
        except StepCacheError as exc:  # `resolve` checked it, but a calibration file can go, or not be writable
            raise RequestError(str(exc)) from None
        check_stop_after(stop_after_steps, steps)
        if stop_after_steps is not None and step_cache.measure:
            raise RequestError("a step-cache calibration needs every step to run: it cannot stop early")
        cfg, device, dtype = self.ckpt.dit, self.device, self.dtype
        telemetry = Telemetry(device=str(device))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        # Noise comes from a CPU generator so that a seed gives the same clip on every device; the draw order
        # (image posterior, video, audio) is the reference pipeline's.
        generator = torch.Generator("cpu").manual_seed(request.seed)

        check_stop(should_stop, "text_encode", "before the text encoders")
        with telemetry.phase("text_encode"):  # with an encode started at load: the wait for it
            negative = negative_prompt(request, guidance)
            ahead, self._ahead = self._ahead, None
            encoded, stats = ahead.take(request.prompt, negative) if ahead is not None else (None, None)
            if encoded is None:
                encoded, stats = self.text.encode_with_stats(request.prompt, negative)
            else:
                telemetry.text_ahead_s = stats.seconds
            cond, uncond = encoded
        telemetry.text_source, telemetry.text_bytes_streamed = stats.source, stats.bytes_streamed

        if self.runtime is None:
            check_stop(should_stop, "dit_load", "before loading the DiT")
            with telemetry.phase("dit_load"):
                self._load_dit()
        # This request's own residency: a larger geometry than the base streams more blocks (and a later smaller
        # one brings them back); the time it takes is the request's "dit_fit" phase.
        tokens = dit_tokens(request.width, request.height, request.frames, self.audio_rate)
        if self.runtime.plan_for(tokens) != self.runtime.plan:
            resident = self.runtime.plan.resident_blocks
            with telemetry.phase("dit_fit"):
                self.runtime.fit(tokens)
            telemetry.dit_blocks_uploaded += max(0, self.runtime.plan.resident_blocks - resident)

        first_frame = None
        if request.image is not None:
            check_stop(should_stop, "image_encode", "before the image encode")
            with telemetry.phase("image_encode"):
                first_frame = encode_image(self.vae, request.image, request.height, request.width, generator, dtype)

        t = latent_frames(request.frames)
        shape = (1, t, *latent_size(request.height, request.width), cfg.in_visual_dim)
        audio_len = audio_length(t, request.fps, self.audio_rate)
        if initial_noise is not None:
            latents = initial_noise[0].to(device=device, dtype=dtype)
            audio_latents = initial_noise[1].to(device=device, dtype=dtype) if request.audio else None
        else:
            latents = randn_tensor(shape, generator=generator, device=device, dtype=dtype)
            audio_latents = None
            if request.audio:
                audio_shape = (1, audio_len, cfg.in_audio_dim)
                audio_latents = randn_tensor(audio_shape, generator=generator, device=device, dtype=dtype)

        def step_hook(event: StepEvent) -> None:
            if self.runtime.streamer is not None:
                telemetry.add_stream_step(self.runtime.streamer.collect_timings())
            telemetry.step_seconds.append(event.seconds)
            telemetry.step_called.append(event.dit_called)
            telemetry.cached_steps += not event.dit_called
            if on_step is not None:
                on_step(event)

        self.dit.should_stop = should_stop
        try:
            with telemetry.phase("denoise"):
                out = sample(
                    self.dit,
                    self.scheduler,
                    num_steps=steps,
                    guidance=guidance,
                    cond=cond,
                    uncond=uncond,
                    latents=latents,
                    audio_latents=audio_latents,
                    first_frame=first_frame,
                    visual_cond=cfg.visual_cond,
                    patch=cfg.patch_size,
                    cache_steps=step_cache.fixed,
                    magcache=step_cache.magcache,
                    measure_ratios=step_cache.measure,
                    on_step=step_hook,
                    should_stop=should_stop,
                    stop_after=stop_after_steps,
                )
        finally:
            if self.dit is not None:
                self.dit.should_stop = None
        telemetry.dit_calls = out.dit_calls
        if stop_after_steps is not None:
            telemetry.stopped_after_steps = (stop_after_steps, steps)
        geometry = (request.width, request.height, request.frames)
        telemetry.step_cache = step_cache.finish(out.ratios, out.cosine, geometry, guidance)
        denoised = {"video": out.video.cpu()}  # before the decoders run (a few MB)
        if out.audio is not None:
            denoised["audio"] = out.audio.cpu()

        # The audio first: a frame sink muxes each frame with the audio up to its end, so it needs the whole waveform
        # before the first frame (and the audio decode is small next to the video's).
        audio = None
        if out.audio is not None:
            check_stop(should_stop, "audio_decode", "before the audio decode")
            with telemetry.phase("audio_decode"):
                audio = decode_audio(self.audio_vae, self.vocoder, out.audio)[0].cpu().numpy()
        check_stop(should_stop, "video_decode", "before the video decode")
        on_frames = None
        if frame_sink is not None:
            frame_sink.begin(request.frames, request.height, request.width, request.fps, audio, self.sample_rate)
            on_frames = frame_sink.frames
        with telemetry.phase("video_decode"):
            frames = self.decode_video_latents(out.video, telemetry, should_stop, on_frames)[0].cpu().numpy()
        return Result(frames, audio, self.sample_rate, request.fps, steps, guidance, telemetry, denoised)
