"""Image uploads (`input_reference`): PNG, JPEG or WebP by content, sized from the header, kept as the bytes sent.

Checked in the order that keeps a hostile upload cheap, and never decoded while its job waits:
1. `open_image`: the bytes are opened with only the PNG, JPEG and WebP readers (`Image.open(..., formats=...)`), so no
   other Pillow plugin (EPS's Ghostscript, TIFF, BMP, ...) ever sees them; the header gives the size, which must be
   at most MAX_IMAGE_PIXELS. Nothing is decoded.
2. The server checks that the queue has room (a request that ends in 429 never reads its pixels).
3. `check_pixels`: a truncated or corrupt image is refused now, in bounded memory: a PNG's compressed pixel stream is
   inflated into a small window and counted, a baseline JPEG is decoded at 1/8 scale. A progressive JPEG (libjpeg
   holds all its coefficients, 6 bytes a pixel) and a WebP (Pillow decodes it whole) are checked when their job
   starts; WebP's container, truncation included, was checked at step 1.
4. `store_upload`: the job waits with the upload's bytes on disk, not with an image in memory; ten waiting 36 MP
   uploads are their ten file sizes, where decoded they would be over a gigabyte.
5. `decode_stored`: the pixels, when the job starts (the worker, or a Ray replica).
Error messages are fixed words: nothing of Pillow's exception text (which names buffer objects by address) is sent.
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
import os
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..atomic import atomic_path
from .body import Upload
from .errors import bad_param, kind_of
from .jobs import PRIVATE_FILE

if TYPE_CHECKING:
    import PIL.Image

log = logging.getLogger("k6fast.server")

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")
# Decoded size guard: an RGBA image this large is 160 MB while decoding (the pipeline resizes to the video size).
MAX_IMAGE_PIXELS = 40_000_000
# Signatures of formats people send by mistake, so the refusal can say what was found.
_SIGNATURES = (
    (b"GIF8", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"%!PS", "PostScript/EPS"),
    (b"\xc5\xd0\xd3\xc6", "EPS"),
    (b"%PDF", "PDF"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"qoif", "QOI"),
    (b"DDS ", "DDS"),
    (b"<svg", "SVG"),
    (b"<?xml", "XML/SVG"),
)
_EXPECTED = "expected a PNG, JPEG or WebP image"
_INFLATE_STEP = 64 << 10  # the most decompressed PNG data held at once by check_pixels
_INFLATE_FEED = 4 << 10  # compressed PNG data given to zlib at once
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # by colour type: grey, RGB, palette, grey+alpha, RGBA
# Adam7's passes: (first column, first row, column step, row step).
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))


@dataclass(frozen=True)
class ImageUpload:
    """An input reference as it was sent: its bytes, and the format and size its header declares."""

    data: bytes
    format: str  # one of IMAGE_FORMATS
    width: int
    height: int

    def header_only(self) -> PIL.Image.Image:
        """The image opened, its pixels not decoded (what `Request.image` needs to be checked, not run)."""
        import PIL.Image

        return PIL.Image.open(io.BytesIO(self.data), formats=[self.format])


def _what(data: bytes) -> str:
    if data.startswith(b"\x89PNG") or data.startswith(b"\xff\xd8") or data[8:12] == b"WEBP":
        return "damaged: its header could not be read"
    for signature, name in _SIGNATURES:
        if data.startswith(signature):
            return f"a {name} file"
    return "an empty file" if not data else "a file in none of those formats"


def open_image(data: bytes, param: str = "input_reference") -> ImageUpload:
    """The upload's format and size from its header (pixels not decoded); 400 unless it is a PNG, JPEG or WebP of at
    most MAX_IMAGE_PIXELS pixels."""
    import PIL.Image

    try:
        with PIL.Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
            width, height = image.size
            fmt = image.format
    except PIL.Image.DecompressionBombError:
        raise bad_param(
            param,
            f"{param} declares more than {MAX_IMAGE_PIXELS} pixels; {_EXPECTED} of at most that",
            "image_too_large",
        ) from None
    except Exception:  # Pillow's readers raise many types on hostile headers; any of them means "not an image"
        raise bad_param(param, f"{param} is {_what(data)}; {_EXPECTED}", "invalid_image") from None
    if width < 1 or height < 1:
        raise bad_param(param, f"{param} is {width}x{height} pixels ({fmt}); {_EXPECTED}", "invalid_image")
    if width * height > MAX_IMAGE_PIXELS:
        raise bad_param(
            param,
            f"{param} is {width}x{height} pixels ({fmt}); {_EXPECTED} of at most {MAX_IMAGE_PIXELS} pixels",
            "image_too_large",
        )
    return ImageUpload(data, fmt, width, height)


def _png_data_bytes(header: bytes) -> int:
    """The size of a PNG's decompressed pixel stream (filter byte + packed samples per row, per Adam7 pass when
    interlaced), from its IHDR chunk's data."""
    width, height, depth, colour, _, _, interlaced = struct.unpack(">IIBBBBB", header)
    bits = _PNG_CHANNELS[colour] * depth

    def stream(columns: int, rows: int) -> int:
        return rows * (1 + (columns * bits + 7) // 8) if columns and rows else 0

    if not interlaced:
        return stream(width, height)
    return sum(stream(-(-(width - x) // dx), -(-(height - y) // dy)) for x, y, dx, dy in _ADAM7)


def _png_pixels_complete(data: bytes) -> bool:
    """Whether a PNG's IDAT chunks hold a whole compressed stream (its end, or as many bytes as the header declares,
    where Pillow's decoder stops), holding at most _INFLATE_STEP decompressed bytes at a time; zlib raises on corrupt
    data."""
    view = memoryview(data)
    if bytes(view[12:16]) != b"IHDR":
        return False
    needed = _png_data_bytes(bytes(view[16:29]))
    inflater, produced, offset = zlib.decompressobj(), 0, 8
    while offset + 8 <= len(view):
        (length,), kind = struct.unpack(">I", view[offset : offset + 4]), bytes(view[offset + 4 : offset + 8])
        payload = view[offset + 8 : offset + 8 + length]
        offset += 12 + length
        if kind == b"IEND" or len(payload) < length:
            break
        if kind != b"IDAT":
            continue
        # Fed in small pieces: what one step leaves unconsumed is copied before the next, so it must stay small.
        for start in range(0, length, _INFLATE_FEED):
            pending = payload[start : start + _INFLATE_FEED]
            while True:
                out = inflater.decompress(pending, _INFLATE_STEP)
                produced += len(out)
                pending = inflater.unconsumed_tail
                # A stream that ends short is complete to Pillow too: it leaves the missing rows black.
                if produced >= needed or inflater.eof:
                    return True
                if not pending and len(out) < _INFLATE_STEP:
                    break
    return False


def check_pixels(upload: ImageUpload, param: str = "input_reference") -> None:
    """400 when the upload's pixel data is truncated or corrupt, found in bounded memory (a PNG's stream inflated in
    steps, a baseline JPEG decoded at 1/8 scale); a progressive JPEG and a WebP are checked when their job starts."""
    import PIL.Image

    try:
        if upload.format == "PNG":
            complete = _png_pixels_complete(upload.data)
        elif upload.format == "JPEG":
            with PIL.Image.open(io.BytesIO(upload.data), formats=["JPEG"]) as image:
                complete = True
                progressive = image.info.get("progressive") or image.info.get("progression")
                # draft: the smallest scale libjpeg has, 1/8 a side (None where it cannot scale this file).
                if not progressive and image.draft(None, (1, 1)) is not None:
                    image.load()
        else:
            complete = True
    except MemoryError:
        raise
    except Exception as exc:  # zlib's and Pillow's decoders raise many types on corrupt data
        log.info("an %s upload's pixels could not be read: %s", upload.format, type(exc).__name__)
        complete = False
    if not complete:
        raise bad_param(
            param,
            f"{param} has a valid {upload.format} header but its pixel data is truncated or corrupt; {_EXPECTED}",
            "invalid_image",
        )


def store_upload(upload: ImageUpload, path: Path) -> None:
    """The upload's bytes, as sent, at `path` (0600, atomically: a hidden temporary file, fsync, rename)."""
    with atomic_path(path) as tmp:
        os.chmod(tmp, PRIVATE_FILE)
        tmp.write_bytes(upload.data)


def decode_stored(data: bytes) -> PIL.Image.Image:
    """A stored upload's pixels as RGB, when its job starts; raises (an ApiError or Pillow's own) when they cannot be
    read."""
    open_image(data)  # the same limits as at the upload, whatever was stored
    import PIL.Image

    with PIL.Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
        return image.convert("RGB")


def _data_url(url: Any) -> bytes:
    if not isinstance(url, str) or not url.startswith("data:"):
        shown = repr(url[:40]) if isinstance(url, str) else kind_of(url)
        raise bad_param(
            "input_reference",
            f"input_reference.image_url must be a base64 data: URL (this server fetches nothing), found {shown}",
        )
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        raise bad_param("input_reference", "input_reference.image_url: expected a data:<type>;base64,<data> URL")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_param(
            "input_reference", "input_reference.image_url: the data after 'base64,' is not valid base64"
        ) from None


def reference_image(fields: Mapping[str, Any]) -> ImageUpload | None:
    """The create request's `input_reference` (a file part, or a data: URL in JSON or the SDK's flattened form keys),
    its header checked by `open_image`; None when there is none."""
    value = fields.get("input_reference")
    url = fields.get("input_reference[image_url]")
    file_id = fields.get("input_reference[file_id]")
    if isinstance(value, dict):  # JSON body: {"input_reference": {"image_url": ...}}
        unknown = sorted(str(k)[:40] for k in value if k not in ("image_url", "file_id"))
        if unknown:
            raise bad_param(
                "input_reference", f"input_reference has unknown key {unknown[0]!r}; expected image_url or file_id"
            )
        url, file_id, value = value.get("image_url"), value.get("file_id"), None
    if file_id is not None:
        raise bad_param(
            "input_reference",
            "input_reference.file_id is not supported (this server has no Files API); expected an image file "
            "upload or a data: URL in input_reference.image_url",
        )
    if url is not None:
        return open_image(_data_url(url))
    if value is None:
        return None
    if not isinstance(value, Upload):
        raise bad_param(
            "input_reference",
            'input_reference must be an image file upload (a multipart file part) or {"image_url": "data:..."}, '
            f"found {kind_of(value)}",
        )
    return open_image(value.data)
