"""The /v1/videos API in-process (FastAPI's TestClient) on the tiny checkpoint: the bad-input matrix, auth, the
bounded queue, cancellation, failure isolation, expiry and metrics. The real-uvicorn, SDK and SIGKILL tests are in
test_server_e2e.py.

The pipeline is the real tiny one behind a gate the test can close, so that a job can be held "running" for as long
as a test needs without depending on how fast the machine is.
"""

from __future__ import annotations

import base64
import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch

pytest.importorskip("fastapi")  # the server's extra (k6fast[serve]); a GPU machine without it skips this file
from fastapi.testclient import TestClient  # noqa: E402
from server_testing import DEADLINE_S, GatedPipeline, internals_in, tiny_server_config, until

from k6fast.media import probe_mp4
from k6fast.pipeline import Pipeline
from k6fast.server.app import create_app
from k6fast.server.config import ServerConfig
from k6fast.server.jobs import JobStore
from k6fast.switches import Options

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
FAST = {"prompt": "a red ball bouncing", "size": "64x64", "num_frames": "5", "num_inference_steps": "2", "seed": "1"}


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def real_pipeline(tiny_distill: Path) -> Pipeline:
    return Pipeline(tiny_distill, Options(), device="cpu")


def _config(tmp_path: Path, **changes) -> ServerConfig:
    return tiny_server_config(tmp_path / "data", **({"max_upload_bytes": 64 * 1024, "poll_after_ms": 50} | changes))


class Server:
    def __init__(self, client: TestClient, pipeline: GatedPipeline, clock: Clock):
        self.client, self.pipeline, self.clock = client, pipeline, clock
        self.state = client.app.state.k6

    def create(self, headers: dict | None = None, files: dict | None = None, **fields) -> object:
        """POST multipart/form-data as the OpenAI SDK does (a (None, value) part is a plain field)."""
        parts = [(name, (None, value)) for name, value in fields.items()] + list((files or {}).items())
        return self.client.post("/v1/videos", files=parts, headers=AUTH if headers is None else headers)

    def get(self, video_id: str) -> dict:
        response = self.client.get(f"/v1/videos/{video_id}", headers=AUTH)
        assert response.status_code == 200, response.text
        return response.json()

    def wait_status(self, video_id: str, *statuses: str) -> dict:
        return until(lambda: (v := self.get(video_id))["status"] in statuses and v, f"{video_id} in {statuses}")


@pytest.fixture
def server(tmp_path: Path, real_pipeline: Pipeline) -> Iterator[Server]:
    options = Options(api_key=KEY)
    gated, clock = GatedPipeline(real_pipeline), Clock()
    app = create_app(_config(tmp_path, reap_interval_s=0.05), options, load=lambda: gated, clock=clock)
    with TestClient(app) as client:
        until(lambda: client.get("/health").status_code == 200, "the server to become ready")
        yield Server(client, gated, clock)
        gated.gate.set()


def _png(width: int = 32, height: int = 24, fmt: str = "PNG") -> bytes:
    rgb = np.zeros((height, width, 3), np.uint8)
    rgb[..., 0] = np.arange(width, dtype=np.uint8)[None, :] * 8
    buffer = io.BytesIO()
    PIL.Image.fromarray(rgb).save(buffer, format=fmt)
    return buffer.getvalue()


def test_health_is_503_until_loaded_and_jobs_are_refused_meanwhile(tmp_path: Path, real_pipeline: Pipeline) -> None:
    release = threading.Event()

    def slow_load() -> Pipeline:
        assert release.wait(DEADLINE_S)
        return real_pipeline

    app = create_app(_config(tmp_path), Options(), load=slow_load)
    with TestClient(app) as client:
        response = client.get("/health")
        assert response.status_code == 503 and response.json()["status"] == "loading"
        refused = client.post("/v1/videos", data=FAST)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "not_ready"
        assert refused.headers["retry-after"]
        assert client.get("/v1/videos").json()["data"] == [], "the store answers while the model loads"
        release.set()
        until(lambda: client.get("/health").status_code == 200, "ready")
        assert client.get("/health").json()["variant"] == "custom-distill"


