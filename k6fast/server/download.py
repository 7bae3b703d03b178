"""A finished job's file as a response that a DELETE cannot cut.

The file is opened while the request is answered, and the response streams from that open file: a DELETE (or the
expiry) removes the name only, and the open descriptor keeps the data until the download ends, so a download that has
begun gets the whole file; one that begins after the DELETE finds no file (`open_file` is None) and gets a 404.
Starlette's FileResponse stats and opens the path only when it sends the response, after the route has returned: a
DELETE in between made a 500 (the stat) or cut the body after the headers (the open).

Ranges as FileResponse served them: one range (`bytes=a-b`, `a-`, `-n`) is a 206 with Content-Range, a range past the
end a 416 (in OpenAI's error shape); several ranges, or an If-Range naming another version, get the whole file (RFC
9110 lets a server ignore a Range header).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import stat
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from email.utils import formatdate
from pathlib import Path

from anyio import to_thread
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from .errors import ApiError

CHUNK_BYTES = 64 << 10
_RANGE = re.compile(r"\s*bytes\s*=\s*([0-9]*)\s*-\s*([0-9]*)\s*")


@dataclass
class OpenFile:
    """A regular file opened for reading, and its size and dates at the open."""

    file: io.FileIO
    size: int
    mtime: float

    def close(self) -> None:
        self.file.close()


def open_file(path: Path) -> OpenFile | None:
    """`path` opened for reading; None when it does not exist (or is not a regular file)."""
    try:
        file = io.FileIO(path, "r")
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    try:
        info = os.fstat(file.fileno())
    except BaseException:
        file.close()
        raise
    if not stat.S_ISREG(info.st_mode):
        file.close()
        return None
    return OpenFile(file, info.st_size, info.st_mtime)


def _range(header: str | None, size: int) -> tuple[int, int] | None | str:
    """The one byte range [start, end) that `header` asks for; None for the whole file; "unsatisfiable" past the
    end."""
    match = _RANGE.fullmatch(header) if header else None
    if match is None or not (match[1] or match[2]):  # absent, malformed or several ranges: the whole file
        return None
    if not match[1]:  # the last n bytes
        suffix = int(match[2])
        return (max(0, size - suffix), size) if suffix else "unsatisfiable"
    start = int(match[1])
    end = min(size, int(match[2]) + 1) if match[2] else size
    if start >= size:
        return "unsatisfiable"
    return (start, end) if start < end else None


async def _chunks(opened: OpenFile, start: int, end: int) -> AsyncIterator[bytes]:
    offset = start
    while offset < end:
        chunk = await to_thread.run_sync(os.pread, opened.file.fileno(), min(CHUNK_BYTES, end - offset), offset)
        if not chunk:  # the file is immutable once its job completes; shorter means the disk lost it
            raise OSError(f"expected {end - offset} more bytes of a {opened.size}-byte file, found its end")
        offset += len(chunk)
        yield chunk


class _OpenFileResponse(StreamingResponse):
    def __init__(self, opened: OpenFile, start: int, end: int, status: int, headers: dict[str, str], media_type: str):
        super().__init__(_chunks(opened, start, end), status, headers, media_type)
        self.opened = opened

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Only here: the chunk generator never closes the file, so its late aclose() (after a client went away
            # mid-chunk) touches nothing.
            self.opened.close()


def file_response(opened: OpenFile, media_type: str, filename: str, request_headers: Mapping[str, str]) -> Response:
    """The response that streams `opened` (whole, or the one range the request asks for) and closes it at the end,
    however the response ends."""
    size = opened.size
    etag = '"' + hashlib.md5(f"{opened.mtime}-{size}".encode(), usedforsecurity=False).hexdigest() + '"'
    headers = {
        "accept-ranges": "bytes",
        "content-disposition": f'attachment; filename="{filename}"',
        "etag": etag,
        "last-modified": formatdate(opened.mtime, usegmt=True),
    }
    if_range = request_headers.get("if-range")
    wanted = _range(request_headers.get("range"), size)
    if if_range is not None and if_range not in (etag, headers["last-modified"]):
        wanted = None
    if wanted == "unsatisfiable":
        opened.close()
        raise ApiError(
            416,
            f"the range {request_headers.get('range', '')[:40]!r} starts past the end; expected bytes within the "
            f"{size}-byte file",
            code="range_not_satisfiable",
            headers={"content-range": f"bytes */{size}"},
        )
    start, end = (0, size) if wanted is None else wanted
    headers["content-length"] = str(end - start)
    status = 200
    if wanted is not None:
        status, headers["content-range"] = 206, f"bytes {start}-{end - 1}/{size}"
    return _OpenFileResponse(opened, start, end, status, headers, media_type)
