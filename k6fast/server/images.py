"""Image uploads (`input_reference`): PNG, JPEG or WebP by content, sized from the header, decoded last.

Checked in the order that keeps a hostile upload cheap:
1. `open_image`: the bytes are opened with only the PNG, JPEG and WebP readers (`Image.open(..., formats=...)`), so no
   other Pillow plugin (EPS's Ghostscript, TIFF, BMP, ...) ever sees them; the header gives the size, which must be
   at most MAX_IMAGE_PIXELS. Nothing is decoded yet.
2. The server checks that the queue has room (a request that ends in 429 never decodes its upload).
3. `decode_image`: the pixels, one decode at a time per server (`ServerState`), so concurrent uploads hold at most one
   decoded image beyond their compressed bytes.
Error messages are fixed words: nothing of Pillow's exception text (which names buffer objects by address) is sent.
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .body import Upload
from .errors import bad_param, kind_of

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


def _what(data: bytes) -> str:
    if data.startswith(b"\x89PNG") or data.startswith(b"\xff\xd8") or data[8:12] == b"WEBP":
        return "damaged: its header could not be read"
    for signature, name in _SIGNATURES:
        if data.startswith(signature):
            return f"a {name} file"
    return "an empty file" if not data else "a file in none of those formats"


def open_image(data: bytes, param: str = "input_reference") -> PIL.Image.Image:
    """The upload opened lazily (header read, pixels not decoded); 400 unless it is a PNG, JPEG or WebP of at most
    MAX_IMAGE_PIXELS pixels."""
    import PIL.Image

    try:
        image = PIL.Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        width, height = image.size
    except PIL.Image.DecompressionBombError:
        raise bad_param(
            param,
            f"{param} declares more than {MAX_IMAGE_PIXELS} pixels; {_EXPECTED} of at most that",
            "image_too_large",
        ) from None
    except Exception:  # Pillow's readers raise many types on hostile headers; any of them means "not an image"
        raise bad_param(param, f"{param} is {_what(data)}; {_EXPECTED}", "invalid_image") from None
    if width < 1 or height < 1:
        raise bad_param(param, f"{param} is {width}x{height} pixels ({image.format}); {_EXPECTED}", "invalid_image")
    if width * height > MAX_IMAGE_PIXELS:
        raise bad_param(
            param,
            f"{param} is {width}x{height} pixels ({image.format}); {_EXPECTED} of at most {MAX_IMAGE_PIXELS} pixels",
            "image_too_large",
        )
    return image


def decode_image(image: PIL.Image.Image, param: str = "input_reference") -> PIL.Image.Image:
    """The pixels of an image from `open_image`, as RGB; 400 when they cannot be decoded (truncated or corrupt)."""
    try:
        image.load()
        return image.convert("RGB")
    except MemoryError:
        raise
    except Exception as exc:  # truncated or corrupt data raises many types from Pillow's decoders
        log.info("an %s upload could not be decoded: %s", image.format, type(exc).__name__)
        raise bad_param(
            param,
            f"{param} has a valid {image.format} header but its pixels could not be decoded (the file is truncated "
            f"or corrupt); {_EXPECTED}",
            "invalid_image",
        ) from None
    finally:
        image.close()


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


def reference_image(fields: Mapping[str, Any]) -> PIL.Image.Image | None:
    """The create request's `input_reference` (a file part, or a data: URL in JSON or the SDK's flattened form keys),
    opened by `open_image`; None when there is none."""
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