def test_load_failure_is_reported_by_health_and_logged(tmp_path: Path, caplog) -> None:
    seen: list[BaseException] = []

    def broken() -> Pipeline:
        raise RuntimeError("no such checkpoint at /secret/path")

    app = create_app(_config(tmp_path), Options(), load=broken, on_load_error=seen.append)
    with TestClient(app) as client:
        body = until(lambda: (r := client.get("/health")).json().get("status") == "failed" and r.json(), "failure")
        assert body == {"status": "failed", "error": "the model failed to load; the server log says why"}
        # The hook runs on the loader thread after the failure is published: wait for it rather than race it (the CI
        # run of 2026-12-02 read an empty list here).
        until(lambda: len(seen) == 1, "the load-error hook")
        refused = client.post("/v1/videos", data=FAST).json()["error"]
        assert refused["code"] == "not_ready" and "/secret" not in refused["message"]
    assert "no such checkpoint at /secret/path" in caplog.text, "the details go to the server log"


def test_create_with_image_runs_and_serves_video_and_thumbnail(server: Server) -> None:
    response = server.create(files={"input_reference": ("ref.png", _png(), "image/png")}, **FAST)
    assert response.status_code == 200, response.text
    assert response.headers["openai-poll-after-ms"] == "50"
    video = response.json()
    assert video["object"] == "video" and video["model"] == "k6-tiny" and video["status"] in ("queued", "in_progress")
    assert (video["size"], video["seconds"], video["num_frames"], video["seed"]) == ("64x64", "0.167", 5, 1)
    assert video["guidance_scale"] == 1.0 and video["num_inference_steps"] == 2 and video["error"] is None
    done = server.wait_status(video["id"], "completed", "failed")
    assert done["status"] == "completed", done["error"]
    assert done["progress"] == 100 and done["expires_at"] == done["completed_at"] + 24 * 3600
    content = server.client.get(f"/v1/videos/{video['id']}/content", headers=AUTH)
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
    path = server.state.files.video(video["id"])
    assert content.content == path.read_bytes()
    info = probe_mp4(path)
    assert (info.width, info.height, info.frame_count, info.audio_codec) == (64, 64, 5, "aac")
    assert not server.state.files.input_image(video["id"]).exists(), "the input is dropped once the job is done"
    thumb = server.client.get(f"/v1/videos/{video['id']}/content", params={"variant": "thumbnail"}, headers=AUTH)
    assert thumb.headers["content-type"] == "image/jpeg"
    assert PIL.Image.open(io.BytesIO(thumb.content)).size == (64, 64)
    job = server.state.store.get(video["id"])
    assert job.arm["arm_hash"] == Options(api_key=KEY).arm_hash() and job.arm["switches"]["K6_API_KEY"] == "<set>"


def test_json_body_and_data_url_reference_are_accepted(server: Server) -> None:
    data_url = "data:image/png;base64," + base64.b64encode(_png()).decode()
    body = {**FAST, "num_frames": 5, "input_reference": {"image_url": data_url}, "sample_audio": False}
    response = server.client.post("/v1/videos", json=body, headers=AUTH)
    assert response.status_code == 200, response.text
    assert response.json()["sample_audio"] is False
    assert server.state.files.input_image(response.json()["id"]).is_file()


def _too_big_png() -> bytes:
    return _png(512, 512, "BMP")  # 786 kB: over the 64 kB test limit


