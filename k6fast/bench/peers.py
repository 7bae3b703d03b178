"""Peer arms: diffusers' own Kandinsky 6 code, timed in the same session, on the same checkpoint, geometry, seed,
steps and guidance as the k6fast arms.

- `diffusers`: `Kandinsky6TI2VAPipeline` with every component resident on the device.
- `diffusers-offload`: the transformer under diffusers' group offloading (`enable_group_offload(onload_device,
  offload_device="cpu", offload_type="block_level", num_blocks_per_group=1, use_stream=True)`, each block copied in
  on a side stream one block ahead); the text encoders live on the CPU and are moved to the device for the text
  phase only (what `enable_model_cpu_offload` would do for them); the decoders stay resident (small).

Both enable the video VAE's tiling: diffusers' untiled W1 decode needs ~80 GB for its attention mask alone, so
tiling is how diffusers users run it (k6fast's own exact decode is `K6_VIDEO_DECODE=exact`, its default). For
`--component dit|block` a peer times `Kandinsky6Transformer3DModel` alone (loaded with `from_pretrained`), fed the
same synthetic tensors as the k6fast arm.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .runner import VisitSpec, peak_vram, reset_peak, sync, time_call
from .workload import audio_tokens, block_inputs, dit_inputs

if TYPE_CHECKING:  # PyTorch loads with the peer's model: `k6fast bench` checks its arguments without it
    import torch

PEER_ARMS = ("diffusers", "diffusers-offload")
GROUP_OFFLOAD = {"offload_type": "block_level", "num_blocks_per_group": 1, "use_stream": True}


def is_peer(arm: str) -> bool:
    return arm in PEER_ARMS


def peer_runner(spec: VisitSpec):
    if not is_peer(spec.arm):
        raise ValueError(f"arm {spec.arm!r} is not a peer arm; expected one of {', '.join(PEER_ARMS)}")
    offload = spec.arm == "diffusers-offload"
    device = spec.resolved_device()
    if offload and device.type != "cuda":
        raise ValueError(
            f"the diffusers-offload arm streams blocks with CUDA streams and needs a CUDA device, found {device}"
        )
    cls = {"pipeline": PeerPipeline, "dit": PeerTransformer, "block": PeerBlock}[spec.component]
    return cls(spec, offload)


def _quiet_diffusers() -> None:
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.set_verbosity_error()  # unexpected-key warnings of the one-block load
    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()


def peer_budget_gb(spec: VisitSpec) -> float:
    """The session's K6_VRAM_BUDGET_GB (0 = the whole card): the one switch that also binds a peer."""
    from ..switches import SWITCHES_BY_NAME

    raw = spec.switches.get("K6_VRAM_BUDGET_GB")
    return float(SWITCHES_BY_NAME["K6_VRAM_BUDGET_GB"].parse(raw)) if raw is not None else 0.0


class _Peer:
    def __init__(self, spec: VisitSpec, offload: bool):
        from ..checkpoint import open_checkpoint

        self.spec, self.offload = spec, offload
        self.device, self.dtype = spec.resolved_device(), spec.resolved_dtype()
        self.ckpt = open_checkpoint(spec.model)
        self.budget_gb = peer_budget_gb(spec)  # the visit caps the allocator at it (k6fast.bench.visit)
        _quiet_diffusers()

    def _place(self, model: torch.nn.Module) -> None:
        import torch

        if self.offload:
            model.enable_group_offload(onload_device=self.device, offload_device=torch.device("cpu"), **GROUP_OFFLOAD)
        else:
            model.to(self.device)

    def describe(self) -> dict[str, Any]:
        import diffusers

        from .. import __version__
        from ..switches.provenance import git_state

        commit, dirty = git_state()
        return {
            "k6fast_version": __version__,
            "git_commit": commit,
            "git_dirty": dirty,
            "arm": self.spec.arm,
            "arm_hash": None,
            "switches": None,
            "peer": {
                "library": "diffusers",
                "version": diffusers.__version__,
                "group_offload": dict(GROUP_OFFLOAD, offload_device="cpu") if self.offload else None,
                "text_encoders": "cpu, moved to the device for the text phase" if self.offload else "resident",
                "vae_tiling": self.spec.component == "pipeline",
                "vram_budget_gb": self.budget_gb or None,
            },
        }


