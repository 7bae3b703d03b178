"""Reading and checking what clients send: the create form (as the OpenAI SDK sends it), list queries, variants.

`POST /v1/videos` takes multipart/form-data (what the SDK sends, `extra_body` fields flattened into the form,
booleans as "true"/"false"), application/x-www-form-urlencoded or application/json. Every bad value is a 4xx whose
message says what was expected and what was found; nothing is silently corrected.

Duration: frames = seconds x 24 + 1, and a frame count must be 4k+1, so seconds x 24 must be a multiple of 4
("5" -> 121 frames, "0.5" -> 13, "4" -> 97). `num_frames` may be given instead of (or consistently with) `seconds`.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import re
import secrets
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .config import FPS, ServerConfig, fits, fmt_size, seconds_for_frames
from .errors import ApiError, bad_param
from .jobs import JobSpec

if TYPE_CHECKING:
    import PIL.Image
    from starlette.requests import Request as HttpRequest

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
MAX_IMAGE_PIXELS = 40_000_000  # decoded size guard; the pipeline resizes to the video size anyway
FORM_OVERHEAD_BYTES = 1 << 20  # text fields and multipart framing on top of the image upload
MAX_FORM_FIELDS = 32
SEED_MAX = 2**63 - 1
LIST_DEFAULT_LIMIT = 20
_INT_RE = re.compile(r"\s*[+-]?[0-9]+\s*")
_SIZE_RE = re.compile(r"\s*([0-9]{1,6})\s*[xX]\s*([0-9]{1,6})\s*")
# Accept a seconds value whose x24 is this close to a whole frame count, so "0.333" means 9 frames.
_SECONDS_TOLERANCE = 0.015


@dataclass(frozen=True)
class Upload:
    filename: str | None
    content_type: str | None
    data: bytes


@dataclass(frozen=True)
class Draft:
    """A checked create request; steps and guidance are None when left to the checkpoint's defaults."""

    prompt: str
    negative_prompt: str | None
    width: int
    height: int
    frames: int
    seconds: str
    steps: int | None
    guidance: float | None
    seed: int
    audio: bool
    image: PIL.Image.Image | None


async def _limited(stream: AsyncIterator[bytes], limit: int) -> AsyncIterator[bytes]:
    total = 0
    async for chunk in stream:
        total += len(chunk)
        if total > limit:
            raise ApiError(
                413,
                f"the request body exceeds {limit} bytes; expected an image of at most "
                f"{limit - FORM_OVERHEAD_BYTES} bytes plus form fields",
                code="request_too_large",
            )
        yield chunk


async def read_fields(request: HttpRequest, max_upload_bytes: int) -> dict[str, Any]:
    """The create request's fields by name: strings (forms) or JSON values, an `Upload` for a file part."""
    from starlette.formparsers import FormParser, MultiPartException, MultiPartParser

    limit = max_upload_bytes + FORM_OVERHEAD_BYTES
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(
            413, f"the request body is {declared} bytes; expected at most {limit} bytes", code="request_too_large"
        )
    content_type = request.headers.get("content-type", "")
    media = content_type.split(";", 1)[0].strip().lower()
    body = _limited(request.stream(), limit)
    if media == "application/json":
        raw = b"".join([chunk async for chunk in body])
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(
                400, f"the body is not valid JSON ({exc}); expected a JSON object", code="invalid_json"
            ) from None
        if not isinstance(data, dict):
            raise ApiError(400, f"expected a JSON object, found {type(data).__name__}", code="invalid_json")
        return data
    if media == "multipart/form-data":
        parser = MultiPartParser(
            request.headers, body, max_files=2, max_fields=MAX_FORM_FIELDS, max_part_size=FORM_OVERHEAD_BYTES
        )
    elif media == "application/x-www-form-urlencoded":
        parser = FormParser(request.headers, body)
    else:
        raise ApiError(
            415,
            f"unsupported content type {content_type or '(none)'!r}; expected multipart/form-data (as the OpenAI "
            "SDK sends), application/x-www-form-urlencoded or application/json",
            code="unsupported_media_type",
        )
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        raise ApiError(400, f"malformed form body: {exc.message}", code="invalid_multipart") from None
    except ApiError:
        raise
    except Exception as exc:  # python-multipart's parse errors have several types; all mean a broken body
        raise ApiError(400, f"malformed form body: {exc}", code="invalid_multipart") from None
    fields: dict[str, Any] = {}
    try:
        for key, value in form.multi_items():
            if key in fields:
                raise bad_param(key, f"parameter {key!r} is given more than once; expected it once", "duplicate")
            if isinstance(value, str):
                fields[key] = value
                continue
            data = await value.read()
            if len(data) > max_upload_bytes:
                raise ApiError(
                    413,
                    f"{key} is {len(data)} bytes; expected at most {max_upload_bytes} bytes",
                    param=key,
                    code="file_too_large",
                )
            fields[key] = Upload(value.filename, value.content_type, data)
    finally:
        await form.close()
    return fields


