"""End to end: a real `python -m k6fast.server` (uvicorn on loopback, the tiny checkpoint on CPU) driven by the
official `openai` SDK, including a SIGKILL with jobs running and queued and a restart on the same data directory.

Every server process is killed by a fixture finalizer, and every wait has a deadline. The SDK is imported inside the
tests (pytest.importorskip), so the module collects on a machine without it.
"""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import PIL.Image
import pytest

from k6fast.media import probe_mp4
from k6fast.server.jobs import JobStore

if TYPE_CHECKING:
    from openai import OpenAI

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")]

KEY = "sk-e2e-test-key"
START_TIMEOUT_S = 120.0
JOB_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """One `python -m k6fast.server` subprocess; its output goes to a log file (a pipe could fill and block it)."""

    def __init__(self, model: Path, data_dir: Path, log_path: Path, api_key: str | None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {k: v for k, v in os.environ.items() if not k.startswith("K6_")}
        # One thread: the tests' CPU time stays small and several servers do not fight over the two cores.
        env.update(HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        if api_key:
            env["K6_API_KEY"] = api_key
        args = [sys.executable, "-m", "k6fast.server", "--model", str(model), "--device", "cpu"]
        args += ["--port", str(self.port), "--data-dir", str(data_dir), "--poll-after-ms", "50", "--max-steps", "1000"]
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:  # refused while binding, or 503 (HTTPError) while the model loads
                pass
            time.sleep(0.1)
        raise AssertionError(f"the server was not ready within {START_TIMEOUT_S} s:\n{self.log()}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def client(self, api_key: str = KEY) -> OpenAI:
        return _sdk().OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=30.0)


def _sdk() -> Any:
    """The official SDK, or a skip where it is not installed."""
    return pytest.importorskip("openai")


@pytest.fixture
def spawn(tiny_distill: Path, tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    started: list[ServerProcess] = []

    def start(data_dir: Path, api_key: str | None = None) -> ServerProcess:
        server = ServerProcess(tiny_distill, data_dir, tmp_path / f"server{len(started)}.log", api_key)
        started.append(server)
        server.wait_ready()
        return server

    yield start
    for server in started:
        server.kill()


@pytest.fixture(scope="module")
def keyed_server(tiny_distill: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("keyed")
    server = ServerProcess(tiny_distill, root / "data", root / "server.log", KEY)
    try:
        server.wait_ready()
        yield server
    finally:
        server.kill()


def _wait_finished(client: OpenAI, video_id: str) -> Any:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        video = client.videos.retrieve(video_id)
        if video.status in ("completed", "failed"):
            return video
        time.sleep(0.05)
    raise AssertionError(f"{video_id} did not finish within {JOB_TIMEOUT_S} s")


def _check_clip(client: OpenAI, video_id: str, path: Path, frames: int) -> bytes:
    client.videos.download_content(video_id).write_to_file(path)
    info = probe_mp4(path)
    assert (info.video_codec, info.width, info.height, info.frame_count) == ("h264", 64, 64, frames)
    assert (info.audio_codec, info.audio_channels, info.audio_sample_rate) == ("aac", 1, 44100)
    return path.read_bytes()


def _png() -> bytes:
    buffer = io.BytesIO()
    PIL.Image.fromarray(np.full((48, 48, 3), (200, 40, 90), np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_sdk_create_poll_download_list_delete(keyed_server: ServerProcess, tmp_path: Path) -> None:
    openai = _sdk()
    client = keyed_server.client()
    video = client.videos.create(
        prompt="a drum solo in a small room",
        size="64x64",
        seconds="0.5",
        extra_body={"num_inference_steps": 2, "seed": 5},
    )
    assert video.object == "video" and video.status in ("queued", "in_progress")
    assert (video.size, video.seconds, video.model, video.error) == ("64x64", "0.5", "distill", None)
    raw = client.videos.with_raw_response.retrieve(video.id)
    assert raw.headers["openai-poll-after-ms"] == "50"

    done = _wait_finished(client, video.id)
    assert done.status == "completed" and done.progress == 100, done.error
    assert done.completed_at >= done.created_at and done.expires_at > done.completed_at
    _check_clip(client, video.id, tmp_path / "clip.mp4", frames=13)
    assert probe_mp4(tmp_path / "clip.mp4").metadata["k6fast_arm_hash"]
    thumbnail = client.videos.download_content(video.id, variant="thumbnail")
    assert PIL.Image.open(io.BytesIO(thumbnail.content)).size == (64, 64)

    second = client.videos.create(prompt="rain on a tin roof", size="64x64", extra_body={"num_frames": 5, "seed": 1})
    assert second.seconds == "0.167"
    page = client.videos.list(limit=1)
    assert [v.id for v in page.data] == [second.id] and page.has_more
    assert {v.id for v in client.videos.list(limit=1)} >= {video.id, second.id}, "auto-pagination reaches both"

    deleted = client.videos.delete(video.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (video.id, "video.deleted", True)
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)
    assert _wait_finished(client, second.id).status == "completed"


def test_sdk_errors_auth_and_bad_input(keyed_server: ServerProcess) -> None:
    openai = _sdk()
    with pytest.raises(openai.AuthenticationError):
        keyed_server.client(api_key="not-the-key").videos.list()
    with urllib.request.urlopen(f"{keyed_server.url}/health", timeout=5) as response:
        assert response.status == 200, "/health needs no key"
    client = keyed_server.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.videos.create(prompt="x", size="100x64", seconds="0.5")
    assert "multiple of 16" in info.value.message and info.value.body["param"] == "size"
    with pytest.raises(openai.BadRequestError) as info:
        client.videos.create(prompt="x", size="64x64", seconds="4", model="sora-2")
    assert info.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as info:
        client.videos.create(prompt="x", size="64x64", seconds="0.3")
    assert "4k+1" in info.value.message


def _metric(server: ServerProcess, name: str) -> float:
    request = urllib.request.Request(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    raise AssertionError(f"no metric {name}")


def test_progress_advances_each_step_and_delete_stops_the_running_job(keyed_server: ServerProcess) -> None:
    openai = _sdk()
    client = keyed_server.client()
    cancelled_before = _metric(keyed_server, 'k6fast_jobs_finished_total{outcome="cancelled"}')
    steps_before = _metric(keyed_server, "k6fast_step_seconds_count")
    slow = client.videos.create(
        prompt="a very long drone note", size="64x64", seconds="0.333", extra_body={"num_inference_steps": 1000}
    )
    seen: set[int] = set()
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while len(seen) < 3:
        assert time.monotonic() < deadline, f"progress values seen: {sorted(seen)}"
        video = client.videos.retrieve(slow.id)
        assert video.status in ("queued", "in_progress"), video
        if 0 < video.progress < 100:
            seen.add(video.progress)
        time.sleep(0.01)

    assert client.videos.delete(slow.id).deleted
    deadline = time.monotonic() + JOB_TIMEOUT_S
    cancelled = 'k6fast_jobs_finished_total{outcome="cancelled"}'
    # Stopped as a cancellation (not run to the end) and the GPU worker free again.
    while _metric(keyed_server, cancelled) == cancelled_before or _metric(keyed_server, "k6fast_worker_busy"):
        assert time.monotonic() < deadline, "the deleted job never stopped"
        time.sleep(0.05)
    steps_run = _metric(keyed_server, "k6fast_step_seconds_count") - steps_before
    assert steps_run < 1000, f"the job ran {steps_run} steps: it was not stopped at a step boundary"
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(slow.id)


def test_sigkill_with_jobs_running_and_queued_loses_nothing(spawn, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    first = spawn(data_dir)
    client = first.client()
    small = {"size": "64x64", "seconds": "0.167", "extra_body": {"num_inference_steps": 2}}
    early = client.videos.create(prompt="a bell rings once", **small)
    assert _wait_finished(client, early.id).status == "completed"
    early_bytes = _check_clip(client, early.id, tmp_path / "early.mp4", frames=5)

    running = client.videos.create(
        prompt="a long crescendo", size="64x64", seconds="0.333", extra_body={"num_inference_steps": 300}
    )
    queued = [
        client.videos.create(prompt="footsteps on gravel", **small),
        client.videos.create(prompt="a red door opens", input_reference=("door.png", _png(), "image/png"), **small),
    ]
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while (video := client.videos.retrieve(running.id)).progress == 0:
        assert video.status in ("queued", "in_progress") and time.monotonic() < deadline, video
        time.sleep(0.02)
    statuses = [client.videos.retrieve(v.id).status for v in (running, *queued)]
    first.kill()
    assert statuses == ["in_progress", "queued", "queued"]

    second = spawn(data_dir)
    client = second.client()
    for video, frames in ((running, 9), (queued[0], 5), (queued[1], 5)):
        finished = _wait_finished(client, video.id)
        assert finished.status == "completed", finished.error
        _check_clip(client, video.id, tmp_path / f"{video.id}.mp4", frames)
    assert _check_clip(client, early.id, tmp_path / "early-again.mp4", frames=5) == early_bytes
    assert {v.id for v in client.videos.list()} == {early.id, running.id, queued[0].id, queued[1].id}
    store = JobStore(data_dir / "jobs.sqlite3")
    try:
        assert store.get(running.id).attempts == 2, "the job running at the kill ran again from the start"
        assert store.get(queued[1].id).spec.image
    finally:
        store.close()