BAD_INPUTS = [
    # (fields over a valid request (None removes one), files, status, param, words the message must contain)
    ({"prompt": None}, None, 400, "prompt", "missing required parameter 'prompt'"),
    ({"prompt": "   "}, None, 400, "prompt", "prompt is empty"),
    ({"size": "100x64"}, None, 400, "size", "not a positive multiple of 16 (nearest valid: 96 or 112)"),
    ({"size": "64by64"}, None, 400, "size", "WIDTHxHEIGHT"),
    ({"size": "256x64"}, None, 400, "size", "exceeds this server's maximum of 128x96 (or 96x128)"),
    ({"num_frames": "10"}, None, 400, "num_frames", "not of the form 4k+1 (nearest valid: 9 or 13)"),
    ({"num_frames": "37"}, None, 400, "num_frames", "exceeds this server's maximum of 33 frames"),
    ({"seconds": "0.3"}, None, 400, "seconds", "frames = seconds x 24 + 1 must be of the form 4k+1"),
    ({"seconds": "-1"}, None, 400, "seconds", "positive number"),
    ({"seconds": "4"}, None, 400, "seconds", "97 frames (seconds '4') exceeds this server's maximum of 33"),
    ({"seconds": "0.5", "num_frames": "9"}, None, 400, "num_frames", "disagrees with seconds '0.5' (13 frames"),
    ({"num_inference_steps": "0"}, None, 400, "num_inference_steps", "must be in [1, 8], found 0"),
    ({"num_inference_steps": "9"}, None, 400, "num_inference_steps", "must be in [1, 8], found 9"),
    ({"num_inference_steps": "two"}, None, 400, "num_inference_steps", "must be an integer"),
    ({"guidance_scale": "5.0"}, None, 400, "guidance_scale", "distilled (PiFlow) checkpoint"),
    ({"guidance_scale": "nan"}, None, 400, "guidance_scale", "finite number"),
    ({"seed": "-3"}, None, 400, "seed", "must be in [0,"),
    ({"sample_audio": "maybe"}, None, 400, "sample_audio", "a boolean"),
    ({"model": "sora-2"}, None, 400, "model", "'sora-2' is not served here; expected 'k6-tiny'"),
    ({"colour": "red"}, None, 400, "colour", "unknown parameter 'colour'"),
    ({}, {"input_reference": ("x.png", b"not an image", "image/png")}, 400, "input_reference", "a PNG, JPEG or WebP"),
    ({"input_reference": "http://example.com/a.png"}, None, 400, "input_reference", "image file upload"),
    ({"input_reference[image_url]": "http://x/a.png"}, None, 400, "input_reference", "base64 data: URL"),
    ({"input_reference[file_id]": "file_1"}, None, 400, "input_reference", "no Files API"),
    ({}, {"input_reference": ("big.bmp", _too_big_png(), "image/bmp")}, 413, "input_reference", "expected at most"),
]


@pytest.mark.parametrize(("fields", "files", "status", "param", "words"), BAD_INPUTS)
def test_bad_input_gets_a_4xx_saying_what_was_expected(server: Server, fields, files, status, param, words) -> None:
    request = {k: v for k, v in {"prompt": "a cat", "size": "64x64", **fields}.items() if v is not None}
    response = server.create(files=files, **request)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"
    assert server.state.store.counts()["queued"] == 0 and list(server.state.files.root.iterdir()) == []


def test_malformed_bodies_and_unknown_ids(server: Server) -> None:
    post = server.client.post
    no_boundary = post("/v1/videos", content=b"xx", headers={**AUTH, "content-type": "multipart/form-data"})
    assert no_boundary.status_code == 400 and "boundary" in no_boundary.json()["error"]["message"]
    garbage = post(
        "/v1/videos", content=b"\x00garbage", headers={**AUTH, "content-type": "multipart/form-data; boundary=zz"}
    )
    assert garbage.status_code == 400 and garbage.json()["error"]["code"] == "invalid_multipart"
    wrong_type = post("/v1/videos", content=b"prompt", headers={**AUTH, "content-type": "text/plain"})
    assert wrong_type.status_code == 415 and "multipart/form-data" in wrong_type.json()["error"]["message"]
    bad_json = post("/v1/videos", content=b"{", headers={**AUTH, "content-type": "application/json"})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["code"] == "invalid_json"
    huge = post(
        "/v1/videos", content=b"x", headers={**AUTH, "content-type": "application/json", "content-length": str(10**9)}
    )
    assert huge.status_code == 413
    chunked = post(  # no Content-Length: the limit is enforced while reading
        "/v1/videos",
        content=(b"x" * 65536 for _ in range(20)),
        headers={**AUTH, "content-type": "multipart/form-data; boundary=zz"},
    )
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"
    for method, path in (
        ("GET", "/v1/videos/video_00000000000000000000000000000000"),
        ("GET", "/v1/videos/nonsense/content"),
        ("DELETE", "/v1/videos/video_00000000000000000000000000000000"),
    ):
        response = server.client.request(method, path, headers=AUTH)
        assert response.status_code == 404 and response.json()["error"]["code"] == "video_not_found", path
    assert server.client.get("/v1/nowhere", headers=AUTH).json()["error"]["message"].startswith("no such route")
    bad_list = server.client.get("/v1/videos", params={"limit": "101"}, headers=AUTH)
    assert bad_list.status_code == 400 and bad_list.json()["error"]["param"] == "limit"
    bad_after = server.client.get("/v1/videos", params={"after": "video_x"}, headers=AUTH)
    assert bad_after.status_code == 400 and bad_after.json()["error"]["param"] == "after"


