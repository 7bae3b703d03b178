"""The hostile requests of tests/test_hostile_input.py, as data: each one a request an attacker or a confused client
could send to `POST /v1/videos` or the other routes, with the status and the error code (or parameter) that show the
intended check refused it. Built here, sent there."""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib

import numpy as np
import PIL.Image

KEY = "sk-hostile"
AUTH = {"Authorization": f"Bearer {KEY}"}
BASE = {"prompt": "a cat", "size": "64x64", "num_frames": "5", "num_inference_steps": "2"}
MAX_UPLOAD = 1 << 20
JSON = "application/json"

# ------------------------------------------------------------------------------------------------------------------
# What the requests carry
# ------------------------------------------------------------------------------------------------------------------


def image_bytes(fmt: str, size: tuple[int, int] = (16, 16)) -> bytes:
    image = PIL.Image.new("RGB", size, (10, 20, 30))
    if fmt in ("MSP", "XBM", "PALM"):
        image = image.convert("1")
    elif fmt == "SPIDER":
        image = image.convert("F")
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_declaring(width: int, height: int, extra: bytes = b"") -> bytes:
    """A PNG whose header declares width x height (its pixel data is a token few bytes)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + extra + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def _jpeg_declaring(width: int, height: int) -> bytes:
    data = bytearray(image_bytes("JPEG"))
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def _truncated_png() -> bytes:
    noise = np.random.default_rng(0).integers(0, 256, (256, 256, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    PIL.Image.fromarray(noise).save(buffer, format="PNG")
    data = buffer.getvalue()
    return data[: len(data) * 3 // 5]


def _webp_declaring_a_huge_canvas() -> bytes:
    buffer = io.BytesIO()
    PIL.Image.new("RGBA", (16, 16), (1, 2, 3, 100)).save(buffer, format="WEBP", quality=80)
    data = bytearray(buffer.getvalue())
    vp8x = data.index(b"VP8X")
    data[vp8x + 12 : vp8x + 18] = (16383).to_bytes(3, "little") * 2  # canvas width-1, height-1
    return bytes(data)


# PNG text chunks are inflated when the header is read: a 64 MiB zTXt compresses to ~64 KiB.
_ZTXT_BOMB = _chunk(b"zTXt", b"Comment\x00\x00" + zlib.compress(b"\x00" * (64 << 20), 9))


def form(**fields) -> dict:
    """multipart/form-data as the OpenAI SDK sends it, over BASE (None removes a field)."""
    merged = {k: v for k, v in {**BASE, **fields}.items() if v is not None}
    return {"files": [(k, (None, v)) for k, v in merged.items()]}


def upload(data: bytes, name: str = "ref.png", ctype: str = "image/png", **fields) -> dict:
    request = form(**fields)
    request["files"].append(("input_reference", (name, data, ctype)))
    return request


def raw(content, ctype: str | None = JSON, **headers) -> dict:
    return {"content": content, "headers": {**({"content-type": ctype} if ctype else {}), **headers}}


def as_json(value) -> dict:
    return raw(json.dumps(value).encode())


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _many_fields(n: int) -> dict:
    return {"files": [(f"f{i}", (None, "1")) for i in range(n)]}


# (name, method, path, request, status, why): request is what TestClient.request takes, plus "auth": False to send no
# key; why is the error's code or param that says the intended check refused it (None: any).
CREATE = "/v1/videos"
VID = "video_" + "0" * 32
CASES = [
    # The body: size, time, shape, type.
    ("json nested 100000 deep", "POST", CREATE, raw(b"[" * 100_000 + b"]" * 100_000), 400, "invalid_json"),
    (
        "json objects nested 50000 deep",
        "POST",
        CREATE,
        raw(b'{"a":' * 50_000 + b"1" + b"}" * 50_000),
        400,
        "invalid_json",
    ),
    ("json 5 levels", "POST", CREATE, as_json({"prompt": {"a": {"b": {"c": {"d": 1}}}}}), 400, "invalid_json"),
    ("json 17 arrays", "POST", CREATE, as_json({"prompt": [[] for _ in range(17)]}), 400, "invalid_json"),
    ("json 1000 values", "POST", CREATE, as_json({"prompt": "x", "seed": [1] * 1000}), 400, "invalid_json"),
    ("json closing brackets only", "POST", CREATE, raw(b"]" * 1_000_000), 400, "invalid_json"),
    ("json array", "POST", CREATE, as_json([]), 400, "invalid_json"),
    ("json string", "POST", CREATE, as_json("a cat"), 400, "invalid_json"),
    ("json number", "POST", CREATE, as_json(5), 400, "invalid_json"),
    ("json null", "POST", CREATE, as_json(None), 400, "invalid_json"),
    ("json cut short", "POST", CREATE, raw(b'{"prompt": "a cat"'), 400, "invalid_json"),
    ("json trailing garbage", "POST", CREATE, raw(b'{"prompt": "a cat"} x'), 400, "invalid_json"),
    ("json not utf-8", "POST", CREATE, raw(b'{"prompt": "\xff\xfe"}'), 400, "invalid_json"),
    (
        "json 5000-digit number",
        "POST",
        CREATE,
        raw(b'{"prompt": "x", "seed": 1' + b"0" * 5000 + b"}"),
        400,
        "invalid_json",
    ),
    ("json lone surrogate", "POST", CREATE, raw(b'{"prompt": "\\ud800", "size": "64x64"}'), 400, "prompt"),
    ("json NaN guidance", "POST", CREATE, raw(b'{"prompt": "x", "guidance_scale": NaN}'), 400, "guidance_scale"),
    ("json Infinity seed", "POST", CREATE, raw(b'{"prompt": "x", "seed": Infinity}'), 400, "seed"),
    ("json empty body", "POST", CREATE, raw(b""), 400, "invalid_json"),
    (
        "json unterminated string of brackets",
        "POST",
        CREATE,
        raw(b'{"prompt": "' + b"[" * 100_000),
        400,
        "invalid_json",
    ),
    ("json escaped-quote storm", "POST", CREATE, raw(b'{"prompt": "' + b'\\"' * 500_000), 400, "invalid_json"),
    ("json prompt object", "POST", CREATE, as_json({"prompt": {"text": "x"}}), 400, "prompt"),
    ("json prompt number", "POST", CREATE, as_json({"prompt": 5}), 400, "prompt"),
    ("json prompt array", "POST", CREATE, as_json({"prompt": ["a"]}), 400, "prompt"),
    ("json size number", "POST", CREATE, as_json({"prompt": "x", "size": 64}), 400, "size"),
    ("json size zero", "POST", CREATE, as_json({"prompt": "x", "size": 0}), 400, "size"),
    ("json seconds boolean", "POST", CREATE, as_json({"prompt": "x", "seconds": True}), 400, "seconds"),
    ("json num_frames fraction", "POST", CREATE, as_json({"prompt": "x", "num_frames": 5.5}), 400, "num_frames"),
    ("json sample_audio number", "POST", CREATE, as_json({"prompt": "x", "sample_audio": 2}), 400, "sample_audio"),
    (
        "json input_reference number",
        "POST",
        CREATE,
        as_json({"prompt": "x", "input_reference": 5}),
        400,
        "input_reference",
    ),
    (
        "json input_reference unknown key",
        "POST",
        CREATE,
        as_json({"prompt": "x", "input_reference": {"u": 1}}),
        400,
        "input_reference",
    ),
    (
        "json image_url number",
        "POST",
        CREATE,
        as_json({"prompt": "x", "input_reference": {"image_url": 5}}),
        400,
        "input_reference",
    ),
    ("declared 1 TB", "POST", CREATE, raw(b"{}", **{"content-length": str(10**12)}), 413, "request_too_large"),
    (
        "chunked 3 MiB",
        "POST",
        CREATE,
        raw((b"x" * 65536 for _ in range(48)), "multipart/form-data; boundary=zz"),
        413,
        "request_too_large",
    ),
    ("text/plain", "POST", CREATE, raw(b"prompt=a", "text/plain"), 415, "unsupported_media_type"),
    ("no content type", "POST", CREATE, raw(b"prompt=a", None), 415, "unsupported_media_type"),
    ("xml", "POST", CREATE, raw(b"<prompt>a</prompt>", "application/xml"), 415, "unsupported_media_type"),
    ("multipart without boundary", "POST", CREATE, raw(b"xx", "multipart/form-data"), 400, "invalid_multipart"),
    (
        "multipart garbage",
        "POST",
        CREATE,
        raw(b"\x00garbage", "multipart/form-data; boundary=zz"),
        400,
        "invalid_multipart",
    ),
    ("multipart 40 fields", "POST", CREATE, _many_fields(40), 400, "invalid_multipart"),
    (
        "multipart 3 files",
        "POST",
        CREATE,
        {"files": [(f"f{i}", ("a.png", b"x", "image/png")) for i in range(3)]},
        400,
        "invalid_multipart",
    ),
    (
        "multipart prompt twice",
        "POST",
        CREATE,
        {"files": [*form()["files"], ("prompt", (None, "a dog"))]},
        400,
        "prompt",
    ),
    ("multipart 1.5 MB text field", "POST", CREATE, form(prompt="x" * 1_500_000), 400, "invalid_multipart"),
    (
        "urlencoded 100 fields",
        "POST",
        CREATE,
        raw(b"&".join(b"a%d=1" % i for i in range(100)), "application/x-www-form-urlencoded"),
        400,
        "invalid_form",
    ),
    (
        "urlencoded bad utf-8",
        "POST",
        CREATE,
        raw(b"prompt=%ff%fe&size=big", "application/x-www-form-urlencoded"),
        400,
        "size",
    ),
    (
        "urlencoded 100k-char name",
        "POST",
        CREATE,
        raw(b"x" * 100_000 + b"=1", "application/x-www-form-urlencoded"),
        400,
        "unknown_parameter",
    ),
    # The original field matrix and more.
    ("prompt missing", "POST", CREATE, form(prompt=None), 400, "missing_required_parameter"),
    ("prompt empty", "POST", CREATE, form(prompt=""), 400, "prompt"),
    ("prompt blank", "POST", CREATE, form(prompt="   \n\t"), 400, "prompt"),
    ("prompt 10001 chars", "POST", CREATE, form(prompt="x" * 10_001), 400, "prompt"),
    ("negative_prompt 10001 chars", "POST", CREATE, form(negative_prompt="x" * 10_001), 400, "negative_prompt"),
    ("prompt as a file", "POST", CREATE, {"files": [("prompt", ("p.txt", b"a cat", "text/plain"))]}, 400, "prompt"),
    ("size 100x64", "POST", CREATE, form(size="100x64"), 400, "size"),
    ("size 64by64", "POST", CREATE, form(size="64by64"), 400, "size"),
    ("size over the maximum", "POST", CREATE, form(size="256x64"), 400, "size"),
    ("size 0x0", "POST", CREATE, form(size="0x0"), 400, "size"),
    ("size negative", "POST", CREATE, form(size="-64x64"), 400, "size"),
    ("size three numbers", "POST", CREATE, form(size="64x64x64"), 400, "size"),
    ("size 99999999x64", "POST", CREATE, form(size="99999999x64"), 400, "size"),
    ("size full-width digits", "POST", CREATE, form(size="６４x６４"), 400, "size"),
    ("size exponent", "POST", CREATE, form(size="1e2x64"), 400, "size"),
    ("seconds 0.3", "POST", CREATE, form(num_frames=None, seconds="0.3"), 400, "seconds"),
    ("seconds negative", "POST", CREATE, form(num_frames=None, seconds="-1"), 400, "seconds"),
    ("seconds over the maximum", "POST", CREATE, form(num_frames=None, seconds="4"), 400, "seconds"),
    ("seconds nan", "POST", CREATE, form(num_frames=None, seconds="nan"), 400, "seconds"),
    ("seconds inf", "POST", CREATE, form(num_frames=None, seconds="inf"), 400, "seconds"),
    ("seconds 1e308", "POST", CREATE, form(num_frames=None, seconds="1e308"), 400, "seconds"),
    ("seconds zero", "POST", CREATE, form(num_frames=None, seconds="0"), 400, "seconds"),
    ("seconds words", "POST", CREATE, form(num_frames=None, seconds="five"), 400, "seconds"),
    ("seconds 100 chars", "POST", CREATE, form(num_frames=None, seconds="5" + "0" * 99), 400, "seconds"),
    ("seconds hex", "POST", CREATE, form(num_frames=None, seconds="0x10"), 400, "seconds"),
    ("seconds and num_frames disagree", "POST", CREATE, form(seconds="0.5", num_frames="9"), 400, "num_frames"),
    ("num_frames 10", "POST", CREATE, form(num_frames="10"), 400, "num_frames"),
    ("num_frames over the maximum", "POST", CREATE, form(num_frames="37"), 400, "num_frames"),
    ("num_frames zero", "POST", CREATE, form(num_frames="0"), 400, "num_frames"),
    ("num_frames negative", "POST", CREATE, form(num_frames="-5"), 400, "num_frames"),
    ("num_frames exponent", "POST", CREATE, form(num_frames="1e3"), 400, "num_frames"),
    ("num_frames fraction", "POST", CREATE, form(num_frames="5.0"), 400, "num_frames"),
    ("num_frames 40 digits", "POST", CREATE, form(num_frames="9" * 40), 400, "num_frames"),
    ("steps zero", "POST", CREATE, form(num_inference_steps="0"), 400, "num_inference_steps"),
    ("steps over the maximum", "POST", CREATE, form(num_inference_steps="9"), 400, "num_inference_steps"),
    ("steps negative", "POST", CREATE, form(num_inference_steps="-1"), 400, "num_inference_steps"),
    ("steps fraction", "POST", CREATE, form(num_inference_steps="2.5"), 400, "num_inference_steps"),
    ("steps words", "POST", CREATE, form(num_inference_steps="two"), 400, "num_inference_steps"),
    ("guidance with a distilled checkpoint", "POST", CREATE, form(guidance_scale="5.0"), 400, "guidance_scale"),
    ("guidance nan", "POST", CREATE, form(guidance_scale="nan"), 400, "guidance_scale"),
    ("guidance inf", "POST", CREATE, form(guidance_scale="inf"), 400, "guidance_scale"),
    ("guidance -inf", "POST", CREATE, form(guidance_scale="-inf"), 400, "guidance_scale"),
    ("guidance 1e400", "POST", CREATE, form(guidance_scale="1e400"), 400, "guidance_scale"),
    ("guidance words", "POST", CREATE, form(guidance_scale="lots"), 400, "guidance_scale"),
    ("seed negative", "POST", CREATE, form(seed="-3"), 400, "seed"),
    ("seed 2**64", "POST", CREATE, form(seed=str(2**64)), 400, "seed"),
    ("seed fraction", "POST", CREATE, form(seed="1.5"), 400, "seed"),
    ("seed hex", "POST", CREATE, form(seed="0x10"), 400, "seed"),
    ("seed 40 digits", "POST", CREATE, form(seed="9" * 40), 400, "seed"),
    ("sample_audio maybe", "POST", CREATE, form(sample_audio="maybe"), 400, "sample_audio"),
    ("sample_audio 2", "POST", CREATE, form(sample_audio="2"), 400, "sample_audio"),
    ("model another", "POST", CREATE, form(model="sora-2"), 400, "model"),
    ("model empty", "POST", CREATE, form(model=""), 400, "model"),
    ("model 10001 chars", "POST", CREATE, form(model="m" * 10_001), 400, "model"),
    ("unknown parameter", "POST", CREATE, form(colour="red"), 400, "unknown_parameter"),
    ("unknown 1000-char parameter", "POST", CREATE, form(**{"k" * 1000: "1"}), 400, "unknown_parameter"),
    ("unknown __proto__", "POST", CREATE, form(__proto__="1"), 400, "unknown_parameter"),
    (
        "input_reference as text",
        "POST",
        CREATE,
        form(input_reference="http://example.com/a.png"),
        400,
        "input_reference",
    ),
    (
        "image_url over http",
        "POST",
        CREATE,
        form(**{"input_reference[image_url]": "http://x/a.png"}),
        400,
        "input_reference",
    ),
    (
        "image_url not base64",
        "POST",
        CREATE,
        form(**{"input_reference[image_url]": "data:image/png,abc"}),
        400,
        "input_reference",
    ),
    (
        "image_url bad base64",
        "POST",
        CREATE,
        form(**{"input_reference[image_url]": "data:image/png;base64,@@"}),
        400,
        "input_reference",
    ),
    (
        "image_url a BMP",
        "POST",
        CREATE,
        form(**{"input_reference[image_url]": data_url(image_bytes("BMP"))}),
        400,
        "invalid_image",
    ),
    (
        "image_url truncated PNG",
        "POST",
        CREATE,
        form(**{"input_reference[image_url]": data_url(_truncated_png())}),
        400,
        "invalid_image",
    ),
    ("file_id", "POST", CREATE, form(**{"input_reference[file_id]": "file_1"}), 400, "input_reference"),
    # Image uploads: only PNG, JPEG and WebP, by content; sizes from the header; pixels decoded last.
    *[
        (f"upload {fmt}", "POST", CREATE, upload(image_bytes(fmt), name="ref.png"), 400, "invalid_image")
        for fmt in (
            "BMP",
            "TIFF",
            "GIF",
            "ICO",
            "TGA",
            "PPM",
            "PCX",
            "SGI",
            "DDS",
            "QOI",
            "EPS",
            "PDF",
            "MSP",
            "XBM",
            "SPIDER",
            "JPEG2000",
            "ICNS",
            "PALM",
            "DIB",
            "AVIF",
        )
    ],
    ("upload PSD header", "POST", CREATE, upload(b"8BPS\x00\x01" + b"\x00" * 64), 400, "invalid_image"),
    (
        "upload SVG",
        "POST",
        CREATE,
        upload(b'<svg xmlns="http://www.w3.org/2000/svg"/>', ctype="image/svg+xml"),
        400,
        "invalid_image",
    ),
    ("upload HTML", "POST", CREATE, upload(b"<html><script>alert(1)</script></html>"), 400, "invalid_image"),
    ("upload ZIP", "POST", CREATE, upload(b"PK\x03\x04" + b"\x00" * 64), 400, "invalid_image"),
    ("upload empty", "POST", CREATE, upload(b""), 400, "invalid_image"),
    ("upload random bytes", "POST", CREATE, upload(np.random.default_rng(1).bytes(4096)), 400, "invalid_image"),
    (
        "upload PNG declaring 100000x100000",
        "POST",
        CREATE,
        upload(_png_declaring(100_000, 100_000)),
        400,
        "image_too_large",
    ),
    ("upload PNG declaring 7000x7000", "POST", CREATE, upload(_png_declaring(7000, 7000)), 400, "image_too_large"),
    ("upload PNG declaring 0x16", "POST", CREATE, upload(_png_declaring(0, 16)), 400, "invalid_image"),
    ("upload PNG with a zTXt bomb", "POST", CREATE, upload(_png_declaring(16, 16, _ZTXT_BOMB)), 400, "invalid_image"),
    (
        "upload JPEG declaring 65000x65000",
        "POST",
        CREATE,
        upload(_jpeg_declaring(65_000, 65_000)),
        400,
        "image_too_large",
    ),
    ("upload JPEG declaring 7000x7000", "POST", CREATE, upload(_jpeg_declaring(7000, 7000)), 400, "image_too_large"),
    (
        "upload WebP declaring a huge canvas",
        "POST",
        CREATE,
        upload(_webp_declaring_a_huge_canvas()),
        400,
        "image_too_large",
    ),
    ("upload truncated PNG", "POST", CREATE, upload(_truncated_png()), 400, "invalid_image"),
    ("upload over the limit", "POST", CREATE, upload(b"\x89PNG" + b"\x00" * (MAX_UPLOAD + 1)), 413, "file_too_large"),
    # The other routes.
    ("retrieve unknown id", "GET", f"{CREATE}/{VID}", {}, 404, "video_not_found"),
    ("retrieve malformed id", "GET", f"{CREATE}/nonsense", {}, 404, "video_not_found"),
    ("retrieve traversal", "GET", f"{CREATE}/..%2F..%2Fetc%2Fpasswd", {}, 404, "not_found"),
    ("retrieve NUL id", "GET", f"{CREATE}/video_%00", {}, 404, "video_not_found"),
    ("retrieve 10000-char id", "GET", f"{CREATE}/{'v' * 10_000}", {}, 404, "video_not_found"),
    ("content unknown id", "GET", f"{CREATE}/{VID}/content", {}, 404, "video_not_found"),
    ("content bad variant", "GET", f"{CREATE}/{VID}/content", {"params": {"variant": "spritesheet"}}, 400, "variant"),
    ("content unknown query", "GET", f"{CREATE}/{VID}/content", {"params": {"foo": "1"}}, 400, "foo"),
    ("delete unknown id", "DELETE", f"{CREATE}/{VID}", {}, 404, "video_not_found"),
    ("delete malformed id", "DELETE", f"{CREATE}/x'; DROP TABLE jobs;--", {}, 404, "video_not_found"),
    ("list limit 0", "GET", CREATE, {"params": {"limit": "0"}}, 400, "limit"),
    ("list limit 101", "GET", CREATE, {"params": {"limit": "101"}}, 400, "limit"),
    ("list limit words", "GET", CREATE, {"params": {"limit": "lots"}}, 400, "limit"),
    ("list limit exponent", "GET", CREATE, {"params": {"limit": "1e3"}}, 400, "limit"),
    ("list order sideways", "GET", CREATE, {"params": {"order": "sideways"}}, 400, "order"),
    ("list after unknown", "GET", CREATE, {"params": {"after": VID}}, 400, "after"),
    ("list unknown query", "GET", CREATE, {"params": {"colour": "red"}}, 400, "colour"),
    ("PUT videos", "PUT", CREATE, {}, 405, None),
    ("PATCH a video", "PATCH", f"{CREATE}/{VID}", {}, 405, None),
    ("POST a video", "POST", f"{CREATE}/{VID}", {}, 405, None),
    ("DELETE videos", "DELETE", CREATE, {}, 405, None),
    ("POST health", "POST", "/health", {}, 405, None),
    ("unknown route", "GET", "/v1/nowhere", {}, 404, "not_found"),
    ("deep route", "GET", f"{CREATE}/a/b/c", {}, 404, "not_found"),
    ("docs", "GET", "/docs", {}, 404, "not_found"),
    ("openapi", "GET", "/openapi.json", {}, 404, "not_found"),
    ("admin", "GET", "/admin", {}, 404, "not_found"),
    # Authentication.
    *[
        (f"{what} {method} {path}", method, path, {"auth": False, "headers": headers}, 401, "invalid_api_key")
        for what, headers in (
            ("no key", {}),
            ("wrong key", {"Authorization": "Bearer sk-wrong"}),
            ("basic auth", {"Authorization": f"Basic {KEY}"}),
            ("bare key", {"Authorization": KEY}),
        )
        for method, path in (("GET", CREATE), ("POST", CREATE), ("GET", "/metrics"), ("DELETE", f"{CREATE}/{VID}"))
    ],
]