class PeerTransformer(_Peer):
    """`Kandinsky6Transformer3DModel.from_pretrained(ckpt/transformer)`: one forward per request."""

    def load(self) -> None:
        from diffusers import Kandinsky6Transformer3DModel

        self.model = Kandinsky6Transformer3DModel.from_pretrained(
            Path(self.ckpt.root) / "transformer", dtype=self.dtype
        ).eval()
        self._place(self.model)
        audio_len = audio_tokens(self.ckpt.root, self.spec.geometry)
        self.inputs = dit_inputs(self.ckpt.dit, self.spec.geometry, audio_len, self.device, self.dtype, self.spec.seed)

    def run(self) -> dict[str, Any]:
        return time_call(self.device, "dit_forward", lambda: self.model(**self.inputs, return_dict=False))


class PeerBlock(_Peer):
    """`visual_transformer_blocks[0]` of a transformer loaded with one fused block (the others are not read)."""

    def load(self) -> None:
        import torch
        from diffusers import Kandinsky6Transformer3DModel

        model = Kandinsky6Transformer3DModel.from_pretrained(
            Path(self.ckpt.root) / "transformer", dtype=self.dtype, num_visual_blocks=1
        ).eval()
        self._place(model)
        self.model = model
        geometry, cfg = self.spec.geometry, self.ckpt.dit
        audio_len = audio_tokens(self.ckpt.root, geometry)
        inp = block_inputs(cfg, geometry, audio_len, self.device, self.dtype, self.spec.seed)
        with torch.no_grad():
            grid = geometry.token_grid(cfg.patch_size)
            positions = tuple(torch.arange(n, device=self.device) for n in grid)
            # diffusers' rope layout differs from k6fast's; its own modules build it.
            visual_rope = model.visual_rope_embeddings(positions, model.scale_factor).flatten(0, 2)
            audio_rope = model.audio_rope_embeddings(torch.arange(audio_len, device=self.device))
        s = inp.shared
        temb = (s.temb_v.to(self.dtype), s.temb_a.to(self.dtype))
        self.args = (inp.vis, inp.aud, s.text_v, s.text_a, temb, visual_rope, audio_rope, None)

    def run(self) -> dict[str, Any]:
        return time_call(self.device, "block", lambda: self.model.visual_transformer_blocks[0](*self.args))


class PhaseClock:
    """Times the phases inside diffusers' pipeline call by wrapping the methods it calls; per-step times come from
    `callback_on_step_end`."""

    def __init__(self, device: torch.device, stop_after: int | None = None):
        from ..telemetry import Telemetry

        self.device, self.stop_after = device, stop_after
        # Denoising runs between the wrapped phases: the request's peak is read once at its end (see `run`).
        self.telemetry = Telemetry(device=str(device), per_phase_peaks=False)
        self.mark = 0.0

    def wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            with self.telemetry.phase(phase):
                result = fn(*args, **kwargs)
            if phase == "text_encode":
                self.mark = time.perf_counter()  # the first step is timed from here
            return result

        return timed

    def on_step(self, pipe, step: int, timestep, callback_kwargs: dict) -> dict:
        sync(self.device)
        now = time.perf_counter()
        self.telemetry.step_seconds.append(now - self.mark)
        # One line a step on stderr: a run killed at its timeout still leaves its step times in the record's tail.
        print(f"peer: step {len(self.telemetry.step_seconds)} in {now - self.mark:.2f} s", file=sys.stderr, flush=True)
        self.mark = now
        if self.stop_after is not None and len(self.telemetry.step_seconds) == self.stop_after:
            pipe._interrupt = True  # diffusers' own stop: the loop skips the remaining steps, then decodes
        return {}


