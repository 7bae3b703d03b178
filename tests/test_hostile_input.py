"""Hostile input against the server, as an attacker or a confused client would send it: over a hundred malformed,
oversized, mistyped and unauthorised requests (hostile_cases.py: the body limits, the image formats, the field
matrix, the other routes), each answered with a 4xx in OpenAI's error shape, with nothing of the server's insides in
the body, no job and no file created, and the server alive afterwards. Plus the upload-memory case (a request that
ends in 429 never decodes its upload; the process's peak RSS stays within a stated bound) and, on a real uvicorn where
the transport matters, the body-read timeout for a client that stops sending and one that sends too slowly.

In-process (FastAPI's TestClient) except the uvicorn cases; the real tiny pipeline behind a closed gate, so no job
runs while the suite probes.
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import PIL.Image
import pytest

pytest.importorskip("fastapi")  # the server's extra (k6fast[serve]); a GPU machine without it skips this file
from fastapi.testclient import TestClient  # noqa: E402
from hostile_cases import AUTH, CASES, KEY, MAX_UPLOAD, form, image_bytes, upload
from server_testing import (
    DEADLINE_S,
    GatedPipeline,
    PeakRss,
    check_error_body,
    internals_in,
    tiny_server_config,
    until,
)

from k6fast.pipeline import Pipeline
from k6fast.server import app as app_module
from k6fast.server.app import create_app
from k6fast.server.config import ServerConfig
from k6fast.switches import Options

# ------------------------------------------------------------------------------------------------------------------
# The server under test
# ------------------------------------------------------------------------------------------------------------------


def _config(data_dir: Path, **changes) -> ServerConfig:
    return tiny_server_config(data_dir, **({"max_upload_bytes": MAX_UPLOAD, "body_timeout_s": 1.0} | changes))


@pytest.fixture(scope="module")
def real_pipeline(tiny_distill: Path) -> Pipeline:
    return Pipeline(tiny_distill, Options(), device="cpu")


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory, real_pipeline: Pipeline) -> Iterator[SimpleNamespace]:
    root = tmp_path_factory.mktemp("hostile")
    gated = GatedPipeline(real_pipeline)
    gated.gate.clear()  # nothing may run; nothing should be queued either
    app = create_app(_config(root / "data"), Options(api_key=KEY), load=lambda: gated)
    # raise_server_exceptions=False: a 500 must come back as the response a client would see, not as a test error.
    with TestClient(app, raise_server_exceptions=False) as client:
        until(lambda: client.get("/health").status_code == 200, "the server to be ready")
        yield SimpleNamespace(client=client, state=client.app.state.k6, root=root)
        gated.gate.set()


def _leaks(text: str, root: Path) -> list[str]:
    found = internals_in(text)
    if str(root) in text:
        found.append(str(root))
    return found


def test_the_suite_is_over_a_hundred_requests() -> None:
    assert len(CASES) >= 100 and len({name for name, *_ in CASES}) == len(CASES)


@pytest.mark.parametrize(("name", "method", "path", "request_", "status", "why"), CASES, ids=[c[0] for c in CASES])
def test_hostile_request_gets_a_clean_4xx(hostile, name, method, path, request_, status, why) -> None:
    request_ = dict(request_)
    headers = {**({} if request_.pop("auth", True) is False else AUTH), **request_.pop("headers", {})}
    response = hostile.client.request(method, path, headers=headers, **request_)
    assert response.status_code == status, (response.status_code, response.text[:500])
    assert response.headers["content-type"].startswith("application/json")
    error = check_error_body(response.json())
    assert why is None or why in (error["code"], error["param"]), error
    assert not _leaks(response.text, hostile.root), (_leaks(response.text, hostile.root), response.text[:500])
    assert len(error["message"]) < 600, "a message says what was wrong, it does not echo the request"
    state = hostile.state
    assert state.store.counts()["queued"] == 0 and list(state.files.root.iterdir()) == [], "nothing was created"
    assert hostile.client.get("/health").json() == {"status": "ok"}, "alive, and /health without a key says no more"


def test_alive_and_serving_after_the_suite(hostile) -> None:
    health = hostile.client.get("/health", headers=AUTH).json()
    assert health["status"] == "ok" and health["model"] == "k6-tiny", "with the key, /health gives the details"
    response = hostile.client.post("/v1/videos", headers=AUTH, **form())
    assert response.status_code == 200 and response.json()["status"] == "queued", response.text
    assert hostile.client.delete(f"/v1/videos/{response.json()['id']}", headers=AUTH).json()["deleted"]


def test_a_client_that_hangs_up_mid_body_gets_a_400_not_a_logged_error(hostile, caplog) -> None:
    import asyncio

    incoming = [
        {"type": "http.request", "body": b'{"prompt": "a ca', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict] = []

    async def receive() -> dict:
        return incoming.pop(0)

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/videos",
        "raw_path": b"/v1/videos",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"localhost"),
            (b"authorization", f"Bearer {KEY}".encode()),
            (b"content-type", b"application/json"),
            (b"content-length", b"100"),
        ],
        "client": ("127.0.0.1", 1234),
        "server": ("127.0.0.1", 80),
        "state": {},
    }
    asyncio.run(hostile.client.app(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 400
    assert check_error_body(json.loads(sent[1]["body"]))["code"] == "incomplete_body"
    assert "unhandled error" not in caplog.text


def test_an_unexpected_error_is_a_500_that_names_only_an_error_id(hostile, monkeypatch, caplog) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError(f"disk on fire at {hostile.root} <object at 0x7f00deadbeef>")

    monkeypatch.setattr(hostile.state.store, "page", broken)
    response = hostile.client.get("/v1/videos", headers=AUTH)
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert not _leaks(response.text, hostile.root) and "fire" not in response.text, response.text
    error_id = error["message"].rsplit("(", 1)[1].rstrip(")")
    assert error_id.startswith("err_") and error_id in caplog.text and "disk on fire" in caplog.text


# ------------------------------------------------------------------------------------------------------------------
# Uploads and memory
# ------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def big_png() -> bytes:
    """102 KB on the wire, 6000x6000 (36 MP: under the 40 MP cap) once decoded: 103 MiB as RGB."""
    buffer = io.BytesIO()
    PIL.Image.new("RGB", (6000, 6000), (200, 40, 90)).save(buffer, format="PNG")
    return buffer.getvalue()


# A request refused with 429 must not decode its upload: ten decoded 6000x6000 images would be over 1 GiB, one alone
# 103 MiB. What the bound leaves room for: ten 120 kB bodies read and parsed at once, and the threads serving them.
UPLOAD_RSS_BOUND = 48 << 20


def test_uploads_to_a_full_queue_are_refused_before_decoding(tmp_path, real_pipeline, big_png, monkeypatch) -> None:
    decoded = []
    real_check = app_module.check_pixels
    monkeypatch.setattr(app_module, "check_pixels", lambda upload: decoded.append(upload.width) or real_check(upload))
    gated = GatedPipeline(real_pipeline)
    gated.gate.clear()
    app = create_app(_config(tmp_path / "data"), Options(), load=lambda: gated)
    with TestClient(app) as client:
        until(lambda: client.get("/health").status_code == 200, "the server to be ready")
        # One running (held at the gate), then two waiting: the queue is full. The worker takes the first job before
        # the others are sent: three sent at once may all still be waiting on a busy machine, and the third refused.
        assert client.post("/v1/videos", **form()).status_code == 200
        assert gated.waiting.wait(DEADLINE_S)
        for _ in range(2):
            assert client.post("/v1/videos", **form()).status_code == 200
        assert len(big_png) < 150_000

        def send(_: int):
            return client.post("/v1/videos", **upload(big_png))

        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            list(pool.map(send, range(2)))  # warm the request path once (thread pools, parsers) before measuring
            with PeakRss() as rss:
                responses = list(pool.map(send, range(10)))
        assert [r.status_code for r in responses] == [429] * 10, responses[0].text
        assert all(r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"] for r in responses)
        assert decoded == [], "no refused upload had its pixels read"
        assert rss.growth < UPLOAD_RSS_BOUND, f"peak RSS grew by {rss.growth / 2**20:.0f} MiB"


def test_accepted_uploads_are_stored_as_sent(tmp_path, real_pipeline) -> None:
    """The job waits with the upload's own bytes (decoded when it starts, see test_server_uploads.py), whatever its
    format: nothing decoded or re-encoded at the upload."""
    gated = GatedPipeline(real_pipeline)
    gated.gate.clear()
    app = create_app(_config(tmp_path / "data", max_queue=8), Options(), load=lambda: gated)
    uploads = [image_bytes(fmt, (512, 512)) for fmt in ("PNG", "JPEG", "WEBP", "PNG")]
    with TestClient(app) as client:
        until(lambda: client.get("/health").status_code == 200, "the server to be ready")
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            responses = list(pool.map(lambda data: client.post("/v1/videos", **upload(data)), uploads))
        assert [r.status_code for r in responses] == [200] * 4, responses[0].text
        for data, response in zip(uploads, responses, strict=True):
            assert client.app.state.k6.files.input_image(response.json()["id"]).read_bytes() == data


# ------------------------------------------------------------------------------------------------------------------
# On a real uvicorn: the body-read timeout
# ------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def uvicorn_server(tmp_path_factory, real_pipeline) -> Iterator[tuple[str, int]]:
    import uvicorn

    root = tmp_path_factory.mktemp("uvicorn")
    gated = GatedPipeline(real_pipeline)
    gated.gate.clear()
    app = create_app(_config(root / "data"), Options(api_key=KEY), load=lambda: gated)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    address = sock.getsockname()
    try:
        until(lambda: server.started and app.state.k6.ready.is_set(), "uvicorn to start")
        yield address
    finally:
        gated.gate.set()
        server.should_exit = True
        thread.join(DEADLINE_S)
        sock.close()


def _head(declared: int) -> bytes:
    return (
        f"POST /v1/videos HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n"
    ).encode()


def _read_until_closed(conn: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed (s after the call)."""
    started, received = time.monotonic(), b""
    conn.settimeout(limit_s)
    while True:
        chunk = conn.recv(65536)
        if not chunk:
            return received, time.monotonic() - started
        received += chunk


