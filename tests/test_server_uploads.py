"""Uploads kept as their encoded bytes until their job starts (issue 34, finding 7): what a queued job holds in
memory, the pixel check the upload still gets (bounded memory, in agreement with Pillow's decoder), and the decode
when the job starts (the worker's and the Ray replica's `request_from_spec`).

In-process (FastAPI's TestClient): the transport plays no part. The pipeline is the real tiny one behind a gate.
"""

from __future__ import annotations

import concurrent.futures
import io
import os
import struct
import tracemalloc
import zlib
from pathlib import Path

import PIL.Image
import pytest

pytest.importorskip("fastapi")  # the server's extra (k6fast[serve]); a GPU machine without it skips this file
from fastapi.testclient import TestClient  # noqa: E402
from server_testing import DEADLINE_S, GatedPipeline, PeakRss, check_error_body, tiny_server_config, until

from k6fast.pipeline import Pipeline
from k6fast.request import Request
from k6fast.server.app import create_app
from k6fast.server.errors import ApiError
from k6fast.server.images import check_pixels, open_image
from k6fast.server.jobs import JobSpec
from k6fast.server.worker import InputUnreadable, request_from_spec
from k6fast.switches import Options

FAST = {"prompt": "a red ball bouncing", "size": "64x64", "num_frames": "5", "num_inference_steps": "2", "seed": "1"}


@pytest.fixture(scope="module")
def real_pipeline(tiny_distill: Path) -> Pipeline:
    return Pipeline(tiny_distill, Options(), device="cpu")


def _encoded(fmt: str, size: tuple[int, int], **params) -> bytes:
    buffer = io.BytesIO()
    PIL.Image.new("RGB", size, (200, 40, 90)).save(buffer, format=fmt, **params)
    return buffer.getvalue()


# ------------------------------------------------------------------------------------------------------------------
# What a queued upload costs
# ------------------------------------------------------------------------------------------------------------------


def _png(size: tuple[int, int], colour=(200, 40, 90)) -> bytes:
    buffer = io.BytesIO()
    PIL.Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def _upload(data: bytes, name: str = "ref.png", ctype: str = "image/png") -> dict:
    return {"files": [*[(k, (None, v)) for k, v in FAST.items()], ("input_reference", (name, data, ctype))]}


# Ten 6000x6000 uploads decoded would be over 1 GiB (103 MiB each as RGB); kept as their bytes they are 1 MiB.
QUEUED_UPLOADS = 10
QUEUED_RSS_BOUND = 50 << 20


def test_queued_uploads_are_held_as_their_bytes(tmp_path, real_pipeline) -> None:
    big_png = _png((6000, 6000))  # 36 MP, about 100 KB
    assert len(big_png) < 150_000
    gated = GatedPipeline(real_pipeline)
    gated.gate.clear()
    config = tiny_server_config(tmp_path / "data", max_queue=QUEUED_UPLOADS + 3, max_upload_bytes=1 << 20)
    app = create_app(config, Options(), load=lambda: gated)
    with TestClient(app) as client:
        until(lambda: client.get("/health").status_code == 200, "the server to be ready")
        assert client.post("/v1/videos", data=FAST).status_code == 200  # runs and waits at the gate
        assert gated.waiting.wait(DEADLINE_S)

        def send(_: int):
            return client.post("/v1/videos", **_upload(big_png))

        with concurrent.futures.ThreadPoolExecutor(QUEUED_UPLOADS) as pool:
            list(pool.map(send, range(2)))  # warm the request path once (thread pools, parsers) before measuring
            with PeakRss() as rss:
                responses = list(pool.map(send, range(QUEUED_UPLOADS)))
        assert [r.status_code for r in responses] == [200] * QUEUED_UPLOADS, responses[0].text
        assert all(r.json()["status"] == "queued" for r in responses)
        for response in responses:  # what waits is the upload as sent, not a decoded or re-encoded image
            assert client.app.state.k6.files.input_image(response.json()["id"]).read_bytes() == big_png
        grown, peak = (rss.end - rss.start) / 2**20, (rss.peak - rss.start) / 2**20
        assert rss.peak - rss.start <= QUEUED_RSS_BOUND, f"RSS peaked {peak:.0f} MiB up (now {grown:.0f} MiB up)"


def test_a_queued_jpeg_is_decoded_when_its_job_runs(tmp_path, real_pipeline) -> None:
    jpeg = _encoded("JPEG", (96, 80))
    app = create_app(tiny_server_config(tmp_path / "data", poll_after_ms=50), Options(), load=lambda: real_pipeline)
    with TestClient(app) as client:
        until(lambda: client.get("/health").status_code == 200, "the server to be ready")
        created = client.post("/v1/videos", **_upload(jpeg, "ref.jpg", "image/jpeg"))
        assert created.status_code == 200, created.text
        video_id = created.json()["id"]
        done = until(
            lambda: (v := client.get(f"/v1/videos/{video_id}").json())["status"] in ("completed", "failed") and v,
            "the job to finish",
        )
        assert done["status"] == "completed", done["error"]
        # Removed once the job is recorded completed (after, so that a crash in between re-runs it with its input).
        until(lambda: not client.app.state.k6.files.input_image(video_id).exists(), "the input to be removed")


