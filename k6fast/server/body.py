"""Reading a create request's body, with every limit checked before the body is parsed.

A hostile body costs bounded time and memory and gets a clean 4xx: its declared and actual size are capped (413),
the whole body must arrive within `body_timeout_s` (408, and the connection is closed), a JSON body's nesting depth,
objects and values are counted on the raw bytes before `json.loads` sees it (400), and a form may carry at most
`MAX_FORM_FIELDS` fields and two files (400).

A body over the limit is read to its end and dropped before the 413 is sent, up to as much again as the limit and
within `body_timeout_s`: most clients read nothing until they have sent the whole body, and uvicorn's keep-alive
timer starts with the response, so a 413 sent early closes the connection under a client that pauses while it is
still sending (a broken pipe, where it should read the 413). A body larger still, or one that stops arriving, gets the
413 at once with `Connection: close`.

`POST /v1/videos` takes multipart/form-data (what the OpenAI SDK sends, `extra_body` fields flattened into the form,
booleans as "true"/"false"), application/x-www-form-urlencoded or application/json.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import ApiError, bad_param

if TYPE_CHECKING:
    from starlette.requests import Request as HttpRequest

FORM_OVERHEAD_BYTES = 1 << 20  # text fields and multipart framing on top of the image upload
MAX_FORM_FIELDS = 32  # the create request has 11 parameters
# {"input_reference": {"image_url": "data:..."}} is 2 deep; nothing the API takes is deeper.
MAX_JSON_DEPTH = 4
MAX_JSON_CONTAINERS = 16  # objects and arrays in one body
MAX_JSON_SEPARATORS = 2 * MAX_FORM_FIELDS  # ',' and ':' outside strings: about two per field
# A JSON string: a quote, then anything but a quote or backslash, or a backslash and the character after it, up to the
# closing quote or the end of the body. It always matches from the quote on, so one pass strips every string in linear
# time (an unterminated string runs to the end; json.loads then refuses it).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\[\s\S]?[^"\\]*)*"?')


@dataclass(frozen=True)
class Upload:
    """A file part of a form: the bytes as sent (the image is checked and decoded later, see images.py)."""

    filename: str | None
    content_type: str | None
    data: bytes


def _too_large(limit: int, close: bool = False) -> ApiError:
    return ApiError(
        413,
        f"the request body exceeds {limit} bytes; expected an image of at most {limit - FORM_OVERHEAD_BYTES} bytes "
        "plus form fields",
        code="request_too_large",
        headers={"Connection": "close"} if close else None,
    )


def _timed_out(timeout_s: float) -> ApiError:
    # Connection: close, so the server drops the connection instead of waiting for the rest of the body.
    return ApiError(
        408,
        f"the request body did not arrive within {timeout_s:g} s; expected the whole body (as its Content-Length "
        "declares) in that time",
        code="request_timeout",
        headers={"Connection": "close"},
    )


async def _next_chunk(stream: AsyncIterator[bytes], deadline: float) -> bytes | None:
    """The body's next chunk, None at its end; asyncio.TimeoutError past `deadline` (the event loop's clock), and
    starlette's ClientDisconnect when the client went away."""
    try:
        return await asyncio.wait_for(stream.__anext__(), max(0.0, deadline - asyncio.get_running_loop().time()))
    except StopAsyncIteration:
        return None


async def _refuse_oversized(stream: AsyncIterator[bytes], received: int, limit: int, deadline: float) -> ApiError:
    """The 413 for a body past `limit`, once the rest of it (up to `limit` bytes more) has been read and dropped;
    with Connection: close where it could not be (larger still, too slow, or the client went away)."""
    from starlette.requests import ClientDisconnect

    try:
        while received <= 2 * limit:
            chunk = await _next_chunk(stream, deadline)
            if chunk is None:
                return _too_large(limit)
            received += len(chunk)
    except (asyncio.TimeoutError, ClientDisconnect):
        pass
    return _too_large(limit, close=True)


async def _limited(request: HttpRequest, limit: int, timeout_s: float) -> AsyncIterator[bytes]:
    """The body's chunks; 413 past `limit` bytes (see _refuse_oversized), 408 when the whole body has not arrived
    `timeout_s` after the first read."""
    from starlette.requests import ClientDisconnect

    deadline = asyncio.get_running_loop().time() + timeout_s
    stream = request.stream()
    total = 0
    while True:
        try:
            chunk = await _next_chunk(stream, deadline)
        except asyncio.TimeoutError:
            raise _timed_out(timeout_s) from None
        except ClientDisconnect:  # nobody is left to read the answer; a 400 keeps it out of the error log
            raise ApiError(
                400, "the client closed the connection before the body ended", code="incomplete_body"
            ) from None
        if chunk is None:
            return
        total += len(chunk)
        if total > limit:
            raise await _refuse_oversized(stream, total, limit, deadline)
        yield chunk