def test_api_key_is_required_except_for_health(server: Server) -> None:
    assert server.client.get("/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
        for method, path in (("GET", "/v1/videos"), ("POST", "/v1/videos"), ("GET", "/metrics")):
            response = server.client.request(method, path, headers=headers)
            assert response.status_code == 401, (headers, path)
            assert response.json()["error"]["code"] == "invalid_api_key"
            assert response.headers["www-authenticate"] == "Bearer"
    assert server.client.get("/v1/videos", headers={"Authorization": f"bearer {KEY}"}).status_code == 200


def test_full_queue_answers_429_with_retry_after(server: Server) -> None:
    server.pipeline.gate.clear()
    running = server.create(**FAST).json()
    assert server.pipeline.waiting.wait(DEADLINE_S)
    queued = [server.create(**FAST).json() for _ in range(2)]  # max_queue = 2 waiting jobs
    refused = server.create(**FAST)
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "queue_full" and refused.json()["error"]["type"] == "rate_limit_error"
    assert int(refused.headers["retry-after"]) >= 1
    metrics = server.client.get("/metrics", headers=AUTH).text
    assert "k6fast_queue_depth 2" in metrics and "k6fast_worker_busy 1" in metrics
    server.pipeline.gate.set()
    for video in (running, *queued):
        assert server.wait_status(video["id"], "completed", "failed")["status"] == "completed"
    order = [server.state.store.get(v["id"]).started_at for v in (running, *queued)]
    assert order == sorted(order), "jobs run first in, first out"


def test_delete_queued_and_running_jobs(server: Server) -> None:
    server.pipeline.gate.clear()
    running = server.create(**FAST).json()
    assert server.pipeline.waiting.wait(DEADLINE_S)
    queued = server.create(files={"input_reference": ("r.png", _png(), "image/png")}, **FAST).json()
    assert server.state.files.input_image(queued["id"]).is_file()
    for video in (queued, running):
        response = server.client.delete(f"/v1/videos/{video['id']}", headers=AUTH)
        assert response.json() == {"id": video["id"], "object": "video.deleted", "deleted": True}
        assert server.client.get(f"/v1/videos/{video['id']}", headers=AUTH).status_code == 404
        assert not server.state.files.folder(video["id"]).exists()
    # The running job stops at its next boundary and the worker is free for the next job.
    until(lambda: server.state.worker.current_job_id is None, "the worker to drop the deleted job")
    assert 'k6fast_jobs_finished_total{outcome="cancelled"} 1' in server.client.get("/metrics", headers=AUTH).text
    server.pipeline.gate.set()
    after = server.create(**FAST).json()
    assert server.wait_status(after["id"], "completed", "failed")["status"] == "completed"


def test_a_failing_job_fails_alone_and_the_server_keeps_serving(server: Server) -> None:
    server.pipeline.fail_with["oom please"] = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9 GiB")
    server.pipeline.fail_with["crash please"] = ValueError("something broke")
    oom = server.create(**{**FAST, "prompt": "oom please"}).json()
    crash = server.create(**{**FAST, "prompt": "crash please"}).json()
    fine = server.create(**FAST).json()
    failed = server.wait_status(oom["id"], "completed", "failed")
    assert failed["status"] == "failed" and failed["error"]["code"] == "out_of_memory"
    assert failed["error"]["message"].startswith("the server ran out of memory before its first denoising step")
    crashed = server.wait_status(crash["id"], "completed", "failed")
    assert crashed["error"] == {
        "code": "generation_failed",
        "message": "generation failed before its first denoising step completed because of an error in the server; "
        "its log has the details",
    }
    for video in (failed, crashed):  # words, not the exception: no type names, no exception text
        assert not internals_in(video["error"]["message"]) and "broke" not in video["error"]["message"]
    assert server.wait_status(fine["id"], "completed", "failed")["status"] == "completed"
    not_ready = server.client.get(f"/v1/videos/{oom['id']}/content", headers=AUTH)
    assert not_ready.status_code == 409 and not_ready.json()["error"]["code"] == "video_failed"


def test_finished_jobs_expire_with_their_files(server: Server) -> None:
    video = server.create(**FAST).json()
    done = server.wait_status(video["id"], "completed", "failed")
    assert done["status"] == "completed" and server.state.files.video(video["id"]).is_file()
    server.clock.now = done["expires_at"] - 1
    time.sleep(0.2)  # several reaper rounds: not yet due
    assert server.get(video["id"])["status"] == "completed"
    server.clock.now = done["expires_at"]
    until(lambda: server.client.get(f"/v1/videos/{video['id']}", headers=AUTH).status_code == 404, "expiry")
    # The record goes first, the files right after it (a crash in between leaves files that the next start sweeps).
    until(lambda: not server.state.files.folder(video["id"]).exists(), "the expired job's files to go")


def test_list_pages_through_all_jobs(server: Server) -> None:
    server.pipeline.gate.clear()
    ids = [server.create(**FAST).json()["id"] for _ in range(3)]
    page = server.client.get("/v1/videos", params={"limit": 2}, headers=AUTH).json()
    assert page["object"] == "list" and [v["id"] for v in page["data"]] == ids[:0:-1] and page["has_more"]
    assert (page["first_id"], page["last_id"]) == (ids[2], ids[1])
    rest = server.client.get("/v1/videos", params={"limit": 2, "after": page["last_id"]}, headers=AUTH).json()
    assert [v["id"] for v in rest["data"]] == [ids[0]] and not rest["has_more"]
    ascending = server.client.get("/v1/videos", params={"order": "asc"}, headers=AUTH).json()
    assert [v["id"] for v in ascending["data"]] == ids
    content = server.client.get(f"/v1/videos/{ids[2]}/content", headers=AUTH)
    assert content.status_code == 409 and content.json()["error"]["code"] == "video_not_ready"
    sprites = server.client.get(f"/v1/videos/{ids[2]}/content", params={"variant": "spritesheet"}, headers=AUTH)
    assert sprites.status_code == 400 and sprites.json()["error"]["param"] == "variant"


def test_shutdown_puts_the_running_job_back_and_the_next_start_runs_it(tmp_path: Path, real_pipeline) -> None:
    gated = GatedPipeline(real_pipeline)
    gated.gate.clear()
    config = _config(tmp_path)
    with TestClient(create_app(config, Options(), load=lambda: gated)) as client:
        until(lambda: client.get("/health").status_code == 200, "ready")
        video_id = client.post("/v1/videos", files=[(k, (None, v)) for k, v in FAST.items()]).json()["id"]
        assert gated.waiting.wait(DEADLINE_S)
    store = JobStore(config.jobs_db)
    job = store.get(video_id)
    store.close()
    assert (job.status, job.attempts) == ("queued", 0), "a shutdown is not the job's fault"
    gated.gate.set()
    with TestClient(create_app(config, Options(), load=lambda: gated)) as client:
        done = until(lambda: (v := client.get(f"/v1/videos/{video_id}").json())["status"] == "completed" and v, "run")
        assert done["progress"] == 100


@pytest.mark.parametrize("stage", ["prepare", "denoise", "decode", "write"])
def test_failure_messages_are_words_without_the_exception(stage: str) -> None:
    from k6fast.pipeline import RequestError
    from k6fast.server.worker import STAGES, classify_failure

    hostile = "at /srv/k6/model.py line 3: <Tensor object at 0x7f12abcd>"
    for exc, code in (
        (ValueError(hostile), "generation_failed"),
        (MemoryError(hostile), "out_of_memory"),
        (torch.cuda.OutOfMemoryError(hostile), "out_of_memory"),
        (RequestError(hostile), "invalid_request"),
    ):
        got_code, message = classify_failure(exc, stage)
        assert got_code == code and STAGES[stage] in message
        assert not internals_in(message) and "line 3" not in message, message