def _check_408(received: bytes) -> None:
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), received[:300]
    error = check_error_body(json.loads(body))
    assert error["code"] == "request_timeout" and not internals_in(body.decode())


def test_a_body_that_stops_arriving_times_out(uvicorn_server) -> None:
    with socket.create_connection(uvicorn_server, timeout=DEADLINE_S) as conn:
        conn.sendall(_head(10) + b"{}")  # declares 10 bytes, sends 2, then nothing
        received, after = _read_until_closed(conn, limit_s=15.0)
    _check_408(received)
    assert after < 10.0, f"the connection was held {after:.1f} s with a 1 s body timeout"


def test_a_body_sent_too_slowly_times_out(uvicorn_server) -> None:
    with socket.create_connection(uvicorn_server, timeout=DEADLINE_S) as conn:
        conn.sendall(_head(1000))
        stop = threading.Event()

        def drip() -> None:  # one byte every 100 ms: never idle for long, but 1000 bytes would take 100 s
            try:
                while not stop.wait(0.1):
                    conn.sendall(b" ")
            except OSError:  # the server closed the connection: what the test waits for
                pass

        dripper = threading.Thread(target=drip, daemon=True)
        dripper.start()
        try:
            received, after = _read_until_closed(conn, limit_s=15.0)
        finally:
            stop.set()
            dripper.join(5)
    _check_408(received)
    assert after < 10.0, f"a slow body held the connection {after:.1f} s with a 1 s body timeout"
    with socket.create_connection(uvicorn_server, timeout=5) as conn:  # and the server still answers
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        answer, _ = _read_until_closed(conn, limit_s=5.0)
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"status":"ok"}')