class PeerPipeline(_Peer):
    """`Kandinsky6TI2VAPipeline`, text to MP4 (muxed by k6fast's writer, so both sides pay the same mux)."""

    def load(self) -> None:
        import tempfile

        from diffusers import Kandinsky6TI2VAPipeline

        pipe = Kandinsky6TI2VAPipeline.from_pretrained(self.ckpt.root, dtype=self.dtype)
        pipe.set_progress_bar_config(disable=True)
        pipe.vae.enable_tiling()
        if self.offload:
            self._place(pipe.transformer)
            for name in ("vae", "audio_vae", "vocoder"):
                getattr(pipe, name).to(self.device)
            encode = pipe.encode_prompt

            def encode_on_device(*args, **kwargs):
                pipe.text_encoder.to(self.device)
                pipe.text_encoder_2.to(self.device)
                try:
                    return encode(*args, **kwargs)
                finally:
                    pipe.text_encoder.to("cpu")
                    pipe.text_encoder_2.to("cpu")

            pipe.encode_prompt = encode_on_device
        else:
            pipe.to(self.device)
        self.clock = PhaseClock(self.device)
        pipe.encode_prompt = self._wrap("text_encode", pipe.encode_prompt)
        pipe.vae.decode = self._wrap("video_decode", pipe.vae.decode)
        pipe.audio_vae.decode = self._wrap("audio_decode", pipe.audio_vae.decode)
        pipe.vocoder.forward = self._wrap("audio_decode", pipe.vocoder.forward)
        self.pipe = pipe
        self._tmp = tempfile.TemporaryDirectory(prefix="k6fast-bench-peer-")
        self._count = 0

    def _wrap(self, phase: str, fn):
        # Looked up per call: each request gets a fresh clock.
        def timed(*args, **kwargs):
            return self.clock.wrap(phase, fn)(*args, **kwargs)

        return timed

    def run(self) -> dict[str, Any]:
        import torch

        spec = self.spec
        self.clock = clock = PhaseClock(self.device, spec.stop_after_steps)
        reset_peak(self.device)
        start = time.perf_counter()
        out = self.pipe(
            prompt=spec.prompt,
            height=spec.height,
            width=spec.width,
            num_frames=spec.frames,
            num_inference_steps=spec.steps,
            guidance_scale=spec.guidance,
            # A CPU generator draws the same noise as k6fast's for the same seed.
            generator=torch.Generator("cpu").manual_seed(spec.seed),
            output_type="np",
            callback_on_step_end=clock.on_step,
        )
        telemetry = clock.telemetry
        telemetry.phases["denoise"] = sum(telemetry.step_seconds)
        steps_run = spec.stop_after_steps or spec.steps
        telemetry.dit_calls = steps_run * (2 if spec.guidance > 1.0 else 1)
        if spec.stop_after_steps:
            telemetry.stopped_after_steps = (spec.stop_after_steps, spec.steps)
        if spec.mux:
            from ..media import prepare_audio, write_mp4
            from ..output import frames_to_uint8

            self._count += 1
            path = Path(self._tmp.name) / f"request{self._count}.mp4"
            with telemetry.phase("mux"):
                audio = None if out.audio is None else prepare_audio(out.audio[0].astype("float32"))
                frames = frames_to_uint8(out.frames[0])
                write_mp4(path, frames, 24.0, audio, int(self.pipe.audio_sample_rate))
        sync(self.device)
        seconds = time.perf_counter() - start
        peaks = peak_vram(self.device)
        telemetry.peak_vram_bytes, telemetry.peak_vram_reserved_bytes = peaks["allocated"], peaks["reserved"]
        return {"seconds": seconds, "telemetry": telemetry.as_dict()}