def check_json_shape(raw: bytes) -> None:
    """400 unless the JSON text `raw` nests at most MAX_JSON_DEPTH deep, with at most MAX_JSON_CONTAINERS objects and
    arrays and MAX_JSON_SEPARATORS separators: checked on the bytes, before a parser spends memory or recursion."""
    bare = _JSON_STRING.sub(b'""', raw)
    # Openings or closings, whichever are more: either bounds the bracket walk below.
    containers = max(bare.count(b"{") + bare.count(b"["), bare.count(b"}") + bare.count(b"]"))
    if containers > MAX_JSON_CONTAINERS:
        raise ApiError(
            400,
            f"the JSON body has {containers} objects and arrays; expected one object of parameters (at most "
            f"{MAX_JSON_CONTAINERS})",
            code="invalid_json",
        )
    separators = bare.count(b",") + bare.count(b":")
    if separators > MAX_JSON_SEPARATORS:
        raise ApiError(
            400,
            f"the JSON body has {separators} separators (',' and ':'); expected at most {MAX_JSON_SEPARATORS}, "
            f"enough for {MAX_FORM_FIELDS} parameters",
            code="invalid_json",
        )
    depth = deepest = 0
    for match in re.finditer(rb"[\[\]{}]", bare):  # at most 2 x MAX_JSON_CONTAINERS brackets by now
        depth += 1 if match[0] in b"[{" else -1
        deepest = max(deepest, depth)
    if deepest > MAX_JSON_DEPTH:
        raise ApiError(
            400,
            f"the JSON body nests {deepest} levels deep; expected at most {MAX_JSON_DEPTH}",
            code="invalid_json",
        )


def parse_json(raw: bytes) -> dict[str, Any]:
    check_json_shape(raw)
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ApiError(
            400,
            f"the body is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); expected a JSON object",
            code="invalid_json",
        ) from None
    except (ValueError, RecursionError):  # not UTF-8, or a number too long to convert
        raise ApiError(
            400,
            "the body is not valid JSON in UTF-8 with numbers of usual length; expected a JSON object",
            code="invalid_json",
        ) from None
    if not isinstance(data, dict):
        raise ApiError(400, f"expected a JSON object, found a JSON {type(data).__name__}", code="invalid_json")
    return data


def _count_form_fields(raw: bytes) -> None:
    fields = raw.count(b"&") + 1 if raw else 0
    if fields > MAX_FORM_FIELDS:
        raise ApiError(400, f"the form has {fields} fields; expected at most {MAX_FORM_FIELDS}", code="invalid_form")


async def read_fields(request: HttpRequest, max_upload_bytes: int, timeout_s: float) -> dict[str, Any]:
    """The create request's fields by name: strings (forms) or JSON values, an `Upload` for a file part."""
    from starlette.formparsers import FormParser, MultiPartException, MultiPartParser

    limit = max_upload_bytes + FORM_OVERHEAD_BYTES
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        if int(declared) > 2 * limit:  # not worth reading: refused at once, the connection closed
            raise _too_large(limit, close=True)
        deadline = asyncio.get_running_loop().time() + timeout_s
        raise await _refuse_oversized(request.stream(), 0, limit, deadline)
    content_type = request.headers.get("content-type", "")
    media = content_type.split(";", 1)[0].strip().lower()
    if media not in ("application/json", "multipart/form-data", "application/x-www-form-urlencoded"):
        raise ApiError(
            415,
            f"unsupported content type {content_type[:80] or '(none)'!r}; expected multipart/form-data (as the OpenAI "
            "SDK sends), application/x-www-form-urlencoded or application/json",
            code="unsupported_media_type",
        )
    body = _limited(request, limit, timeout_s)
    if media == "application/json":
        return parse_json(b"".join([chunk async for chunk in body]))
    if media == "multipart/form-data":
        parser = MultiPartParser(
            request.headers, body, max_files=2, max_fields=MAX_FORM_FIELDS, max_part_size=FORM_OVERHEAD_BYTES
        )
    else:
        raw = b"".join([chunk async for chunk in body])
        _count_form_fields(raw)

        async def whole() -> AsyncIterator[bytes]:
            yield raw

        parser = FormParser(request.headers, whole())
    try:
        form = await parser.parse()
    except MultiPartException as exc:  # starlette's own words: "Missing boundary in multipart.", "Too many fields..."
        raise ApiError(400, f"malformed form body: {exc.message}", code="invalid_multipart") from None
    except ApiError:
        raise
    except Exception:  # python-multipart's parse errors have several types; all mean a broken body
        raise ApiError(
            400, "malformed form body: it could not be parsed as the content type it declares", code="invalid_multipart"
        ) from None
    fields: dict[str, Any] = {}
    try:
        for key, value in form.multi_items():
            if key in fields:
                raise bad_param(
                    key[:64], f"parameter {key[:64]!r} is given more than once; expected it once", "duplicate"
                )
            if isinstance(value, str):
                fields[key] = value
                continue
            data = await value.read()
            if len(data) > max_upload_bytes:
                raise ApiError(
                    413,
                    f"{key[:64]} is {len(data)} bytes; expected at most {max_upload_bytes} bytes",
                    param=key[:64],
                    code="file_too_large",
                )
            fields[key] = Upload(value.filename, value.content_type, data)
    finally:
        await form.close()
    return fields
