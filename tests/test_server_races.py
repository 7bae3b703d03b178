"""The server under races (issue 34): downloads while their job is deleted, and a body over the limit answered 413
rather than a closed connection, over a real uvicorn on 127.0.0.1 (the transport is what can cut a response or close
a connection under a client). Uploads held as their bytes while they wait: test_server_uploads.py.

The pipeline is the real tiny one; a dispatcher that stands in for the worker finishes each job at once with a
multi-megabyte file, so a download spans many chunks and the DELETE can land in the middle of one.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import random
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("fastapi")  # the server's extra (k6fast[serve]); a GPU machine without it skips this file
from server_testing import DEADLINE_S, check_error_body, internals_in, tiny_server_config, until

from k6fast.pipeline import Pipeline
from k6fast.server import app as app_module
from k6fast.server.app import create_app
from k6fast.server.body import FORM_OVERHEAD_BYTES
from k6fast.switches import Options

KEY = "sk-races"
KEEP_ALIVE_S = 1  # how long uvicorn keeps a connection after a response (5 s by default): short keeps tests short
AUTH = {"Authorization": f"Bearer {KEY}"}
FAST = {"prompt": "a red ball bouncing", "size": "64x64", "num_frames": "5", "num_inference_steps": "2", "seed": "1"}
VIDEO = np.random.default_rng(34).bytes(4 << 20)  # many 64 KiB chunks: a DELETE can land inside a download
THUMBNAIL = np.random.default_rng(35).bytes(1 << 20)


@pytest.fixture(scope="module")
def real_pipeline(tiny_distill: Path) -> Pipeline:
    return Pipeline(tiny_distill, Options(), device="cpu")


class FinishingDispatcher:
    """Stands in for the worker: each queued job is finished at once with VIDEO and THUMBNAIL as its files."""

    def __init__(self, store, files, pipeline, options, config, metrics):
        self.store, self.files, self.config = store, files, config
        self.current_job_id = None

    def start(self) -> None:
        pass

    def notify(self) -> None:
        while (job := self.store.claim_next()) is not None:
            self.files.folder(job.id, create=True)
            self.files.video(job.id).write_bytes(VIDEO)
            self.files.thumbnail(job.id).write_bytes(THUMBNAIL)
            assert self.store.complete(job.id, {}, self.config.ttl_seconds)

    def cancel(self, job_id: str) -> bool:
        return False

    def stop(self, timeout: float) -> bool:
        return True


@contextmanager
def uvicorn_on_loopback(app, http: str = "auto") -> Iterator[tuple[str, int]]:
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http=http, timeout_keep_alive=KEEP_ALIVE_S))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        until(lambda: server.started and app.state.k6.ready.is_set(), "uvicorn to start")
        yield sock.getsockname()
    finally:
        server.should_exit = True
        thread.join(DEADLINE_S)
        sock.close()


@pytest.fixture(scope="module")
def finishing_server(tmp_path_factory, real_pipeline) -> Iterator[SimpleNamespace]:
    root = tmp_path_factory.mktemp("races")
    config = tiny_server_config(root / "data", max_queue=4)
    app = create_app(config, Options(api_key=KEY), load=lambda: real_pipeline, dispatcher=FinishingDispatcher)
    with uvicorn_on_loopback(app) as address:
        yield SimpleNamespace(address=address, state=app.state.k6)


def _exchange(address, talk) -> tuple[int | str, bytes]:
    """`talk(conn)` on a fresh connection, returning (status, body); ("cut", what arrived) when the response broke off
    or the connection was reset."""
    conn = http.client.HTTPConnection(*address, timeout=DEADLINE_S)
    try:
        return talk(conn)
    except http.client.IncompleteRead as exc:
        return "cut", exc.partial
    except (ConnectionError, http.client.RemoteDisconnected) as exc:
        return "cut", repr(exc).encode()
    finally:
        conn.close()


def _call(address, method: str, path: str, body: dict | None = None) -> tuple[int | str, bytes]:
    """(status, body) of one request on its own connection (see `_exchange`)."""

    def talk(conn):
        headers = dict(AUTH)
        if body is not None:
            headers["Content-Type"] = "application/json"
        conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
        response = conn.getresponse()
        return response.status, response.read()

    return _exchange(address, talk)


def _finished_video(address) -> str:
    status, body = _call(address, "POST", "/v1/videos", FAST)
    assert status == 200, body
    video = json.loads(body)
    assert video["status"] == "queued"
    status, body = _call(address, "GET", f"/v1/videos/{video['id']}")
    assert status == 200 and json.loads(body)["status"] == "completed", body
    return video["id"]


def _check_gone(status, body: bytes) -> None:
    assert status == 404, (status, body[:300])
    error = check_error_body(json.loads(body))
    assert error["code"] == "video_not_found" and not internals_in(error["message"]), error


# ------------------------------------------------------------------------------------------------------------------
# Finding 3: DELETE racing downloads
# ------------------------------------------------------------------------------------------------------------------

ROUNDS = 20
RACING = 6  # downloads that start within a few milliseconds of the DELETE, on both sides of it
HELD = 3  # downloads that have their headers and first bytes before the DELETE and read the rest after it


def _held_download(address, path: str, started: threading.Barrier, deleted: threading.Event) -> tuple:
    """A download that has begun (status line, headers and its first 64 KiB read) before the DELETE is sent, and
    reads the rest once the DELETE has answered."""

    def talk(conn):
        conn.request("GET", path, headers=AUTH)
        response = conn.getresponse()
        first = response.read(64 << 10) if response.status == 200 else b""
        started.wait(DEADLINE_S)
        assert deleted.wait(DEADLINE_S)
        return response.status, first + response.read()

    return _exchange(address, talk)


def _racing_download(address, path: str, go: threading.Event, delay_s: float, variant: str) -> tuple:
    """A download that starts `delay_s` after `go`, about when the DELETE is sent."""
    go.wait(DEADLINE_S)
    time.sleep(delay_s)
    return variant, *_call(address, "GET", path)


def test_downloads_racing_a_delete_are_whole_or_404(finishing_server) -> None:
    address, rng = finishing_server.address, random.Random(34)
    problems: list[str] = []
    statuses: list[int | str] = []
    with concurrent.futures.ThreadPoolExecutor(HELD + RACING) as pool:
        for round_ in range(ROUNDS):
            video_id = _finished_video(address)
            paths = {
                "video": f"/v1/videos/{video_id}/content",
                "thumbnail": f"/v1/videos/{video_id}/content?variant=thumbnail",
            }
            started, deleted, go = threading.Barrier(HELD + 1), threading.Event(), threading.Event()
            held = [pool.submit(_held_download, address, paths["video"], started, deleted) for _ in range(HELD)]
            started.wait(DEADLINE_S)

            variants = ["thumbnail" if i % 3 == 0 else "video" for i in range(RACING)]
            racers = [
                pool.submit(_racing_download, address, paths[variant], go, rng.uniform(0, 0.004), variant)
                for variant in variants
            ]
            go.set()
            time.sleep(0.001)
            status, body = _call(address, "DELETE", f"/v1/videos/{video_id}")
            assert status == 200, body
            deleted.set()
            late = _call(address, "GET", paths["video"])
            results = [("video (begun before)", *future.result()) for future in held]
            results += [future.result() for future in racers]
            for variant, status, body in results:
                statuses.append(status)
                whole = VIDEO if variant.startswith("video") else THUMBNAIL
                if status == 200 and body != whole:
                    problems.append(f"round {round_}: a {variant} download got {len(body)} of {len(whole)} bytes")
                elif status == 404 and not variant.endswith("(begun before)"):
                    _check_gone(status, body)
                elif status != 200:
                    problems.append(f"round {round_}: a {variant} download ended {status}: {body[:200]!r}")
            _check_gone(*late)
    assert not problems, f"{len(problems)} of {len(statuses)} downloads went wrong: " + "; ".join(problems[:5])
    assert statuses.count(200) >= ROUNDS * HELD, statuses


@pytest.mark.parametrize("when", ["before the open", "after the open"])
def test_a_delete_between_lookup_and_stream(finishing_server, monkeypatch, when) -> None:
    """The two windows made certain: the DELETE lands after the download found its job, just before or just after
    the download opens the file."""
    address, real_open = finishing_server.address, app_module.open_file
    video_id = _finished_video(address)

    def open_with_a_delete(path):
        if when == "before the open":
            assert _call(address, "DELETE", f"/v1/videos/{video_id}")[0] == 200
        opened = real_open(path)
        if when == "after the open":
            assert _call(address, "DELETE", f"/v1/videos/{video_id}")[0] == 200
            assert not path.exists()
        return opened

    monkeypatch.setattr(app_module, "open_file", open_with_a_delete)
    status, body = _call(address, "GET", f"/v1/videos/{video_id}/content")
    if when == "before the open":
        _check_gone(status, body)
    else:
        assert status == 200 and body == VIDEO, (status, len(body))
    assert _call(address, "GET", f"/v1/videos/{video_id}")[0] == 404


def test_ranges_are_served_from_the_open_file(finishing_server) -> None:
    address = finishing_server.address
    video_id = _finished_video(address)
    path = f"/v1/videos/{video_id}/content"
    conn = http.client.HTTPConnection(*address, timeout=DEADLINE_S)
    try:
        for header, status, want in [
            ("bytes=100-199", 206, VIDEO[100:200]),
            ("bytes=-10", 206, VIDEO[-10:]),
            (f"bytes={len(VIDEO) - 5}-", 206, VIDEO[-5:]),
            ("bytes=0-9, 20-29", 200, VIDEO),  # several ranges: the whole file
            (f"bytes={len(VIDEO)}-", 416, b""),
        ]:
            conn.request("GET", path, headers={**AUTH, "Range": header})
            response = conn.getresponse()
            body = response.read()
            if status == 416:
                assert check_error_body(json.loads(body))["code"] == "range_not_satisfiable"
                body = b""
            assert (response.status, body) == (status, want), (header, response.status, len(body))
            if status == 206:
                start = len(VIDEO) - len(want) if header.startswith("bytes=-") else int(header[6:].split("-")[0])
                assert response.getheader("content-range") == f"bytes {start}-{start + len(want) - 1}/{len(VIDEO)}"
        conn.request("GET", path, headers=AUTH)
        response = conn.getresponse()
        assert response.read() == VIDEO and response.getheader("content-length") == str(len(VIDEO))
        assert response.getheader("content-type") == "video/mp4"
        assert response.getheader("content-disposition") == f'attachment; filename="{video_id}.mp4"'
    finally:
        conn.close()


# ------------------------------------------------------------------------------------------------------------------
# Finding 7: a body over the limit (uploads held as their bytes: test_server_uploads.py)
# ------------------------------------------------------------------------------------------------------------------


OVERSIZED_BODY_BYTES = 25_000_000  # over the default limit of 20 MiB and 1 MiB of form fields, under twice that


@pytest.fixture(scope="module", params=["h11", "httptools"])
def each_http(request, tmp_path_factory, real_pipeline) -> Iterator[SimpleNamespace]:
    """The server on each of uvicorn's HTTP implementations: h11 (what `pip install k6fast[serve]` gets) and
    httptools (uvicorn[standard], chosen where it is installed)."""
    if request.param == "httptools":
        pytest.importorskip("httptools")
    config = tiny_server_config(tmp_path_factory.mktemp("http") / "data")
    app = create_app(config, Options(api_key=KEY), load=lambda: real_pipeline, dispatcher=FinishingDispatcher)
    with uvicorn_on_loopback(app, http=request.param) as address:
        yield SimpleNamespace(address=address, limit=config.max_upload_bytes + FORM_OVERHEAD_BYTES)


def _head(framing: str) -> bytes:
    length = "Transfer-Encoding: chunked" if framing == "chunked" else f"Content-Length: {OVERSIZED_BODY_BYTES}"
    return (
        f"POST /v1/videos HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\n{length}\r\n\r\n"
    ).encode()


def _send_body(conn: socket.socket, framing: str, pause_after: int | None = None, pause_s: float = 0.0) -> str:
    """Sends OVERSIZED_BODY_BYTES of JSON body in 64 KiB pieces, pausing `pause_s` once more than `pause_after` bytes
    are sent; "sent", or the error that stopped it (the server closed the connection)."""
    piece, sent = b" " * (64 << 10), 0
    try:
        while sent < OVERSIZED_BODY_BYTES:
            data = piece[: OVERSIZED_BODY_BYTES - sent]
            conn.sendall(b"%x\r\n%s\r\n" % (len(data), data) if framing == "chunked" else data)
            if pause_after is not None and sent <= pause_after < sent + len(data):
                time.sleep(pause_s)
            sent += len(data)
        if framing == "chunked":
            conn.sendall(b"0\r\n\r\n")
    except OSError as exc:
        return f"{type(exc).__name__} after {sent} bytes"
    return "sent"


def _one_response(conn: socket.socket) -> bytes:
    """The status line, headers and body (by its Content-Length) of the next response; a reset raises."""
    received = b""
    while b"\r\n\r\n" not in received:
        received += conn.recv(65536) or pytest.fail(f"the connection closed after {received[:300]!r}")
    head, _, body = received.partition(b"\r\n\r\n")
    length = int(next(line for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:"))[15:])
    while len(body) < length:
        body += conn.recv(65536) or pytest.fail(f"the connection closed after {received[:300]!r}")
    return head + b"\r\n\r\n" + body


def _check_413(response: bytes) -> None:
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 "), response[:300]
    error = check_error_body(json.loads(body))
    assert error["code"] == "request_too_large" and not internals_in(error["message"]), error


@pytest.mark.parametrize("framing", ["chunked", "content-length"])
def test_an_oversized_body_gets_413_while_the_client_sends(each_http, framing) -> None:
    """A client that reads while it sends."""
    with socket.create_connection(each_http.address, timeout=DEADLINE_S) as conn:
        conn.sendall(_head(framing))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            sent = pool.submit(_send_body, conn, framing)
            response = _one_response(conn)
            assert sent.result() == "sent"
    _check_413(response)


@pytest.mark.parametrize("framing", ["chunked", "content-length"])
def test_a_client_that_pauses_and_reads_only_after_sending_gets_its_413(each_http, framing) -> None:
    """A client that sends the whole body before it reads (as most HTTP libraries do), and pauses just past the limit
    for longer than uvicorn's keep-alive (a slow source, a busy machine): it can send the rest and read the 413, and
    the connection stays usable."""
    with socket.create_connection(each_http.address, timeout=DEADLINE_S) as conn:
        conn.sendall(_head(framing))
        sent = _send_body(conn, framing, pause_after=each_http.limit, pause_s=2 * KEEP_ALIVE_S)
        assert sent == "sent", f"the server closed the connection while the body was being sent: {sent}"
        _check_413(_one_response(conn))
        conn.sendall(f"GET /v1/videos HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
        assert _one_response(conn).startswith(b"HTTP/1.1 200 ")


def test_a_body_far_over_the_limit_is_refused_at_once(each_http) -> None:
    """Declared at more than twice the limit: not worth reading, so the 413 comes before the body and the server
    closes the connection after it."""
    with socket.create_connection(each_http.address, timeout=DEADLINE_S) as conn:
        head = _head("content-length").replace(b"%d" % OVERSIZED_BODY_BYTES, b"%d" % (10 * OVERSIZED_BODY_BYTES))
        conn.sendall(head)
        response = _one_response(conn)
        assert conn.recv(1) == b""
    _check_413(response)
    assert b"\r\nconnection: close" in response.lower()
