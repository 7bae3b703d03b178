"""Checking what clients send: the create request's fields (read by body.py, its image by images.py), list
queries, variants. Every bad value is a 4xx whose message says what was expected and what was found (a client's own
value cut short, never anything of the server's); nothing is silently corrected.

Duration: frames = seconds x 24 + 1, and a frame count must be 4k+1, so seconds x 24 must be a multiple of 4
("5" -> 121 frames, "0.5" -> 13, "4" -> 97). `num_frames` may be given instead of (or consistently with) `seconds`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..cli_args import SEED_MAX
from ..request import Request, RequestError, validate_geometry
from .config import FPS, ServerConfig, fits, fmt_size, frames_for_seconds, seconds_for_frames
from .errors import ApiError, bad_param, shown
from .images import ImageUpload, reference_image
from .jobs import JobSpec

__all__ = [
    "CREATE_FIELDS",
    "Draft",
    "frames_for_seconds",
    "parse_create",
    "parse_list_query",
    "parse_variant",
    "resolve_spec",
]

CREATE_FIELDS = (
    "prompt",
    "model",
    "seconds",
    "size",
    "input_reference",
    "num_frames",
    "num_inference_steps",
    "guidance_scale",
    "seed",
    "negative_prompt",
    "sample_audio",
)
# The SDK flattens an ImageInputReferenceParam ({"image_url": ...} or {"file_id": ...}) into these form keys.
_REFERENCE_KEYS = ("input_reference[image_url]", "input_reference[file_id]")
MAX_PROMPT_CHARS = 10_000
LIST_DEFAULT_LIMIT = 20
_INT_RE = re.compile(r"\s*[+-]?[0-9]{1,30}\s*")
_SIZE_RE = re.compile(r"\s*([0-9]{1,6})\s*[xX]\s*([0-9]{1,6})\s*")


@dataclass(frozen=True)
class Draft:
    """A checked create request: its `Request` (steps and guidance None when left to the checkpoint's defaults,
    no image), the duration as the client gave it, and the input reference as sent (format and size checked from
    the header: see images.py)."""

    request: Request
    seconds: str
    image: ImageUpload | None


MAX_SECONDS_CHARS = 32


def _type_error(name: str, expected: str, value: Any) -> ApiError:
    return bad_param(name, f"{name} must be {expected}, found {shown(value)}", "invalid_type")


def _name(key: Any) -> str:
    """A parameter name a client sent, cut short for an error message."""
    return str(key)[:40]


def _text(fields: Mapping[str, Any], name: str) -> str | None:
    value = fields.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _type_error(name, "a string", value)
    if len(value) > MAX_PROMPT_CHARS:
        raise bad_param(name, f"{name} has {len(value)} characters; expected at most {MAX_PROMPT_CHARS}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate ("\ud800" in JSON): no text can hold it
        raise bad_param(name, f"{name} is not valid Unicode text (it holds a lone surrogate); expected text") from None
    return value


def _int(fields: Mapping[str, Any], name: str, low: int, high: int) -> int | None:
    value = fields.get(name)
    if value is None or value == "":
        return None
    if isinstance(value, str) and _INT_RE.fullmatch(value):
        number = int(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        raise _type_error(name, "an integer", value)
    if not low <= number <= high:
        raise bad_param(name, f"{name} must be in [{low}, {high}], found {number}")
    return number


def _float(fields: Mapping[str, Any], name: str) -> float | None:
    value = fields.get(name)
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise _type_error(name, "a number", value)
    try:
        number = float(value)
    except ValueError:
        raise _type_error(name, "a number", value) from None
    if not math.isfinite(number):
        raise bad_param(name, f"{name} must be a finite number, found {shown(value)}")
    return number


def _bool(fields: Mapping[str, Any], name: str, default: bool) -> bool:
    value = fields.get(name)
    if value is None or value == "":
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    raise _type_error(name, "a boolean (true or false)", value)


def _geometry_problem(width: int, height: int, frames: int) -> str | None:
    try:
        validate_geometry(width, height, frames)
    except RequestError as exc:
        return str(exc)
    return None


def parse_size(text: Any, config: ServerConfig) -> tuple[int, int]:
    if not isinstance(text, str):
        raise _type_error("size", "a string WIDTHxHEIGHT", text)
    match = _SIZE_RE.fullmatch(text)
    if not match:
        raise bad_param("size", f"size must be WIDTHxHEIGHT such as '864x480', found {shown(text)}")
    width, height = int(match[1]), int(match[2])
    problem = _geometry_problem(width, height, 1)
    if problem:
        raise bad_param("size", f"size {fmt_size((width, height))}: {problem}")
    if not fits((width, height), config.max_size):
        limit, portrait = config.max_size, (config.max_size[1], config.max_size[0])
        raise bad_param(
            "size",
            f"size {fmt_size((width, height))} exceeds this server's maximum of {fmt_size(limit)} "
            f"(or {fmt_size(portrait)})",
        )
    return width, height


def _frames(fields: Mapping[str, Any], config: ServerConfig) -> tuple[int, str]:
    seconds = fields.get("seconds")
    if isinstance(seconds, (int, float)) and not isinstance(seconds, bool):
        seconds = str(seconds)
    if seconds is not None and not isinstance(seconds, str):
        raise _type_error("seconds", "a string such as '5'", seconds)
    seconds = seconds.strip() if seconds else None
    if seconds is not None and len(seconds) > MAX_SECONDS_CHARS:
        raise bad_param("seconds", f"seconds has {len(seconds)} characters; expected a number such as '5'")
    num_frames = _int(fields, "num_frames", 1, 1_000_000)
    if num_frames is not None:
        problem = _geometry_problem(16, 16, num_frames)
        if problem:
            raise bad_param("num_frames", f"num_frames: {problem}")
    if seconds is not None:
        frames = frames_for_seconds(seconds)
        if num_frames is not None and num_frames != frames:
            raise bad_param(
                "num_frames",
                f"num_frames {num_frames} disagrees with seconds {seconds!r} ({frames} frames, as frames = "
                f"seconds x {FPS} + 1); give one of them, or both consistently",
            )
    elif num_frames is not None:
        frames, seconds = num_frames, seconds_for_frames(num_frames)
    else:
        seconds = config.default_seconds
        frames = frames_for_seconds(seconds)
    if frames > config.max_frames:
        raise bad_param(
            "num_frames" if fields.get("num_frames") is not None else "seconds",
            f"{frames} frames (seconds {seconds!r}) exceeds this server's maximum of {config.max_frames} frames "
            f"({seconds_for_frames(config.max_frames)} s)",
        )
    return frames, seconds


def parse_create(fields: Mapping[str, Any], config: ServerConfig, served_names: tuple[str, ...]) -> Draft:
    """Check every field of a create request; raises ApiError (400) naming the parameter."""
    unknown = sorted(_name(k) for k in fields if k not in CREATE_FIELDS and k not in _REFERENCE_KEYS)
    if unknown:
        raise bad_param(
            unknown[0],
            f"unknown parameter {unknown[0]!r}; expected some of {', '.join(CREATE_FIELDS)}",
            "unknown_parameter",
        )
    prompt = _text(fields, "prompt")
    if prompt is None:
        raise bad_param("prompt", "missing required parameter 'prompt'", "missing_required_parameter")
    if not prompt.strip():
        raise bad_param("prompt", "prompt is empty; expected a description of the video and its sound")
    model = _text(fields, "model")
    if model is not None and model not in served_names:
        raise bad_param(
            "model",
            f"model {model[:40]!r} is not served here; expected {served_names[0]!r} (or leave model out)",
            "model_not_found",
        )
    size = fields.get("size")
    # In a fixed order: of several bad parameters, the error names the first one checked.
    width, height = parse_size(fmt_size(config.default_size) if size is None or size == "" else size, config)
    frames, seconds = _frames(fields, config)
    seed = _int(fields, "seed", 0, SEED_MAX)
    # The API runs at the model's frame rate (it has no parameter for `fps`); the input reference is not part of the
    # request: the job keeps the upload's bytes until it starts (images.py).
    request = Request(
        prompt=prompt,
        width=width,
        height=height,
        frames=frames,
        # Drawn here, not at run time, so a job re-run after a restart makes the same clip.
        seed=secrets.randbelow(2**31) if seed is None else seed,
        negative_prompt=_text(fields, "negative_prompt") or None,
        steps=_int(fields, "num_inference_steps", 1, config.max_steps),
        guidance=_float(fields, "guidance_scale"),
        audio=_bool(fields, "sample_audio", True),
    )
    return Draft(request, seconds, reference_image(fields))


def parse_list_query(query: Mapping[str, str]) -> tuple[str | None, int, str]:
    """`after`, `limit` (1-100, default 20) and `order` (asc | desc, default desc) of GET /v1/videos."""
    unknown = sorted(_name(k) for k in set(query) - {"after", "limit", "order"})
    if unknown:
        raise bad_param(unknown[0], f"unknown query parameter {unknown[0]!r}; expected after, limit or order")
    limit = _int(query, "limit", 1, 100)
    order = query.get("order") or "desc"
    if order not in ("asc", "desc"):
        raise bad_param("order", f"order must be 'asc' or 'desc', found {shown(order)}")
    return query.get("after") or None, LIST_DEFAULT_LIMIT if limit is None else limit, order


def parse_variant(query: Mapping[str, str]) -> str:
    unknown = sorted(_name(k) for k in set(query) - {"variant"})
    if unknown:
        raise bad_param(unknown[0], f"unknown query parameter {unknown[0]!r}; expected variant")
    variant = query.get("variant") or "video"
    if variant not in ("video", "thumbnail"):
        raise bad_param(
            "variant", f"variant {shown(variant)} is not available from this server; expected 'video' or 'thumbnail'"
        )
    return variant


# Which request parameter a pipeline RequestError is about, by the word its message leads with.
_RESOLVE_PARAMS = (
    ("does not fit the VRAM budget", "size"),  # the request's geometry (`Pipeline.check_fits`)
    ("guidance", "guidance_scale"),
    ("image conditioning", "input_reference"),
    ("K6_PIFLOW_CACHE_STEPS", "num_inference_steps"),
    ("steps", "num_inference_steps"),
    ("prompt", "prompt"),
)


def resolve_spec(draft: Draft, pipeline: Any, max_steps: int) -> JobSpec:
    """Check the draft against the loaded checkpoint (`Pipeline.resolve`: distilled checkpoints need guidance 1.0,
    image conditioning needs support, cached steps must fit) and fill in its default steps and guidance."""
    # The pipeline checks only that an image is given (whether the checkpoint takes one): the header is enough.
    header = None if draft.image is None else draft.image.header_only()
    try:
        steps, guidance = pipeline.resolve(dataclasses.replace(draft.request, image=header))
    except RequestError as exc:
        message = str(exc)
        param = next((p for word, p in _RESOLVE_PARAMS if word in message), None)
        raise ApiError(400, message, param=param, code="invalid_value") from None
    finally:
        if header is not None:
            header.close()
    if steps > max_steps:
        raise bad_param(
            "num_inference_steps",
            f"the checkpoint's default of {steps} steps exceeds this server's maximum of {max_steps}; "
            "pass num_inference_steps",
        )
    resolved = dataclasses.replace(draft.request, steps=steps, guidance=guidance)
    return JobSpec(resolved, draft.seconds, image=draft.image is not None)