def _type_error(name: str, expected: str, value: Any) -> ApiError:
    return bad_param(name, f"{name} must be {expected}, found {type(value).__name__} {value!r}", "invalid_type")


def _text(fields: Mapping[str, Any], name: str) -> str | None:
    value = fields.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _type_error(name, "a string", value)
    if len(value) > MAX_PROMPT_CHARS:
        raise bad_param(name, f"{name} has {len(value)} characters; expected at most {MAX_PROMPT_CHARS}")
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
        raise bad_param(name, f"{name} must be a finite number, found {value!r}")
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


def frames_for_seconds(text: str) -> int:
    """frames = seconds x 24 + 1, which must be 4k+1; raises ApiError (param `seconds`) otherwise."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise bad_param("seconds", f"seconds must be a positive number such as '5', found {text!r}")
    scaled = value * FPS
    whole = round(scaled)
    if abs(scaled - whole) <= _SECONDS_TOLERANCE and whole % 4 == 0 and whole > 0:
        return whole + 1
    low = math.floor(scaled / 4) * 4
    nearest = " or ".join(f"'{seconds_for_frames(f + 1)}' ({f + 1} frames)" for f in (low, low + 4) if f > 0)
    raise bad_param(
        "seconds",
        f"seconds {text!r} does not map to a valid frame count: frames = seconds x {FPS} + 1 must be of the form "
        f"4k+1, so seconds x {FPS} must be a multiple of 4 (e.g. '5' -> 121 frames); nearest valid: {nearest}",
    )


def _geometry_problem(width: int, height: int, frames: int) -> str | None:
    from ..pipeline import RequestError, validate_geometry

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
        raise bad_param("size", f"size must be WIDTHxHEIGHT such as '864x480', found {text!r}")
    width, height = int(match[1]), int(match[2])
    problem = _geometry_problem(width, height, 1)
    if problem:
        raise bad_param("size", f"size {text}: {problem}")
    if not fits((width, height), config.max_size):
        limit, portrait = config.max_size, (config.max_size[1], config.max_size[0])
        raise bad_param(
            "size", f"size {text} exceeds this server's maximum of {fmt_size(limit)} (or {fmt_size(portrait)})"
        )
    return width, height


def _frames(fields: Mapping[str, Any], config: ServerConfig) -> tuple[int, str]:
    seconds = fields.get("seconds")
    if isinstance(seconds, (int, float)) and not isinstance(seconds, bool):
        seconds = str(seconds)
    if seconds is not None and not isinstance(seconds, str):
        raise _type_error("seconds", "a string such as '5'", seconds)
    seconds = seconds.strip() if seconds else None
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


def decode_image(data: bytes, param: str = "input_reference") -> PIL.Image.Image:
    """Bytes of an uploaded image → RGB PIL image; 400 when it is not an image or is too large to decode."""
    import PIL.Image

    try:
        image = PIL.Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > MAX_IMAGE_PIXELS:
            raise bad_param(
                param,
                f"{param} is {width}x{height} pixels; expected at most {MAX_IMAGE_PIXELS} pixels",
                "image_too_large",
            )
        image.load()
        return image.convert("RGB")
    except ApiError:
        raise
    except (OSError, SyntaxError, ValueError, PIL.Image.DecompressionBombError) as exc:
        raise bad_param(
            param, f"{param} is not a readable image ({exc}); expected a PNG, JPEG or WebP file", "invalid_image"
        ) from None


def _reference_image(fields: Mapping[str, Any]) -> PIL.Image.Image | None:
    value = fields.get("input_reference")
    url = fields.get("input_reference[image_url]")
    file_id = fields.get("input_reference[file_id]")
    if isinstance(value, dict):  # JSON body: {"input_reference": {"image_url": ...}}
        url, file_id, value = value.get("image_url"), value.get("file_id"), None
    if file_id is not None:
        raise bad_param(
            "input_reference",
            "input_reference.file_id is not supported (this server has no Files API); expected an image file "
            "upload or a data: URL in input_reference.image_url",
        )
    if url is not None:
        if not isinstance(url, str) or not url.startswith("data:"):
            raise bad_param(
                "input_reference",
                f"input_reference.image_url must be a base64 data: URL (this server fetches nothing), found "
                f"{str(url)[:40]!r}",
            )
        header, _, payload = url.partition(",")
        if not header.endswith(";base64"):
            raise bad_param("input_reference", "input_reference.image_url: expected a data:<type>;base64,<data> URL")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise bad_param("input_reference", f"input_reference.image_url: invalid base64 ({exc})") from None
        return decode_image(data)
    if value is None:
        return None
    if not isinstance(value, Upload):
        raise bad_param(
            "input_reference",
            'input_reference must be an image file upload (a multipart file part) or {"image_url": "data:..."}, '
            f"found a {type(value).__name__}",
        )
    return decode_image(value.data)


def parse_create(fields: Mapping[str, Any], config: ServerConfig, served_names: tuple[str, ...]) -> Draft:
    """Check every field of a create request; raises ApiError (400) naming the parameter."""
    unknown = sorted(k for k in fields if k not in CREATE_FIELDS and k not in _REFERENCE_KEYS)
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
            f"model {model!r} is not served here; expected {served_names[0]!r} (or leave model out)",
            "model_not_found",
        )
    width, height = parse_size(fields.get("size") or fmt_size(config.default_size), config)
    frames, seconds = _frames(fields, config)
    seed = _int(fields, "seed", 0, SEED_MAX)
    return Draft(
        prompt=prompt,
        negative_prompt=_text(fields, "negative_prompt") or None,
        width=width,
        height=height,
        frames=frames,
        seconds=seconds,
        steps=_int(fields, "num_inference_steps", 1, config.max_steps),
        guidance=_float(fields, "guidance_scale"),
        # Drawn here, not at run time, so a job re-run after a restart makes the same clip.
        seed=secrets.randbelow(2**31) if seed is None else seed,
        audio=_bool(fields, "sample_audio", True),
        image=_reference_image(fields),
    )


def parse_list_query(query: Mapping[str, str]) -> tuple[str | None, int, str]:
    """`after`, `limit` (1-100, default 20) and `order` (asc | desc, default desc) of GET /v1/videos."""
    unknown = sorted(set(query) - {"after", "limit", "order"})
    if unknown:
        raise bad_param(unknown[0], f"unknown query parameter {unknown[0]!r}; expected after, limit or order")
    limit = _int(query, "limit", 1, 100)
    order = query.get("order") or "desc"
    if order not in ("asc", "desc"):
        raise bad_param("order", f"order must be 'asc' or 'desc', found {order!r}")
    return query.get("after") or None, LIST_DEFAULT_LIMIT if limit is None else limit, order


def parse_variant(query: Mapping[str, str]) -> str:
    unknown = sorted(set(query) - {"variant"})
    if unknown:
        raise bad_param(unknown[0], f"unknown query parameter {unknown[0]!r}; expected variant")
    variant = query.get("variant") or "video"
    if variant not in ("video", "thumbnail"):
        raise bad_param(
            "variant", f"variant {variant!r} is not available from this server; expected 'video' or 'thumbnail'"
        )
    return variant


# Which request parameter a pipeline RequestError is about, by the word its message leads with.
_RESOLVE_PARAMS = (
    ("guidance", "guidance_scale"),
    ("image conditioning", "input_reference"),
    ("K6_PIFLOW_CACHE_STEPS", "num_inference_steps"),
    ("steps", "num_inference_steps"),
    ("prompt", "prompt"),
)


def resolve_spec(draft: Draft, pipeline: Any, max_steps: int) -> JobSpec:
    """Check the draft against the loaded checkpoint (`Pipeline.resolve`: distilled checkpoints need guidance 1.0,
    image conditioning needs support, cached steps must fit) and fill in its default steps and guidance."""
    from ..pipeline import Request, RequestError

    request = Request(
        prompt=draft.prompt,
        width=draft.width,
        height=draft.height,
        frames=draft.frames,
        steps=draft.steps,
        guidance=draft.guidance,
        seed=draft.seed,
        negative_prompt=draft.negative_prompt,
        image=draft.image,
        audio=draft.audio,
    )
    try:
        steps, guidance = pipeline.resolve(request)
    except RequestError as exc:
        message = str(exc)
        param = next((p for word, p in _RESOLVE_PARAMS if word in message), None)
        raise ApiError(400, message, param=param, code="invalid_value") from None
    if steps > max_steps:
        raise bad_param(
            "num_inference_steps",
            f"the checkpoint's default of {steps} steps exceeds this server's maximum of {max_steps}; "
            "pass num_inference_steps",
        )
    return JobSpec(
        prompt=draft.prompt,
        width=draft.width,
        height=draft.height,
        frames=draft.frames,
        steps=steps,
        guidance=guidance,
        seed=draft.seed,
        seconds=draft.seconds,
        audio=draft.audio,
        negative_prompt=draft.negative_prompt,
        image=draft.image is not None,
    )
