"""What a request is and whether it can run: the geometry rules, the `Request` itself and its check against a
checkpoint and the switches. No PyTorch: the command line and the server check requests with it before any model
code loads.

`Request` is the one request type from every entry point to the pipeline, and every conversion of it lives here: to
and from JSON (the server's job store, the Ray messages, the clip's sidecar, the bench's visit spec), from
`k6fast generate`'s arguments (`request_from_args`) and from the server's checked create body
(`request_from_create`). tests/test_request_roundtrip.py sends a request with every field set through each of them,
so a field added to `Request` and not to a conversion fails there."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from .step_cache import check_request as check_step_cache
from .step_cache import fixed_cache_steps
from .switches import Options, validate_cache_steps
from .vae_geometry import MMAUDIO, SPATIAL_STRIDE, TEMPORAL_STRIDE, AudioRate, audio_length, latent_frames

if TYPE_CHECKING:
    import argparse

    import PIL.Image

    from .checkpoint import Checkpoint

W1 = (864, 480, 121)  # width, height, frames: the headline workload
FPS = 24.0
SPATIAL_MULTIPLE = 2 * SPATIAL_STRIDE  # the video VAE's stride x the DiT's spatial patch


class RequestError(ValueError):
    """The request cannot run as asked; the message says what was expected."""


def _nearest_multiples(value: int, multiple: int) -> str:
    low = max(multiple, value // multiple * multiple)
    high = low + multiple
    return f"{low} or {high}" if low != value else str(value)


def check_stop_after(stop_after: int | None, steps: int) -> None:
    """A measurement that denoises only a schedule's first `stop_after` steps (None: the whole schedule) must stop
    inside the schedule of `steps` steps."""
    if stop_after is not None and not 1 <= stop_after <= steps:
        raise RequestError(f"stop after {stop_after} steps: expected 1..{steps} for a {steps}-step request")


def validate_geometry(width: int, height: int, frames: int) -> None:
    """Sizes must be multiples of 16 and frame counts 4k+1; the error gives the nearest valid values."""
    problems = []
    for name, value in (("width", width), ("height", height)):
        if value < SPATIAL_MULTIPLE or value % SPATIAL_MULTIPLE:
            problems.append(
                f"{name} {value} is not a positive multiple of {SPATIAL_MULTIPLE} "
                f"(nearest valid: {_nearest_multiples(value, SPATIAL_MULTIPLE)})"
            )
    if frames < 1 or (frames - 1) % TEMPORAL_STRIDE:
        low = max(1, (frames - 1) // TEMPORAL_STRIDE * TEMPORAL_STRIDE + 1)
        problems.append(f"frame count {frames} is not of the form 4k+1 (nearest valid: {low} or {low + 4})")
    if problems:
        raise RequestError("; ".join(problems))


@dataclass(frozen=True)
class Request:
    prompt: str
    width: int = W1[0]
    height: int = W1[1]
    frames: int = W1[2]
    steps: int | None = None  # None = the checkpoint's default
    guidance: float | None = None
    seed: int = 42
    negative_prompt: str | None = None
    image: PIL.Image.Image | None = field(default=None, compare=False)
    audio: bool = True
    fps: float = FPS

    def to_dict(self) -> dict[str, Any]:
        """Every field as a JSON value; `image` as whether there is one (its pixels travel apart: an uploaded file
        in the server's store, bytes in a Ray message)."""
        raw = {f.name: getattr(self, f.name) for f in fields(self)}
        raw["image"] = self.image is not None
        return raw

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], image: PIL.Image.Image | None = None) -> Request:
        """The inverse of `to_dict`, given the image when `raw` says there was one. A field missing from `raw`
        takes its default (a record written before the field existed); an unknown key is refused, so a record
        from a newer k6fast is not run as something else."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(str(key)[:40] for key in raw if key not in names)
        if unknown:
            raise ValueError(f"unknown request field(s) {', '.join(unknown)}; expected some of {', '.join(names)}")
        if bool(raw.get("image", False)) != (image is not None):
            had = "had an image and none was given" if image is None else "had no image and one was given"
            raise ValueError(f"the request {had}")
        return cls(**{**raw, "image": image})


def video_tokens(width: int, height: int, frames: int, image: bool) -> int:
    """The DiT's video tokens of a geometry, with the image's tail frame where the request has an image."""
    return (latent_frames(frames) + image) * (height // SPATIAL_MULTIPLE) * (width // SPATIAL_MULTIPLE)


def dit_tokens(width: int, height: int, frames: int, audio: AudioRate = MMAUDIO) -> tuple[int, int]:
    """(video, audio) DiT tokens of a geometry, counting the image tail frame: what the residency planner reserves
    activations for (the runtime and `k6fast doctor` alike). audio: the checkpoint's audio rate
    (`vae_geometry.audio_rate`, what the pipeline draws its audio latents for)."""
    return video_tokens(width, height, frames, image=True), audio_length(latent_frames(frames), FPS, audio)


def resolve_request(ckpt: Checkpoint, options: Options, request: Request) -> tuple[int, float]:
    """Validate `request` against a checkpoint and the switches; returns (steps, guidance). Needs only the
    checkpoint's configs, so a server can check requests where no pipeline is loaded."""
    validate_geometry(request.width, request.height, request.frames)
    if not request.prompt or not request.prompt.strip():
        raise RequestError("the prompt is empty; expected a description of the video and its sound")
    steps = request.steps if request.steps is not None else ckpt.default_steps
    guidance = request.guidance if request.guidance is not None else ckpt.default_guidance
    if steps < 1:
        raise RequestError(f"steps must be >= 1, found {steps}")
    if ckpt.distilled and guidance != 1.0:
        raise RequestError(
            f"guidance {guidance} is not allowed with a distilled (PiFlow) checkpoint: it was distilled "
            "without classifier-free guidance, so guidance must be exactly 1.0"
        )
    if guidance < 1.0:
        raise RequestError(f"guidance must be >= 1.0 (1.0 = no CFG), found {guidance}")
    if request.image is not None and (not ckpt.dit.visual_cond or ckpt.dit.visual_token_type_num_embeddings < 2):
        raise RequestError("this checkpoint has no image conditioning (visual_cond / token types missing)")
    try:
        validate_cache_steps(fixed_cache_steps(ckpt, options), steps)
        check_step_cache(ckpt, options, steps, guidance, request.audio)
    except ValueError as exc:
        raise RequestError(str(exc)) from exc
    return steps, guidance


def request_from_args(args: argparse.Namespace, image: PIL.Image.Image | None = None) -> Request:
    """The request of `k6fast generate`'s arguments (cli.py), `image` being `--image` opened. The clip runs at the
    model's frame rate: the command has no option for `fps`."""
    width, height = args.size
    return Request(
        prompt=args.prompt,
        width=width,
        height=height,
        frames=args.frames,
        steps=args.steps,
        guidance=args.guidance,
        seed=args.seed,
        negative_prompt=args.negative_prompt,
        image=image,
        audio=not args.no_audio,
    )