# ------------------------------------------------------------------------------------------------------------------
# The pixel check at the upload, and the decode at the start
# ------------------------------------------------------------------------------------------------------------------

_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _raw_png(width: int, height: int, colour: int, depth: int, interlaced: bool, damage: str) -> bytes:
    """A PNG written row by row (Pillow writes neither Adam7 nor most depths): filter byte 0 and zero samples, each
    pass's rows and columns counted as the pass visits them; damaged by `damage`."""
    rows = []
    for x0, y0, dx, dy in _ADAM7 if interlaced else ((0, 0, 1, 1),):
        columns = len(range(x0, width, dx))
        if columns:
            rows += [b"\x00" + bytes((columns * _CHANNELS[colour] * depth + 7) // 8)] * len(range(y0, height, dy))
    idat = zlib.compress(b"".join(rows[:-1] if damage == "a row short" else rows))
    if damage == "stream cut":
        idat = idat[: len(idat) - 6]
    ihdr = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, int(interlaced))
    palette = _chunk(b"PLTE", bytes(3 * 16)) if colour == 3 else b""
    # Two IDAT chunks: a decoder must join them.
    body = _chunk(b"IDAT", idat[: len(idat) // 2]) + _chunk(b"IDAT", idat[len(idat) // 2 :])
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + palette + body + _chunk(b"IEND", b"")


def _pillow_decodes(data: bytes) -> bool:
    try:
        with PIL.Image.open(io.BytesIO(data)) as image:
            image.load()
    except (OSError, SyntaxError, ValueError):
        return False
    return True


def _check_passes(data: bytes) -> bool:
    try:
        check_pixels(open_image(data))
    except ApiError as exc:
        assert check_error_body(exc.body())["code"] == "invalid_image"
        return False
    return True


@pytest.mark.parametrize(
    ("colour", "depth", "interlaced"),
    [(2, 8, False), (2, 8, True), (6, 16, True), (0, 1, False), (0, 1, True), (3, 4, True), (4, 8, False)],
)
@pytest.mark.parametrize(("damage", "decodes"), [("none", True), ("a row short", True), ("stream cut", False)])
def test_the_png_check_agrees_with_pillow(colour, depth, interlaced, damage, decodes) -> None:
    """Pillow decodes a stream that ends a row short (the row black) and refuses one cut off: so does the check."""
    data = _raw_png(13, 7, colour, depth, interlaced, damage)
    assert _pillow_decodes(data) == decodes
    assert _check_passes(data) == decodes


def _damaged(data: bytes, how: str) -> bytes:
    if how == "truncated":
        return data[: len(data) * 2 // 3]
    if how == "a flipped byte in the pixel data":
        at = data.index(b"IDAT") + 4 if data.startswith(b"\x89PNG") else len(data) // 2
        return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]
    raise ValueError(how)


@pytest.mark.parametrize("how", ["truncated", "a flipped byte in the pixel data"])
def test_a_damaged_png_is_refused_at_the_upload(how) -> None:
    noise = PIL.Image.frombytes("RGB", (64, 48), os.urandom(64 * 48 * 3))
    buffer = io.BytesIO()
    noise.save(buffer, format="PNG")
    data = _damaged(buffer.getvalue(), how)
    assert not _pillow_decodes(data)
    with pytest.raises(ApiError, match="truncated or corrupt"):
        check_pixels(open_image(data))


def test_a_truncated_baseline_jpeg_is_refused_at_the_upload() -> None:
    noise = PIL.Image.frombytes("RGB", (256, 192), os.urandom(256 * 192 * 3))
    buffer = io.BytesIO()
    noise.save(buffer, format="JPEG")
    whole = buffer.getvalue()
    check_pixels(open_image(whole))
    with pytest.raises(ApiError, match="truncated or corrupt"):
        check_pixels(open_image(whole[: len(whole) * 2 // 3]))


def test_the_png_check_holds_little_memory() -> None:
    upload = open_image(_encoded("PNG", (6000, 6000)))  # 103 MiB of pixel stream
    tracemalloc.start()
    try:
        check_pixels(upload)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"the check held {peak / 2**20:.1f} MiB"


SPEC = JobSpec(Request(prompt="a bell", width=64, height=64, frames=5, steps=2, guidance=1.0, seed=3), "0.167", True)


@pytest.mark.parametrize(("fmt", "params"), [("PNG", {}), ("JPEG", {}), ("JPEG", {"progressive": True}), ("WEBP", {})])
def test_the_stored_upload_is_decoded_when_the_job_starts(fmt, params) -> None:
    request = request_from_spec(SPEC, _encoded(fmt, (40, 30), **params))
    assert request.image.mode == "RGB" and request.image.size == (40, 30)
    assert max(abs(a - b) for a, b in zip(request.image.getpixel((20, 15)), (200, 40, 90), strict=True)) <= 8


def test_what_the_upload_check_leaves_fails_the_job_as_invalid_input() -> None:
    """A progressive JPEG is checked when its job starts: cut short, the job fails as its input's fault."""
    data = _encoded("JPEG", (256, 192), progressive=True)
    check_pixels(open_image(data[: len(data) // 2]))  # accepted at the upload, by design
    with pytest.raises(InputUnreadable):
        request_from_spec(SPEC, data[: len(data) // 2])
    with pytest.raises(InputUnreadable):
        request_from_spec(SPEC, None)
