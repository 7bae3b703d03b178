"""`k6fast serve --ray` on a local Ray cluster: two CPU replicas of the tiny pipeline behind the ingress, driven by
the official `openai` SDK through Serve's HTTP proxy. One cluster and one application serve the whole module (a
replica loads in ~10 s on two cores); the tests that kill a replica or the ingress leave Serve to replace it.

Faults are real: `ray.kill` of the replica running a job and of the ingress. A CUDA out-of-memory error is injected
by wrapping the real pipeline (a prompt the wrapper refuses), as test_server_api.py does in-process.

Every wait has a deadline; the cluster is shut down by the fixture.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import server_testing

from k6fast.media import probe_mp4
from k6fast.server.config import ServerConfig
from k6fast.server.jobs import JobStore
from k6fast.server.ray_settings import RaySettings
from k6fast.switches import Options

openai = pytest.importorskip("openai")  # the SDK the tests drive the API with (dev extra); absent on a GPU machine
OpenAI = openai.OpenAI

pytestmark = [
    pytest.mark.ray,
    pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Using extra keyword arguments on `Field`"),  # Ray Serve's own pydantic models
]

KEY = "sk-ray-test-key"
OOM_PROMPT = "a scene too large for any card"
DEADLINE_S = 120.0
RESTART_S = 60.0  # from killing the ingress to its jobs running again (Serve notices a dead replica in ~10 s)
SMALL = {"size": "64x64", "seconds": "0.167", "extra_body": {"num_inference_steps": 2}}  # 5 frames, 2 steps
# A job of a few seconds on the tiny model (~10 ms a step on one core), long enough to act on mid-job.
LONG = {"size": "64x64", "seconds": "0.167", "extra_body": {"num_inference_steps": 400}}
# Jobs of minutes on the tiny model: they cannot end by themselves before a test's checks, however busy the machine.
ENDLESS = {"size": "64x64", "seconds": "0.167", "extra_body": {"num_inference_steps": 20_000}}


def until(check: Any, what: str, timeout: float = DEADLINE_S) -> Any:
    """server_testing.until with this file's longer deadline: Ray's start and Serve's restarts take longer."""
    return server_testing.until(check, what, timeout)


class FaultyPipeline:
    """The real tiny pipeline, except that OOM_PROMPT raises CUDA's out-of-memory error, as a too large job would."""

    def __init__(self, real: Any):
        self.real = real
        self.ckpt, self.device, self.options = real.ckpt, real.device, real.options
        # What the replica's fit table is computed from (`fit.fit_table`), sent to the ingress.
        self.fits, self.dit_fits, self.budget_bytes = real.fits, real.dit_fits, real.budget_bytes

    def resolve(self, request: Any) -> tuple[int, float]:
        return self.real.resolve(request)

    def generate(self, request: Any, on_step: Any = None, should_stop: Any = None) -> Any:
        if request.prompt == OOM_PROMPT:
            import torch

            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB (injected)")
        return self.real.generate(request, on_step=on_step, should_stop=should_stop)


def faulty_load(config: ServerConfig, options: Options) -> FaultyPipeline:
    from k6fast.server.worker import load_pipeline

    return FaultyPipeline(load_pipeline(config, options))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Cluster:
    ray: Any
    serve: Any
    port: int
    address: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                return response.status == 200
        except OSError:  # refused, 503 while loading, or 5xx while Serve replaces the ingress
            return False

    def client(self, api_key: str = KEY) -> OpenAI:
        return OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=30.0)


@dataclass
class App:
    cluster: Cluster
    handle: Any  # the ingress deployment's handle
    data_dir: Path
    options: Options  # the replicas' (their VRAM budget holds 512x512 x 65 frames, not the server's largest request)

    def client(self) -> OpenAI:
        return self.cluster.client()

    def running(self) -> dict[str, Any]:
        return self.handle.running.remote().result(timeout_s=30)

    def record(self, video_id: str) -> Any:
        store = JobStore(self.data_dir / "jobs.sqlite3")  # WAL: a second reader beside the ingress is fine
        try:
            return store.get(video_id)
        finally:
            store.close()

    def job_ids(self) -> set[str]:
        store = JobStore(self.data_dir / "jobs.sqlite3")
        try:
            return store.ids()
        finally:
            store.close()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    from ray import cloudpickle

    # The workers cannot import this test module: the fault-injecting loader travels by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    context = ray.init(
        num_cpus=4,  # logical: two replicas and the ingress fit on the two real cores
        include_dashboard=False,
        object_store_memory=256 * 2**20,
        logging_level=logging.WARNING,
        # One thread per replica: the two replicas and the tests share two cores.
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}},
    )
    port = _free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield Cluster(ray, serve, port, context.address_info["gcs_address"])
    finally:
        serve.shutdown()
        ray.shutdown()
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def app(cluster: Cluster, tiny_distill: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    from k6fast.server.ray_app import build_app

    data_dir = tmp_path_factory.mktemp("ray") / "data"
    config = ServerConfig(
        model=str(tiny_distill),
        served_model_name="distill",
        data_dir=data_dir,
        device="cpu",
        max_queue=8,
        max_steps=20_000,
        poll_after_ms=50,
    )
    settings = RaySettings(
        replicas=2, gpus_per_replica=0, cpus_per_replica=1, ingress_node_ip=cluster.ray.util.get_node_ip_address()
    )
    # A budget the server's largest request (1280x720, 241 frames) does not fit: the ingress refuses it.
    options = Options(api_key=KEY, vram_budget_gb=server_testing.budget_fitting(tiny_distill, 512, 512, 65))
    handle = cluster.serve.run(
        build_app(config, options, settings, load=faulty_load), name=settings.app_name, route_prefix="/"
    )
    until(cluster.healthy, "the ingress to report healthy")
    try:
        yield App(cluster, handle, data_dir, options)
    finally:
        cluster.serve.delete(settings.app_name)


def _finished(client: OpenAI, video_id: str, timeout: float = DEADLINE_S) -> openai.types.Video:
    def done() -> openai.types.Video | None:
        video = client.videos.retrieve(video_id)
        return video if video.status in ("completed", "failed") else None

    return until(done, f"{video_id} to finish", timeout)


def _running_on(app: App, video_id: str, timeout: float = DEADLINE_S) -> dict[str, Any]:
    """The replica running `video_id` once it has made progress."""

    def started() -> dict[str, Any] | None:
        replica = app.running().get(video_id)
        return replica if replica and app.client().videos.retrieve(video_id).progress > 0 else None

    return until(started, f"{video_id} to run on a replica", timeout)


def _check_clip(client: OpenAI, video_id: str, path: Path, frames: int) -> None:
    client.videos.download_content(video_id).write_to_file(path)
    info = probe_mp4(path)
    assert (info.video_codec, info.width, info.height, info.frame_count) == ("h264", 64, 64, frames)
    assert (info.audio_codec, info.audio_sample_rate) == ("aac", 44100)


def _replica_actors(cluster: Cluster, deployment: str) -> set[str]:
    prefix = f"SERVE_REPLICA::k6fast#{deployment}#"
    return {a["name"] for a in cluster.ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)}


def test_sdk_flow_through_two_replicas(app: App, tmp_path: Path) -> None:
    client = app.client()
    with pytest.raises(openai.AuthenticationError):
        app.cluster.client(api_key="not-the-key").videos.list()
    with pytest.raises(openai.BadRequestError) as info:
        client.videos.create(prompt="x", size="100x64", seconds="0.5")
    assert info.value.body["param"] == "size"

    video = client.videos.create(prompt="a drum solo in a small room", **SMALL)
    assert video.status in ("queued", "in_progress") and video.model == "distill"
    done = _finished(client, video.id)
    assert done.status == "completed" and done.progress == 100, done.error
    _check_clip(client, video.id, tmp_path / "clip.mp4", frames=5)
    assert client.videos.download_content(video.id, variant="thumbnail").content[:2] == b"\xff\xd8"
    sidecar = json.loads((app.data_dir / "jobs" / video.id / "video.mp4.json").read_text())
    assert sidecar["request"]["prompt"] == "a drum solo in a small room"
    assert video.id in {v.id for v in client.videos.list()}
    assert client.videos.delete(video.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)
    request = urllib.request.Request(f"{app.cluster.url}/health", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=5) as response:
        health = json.loads(response.read())
    assert health["status"] == "ok" and health["device"] == "ray: 2 replica(s) on cpu"


def test_a_request_no_replica_can_fit_is_refused_before_it_is_queued(app: App, tiny_distill: Path) -> None:
    from k6fast.pipeline import Pipeline
    from k6fast.request import Request, RequestError

    pipeline = Pipeline(tiny_distill, app.options, device="cpu")  # what `k6fast serve` would answer in-process
    try:
        with pytest.raises(RequestError) as in_process:
            pipeline.resolve(Request(prompt="a whole symphony", width=1280, height=720, frames=241, steps=2))
    finally:
        pipeline.close()
    client = app.client()
    jobs_before = app.job_ids()
    with pytest.raises(openai.BadRequestError) as info:
        client.videos.create(prompt="a whole symphony", size="1280x720", seconds="10", extra_body=SMALL["extra_body"])
    error = info.value.body
    assert (error["param"], error["code"], error["message"]) == ("size", "invalid_value", str(in_process.value))
    assert app.job_ids() == jobs_before, "refused by the ingress: nothing was queued"
    done = _finished(client, client.videos.create(prompt="a small one that fits", **SMALL).id)
    assert done.status == "completed", done.error


def test_eight_jobs_spread_over_both_replicas(app: App) -> None:
    client = app.client()
    videos = [client.videos.create(prompt=f"clip number {i}", **SMALL) for i in range(8)]
    ran_on = {}
    for video in videos:
        done = _finished(client, video.id)
        assert done.status == "completed", done.error
        ray_record = app.record(video.id).telemetry["ray"]
        ran_on[video.id] = ray_record["replica"]["replica"]
        assert (ray_record["attempts"], ray_record["lost"], ray_record["files"]) == (1, [], "object store")
    print("replica of each job:", json.dumps(ran_on, indent=1))
    assert len(set(ran_on.values())) == 2, f"expected both replicas to run jobs, found {ran_on}"


def test_out_of_memory_fails_only_its_job(app: App) -> None:
    client = app.client()
    replicas_before = _replica_actors(app.cluster, "Generator")
    doomed = client.videos.create(prompt=OOM_PROMPT, **SMALL)
    fine = client.videos.create(prompt="a quiet lake at dawn", **SMALL)
    failed = _finished(client, doomed.id)
    assert failed.status == "failed" and failed.error.code == "out_of_memory", failed.error
    assert "ran out of memory before its first denoising step" in failed.error.message
    assert _finished(client, fine.id).status == "completed"
    after = [client.videos.create(prompt=f"after the oom {i}", **SMALL) for i in range(2)]
    assert all(_finished(client, v.id).status == "completed" for v in after)
    assert _replica_actors(app.cluster, "Generator") == replicas_before, "no replica died or was replaced"


def test_full_queue_answers_429_with_retry_after(app: App) -> None:
    client = app.client()
    running = [client.videos.create(prompt=f"a long hum {i}", **ENDLESS) for i in range(2)]
    for video in running:
        _running_on(app, video.id)
    queued = [client.videos.create(prompt=f"waiting {i}", **SMALL) for i in range(8)]
    with pytest.raises(openai.RateLimitError) as info:
        client.videos.create(prompt="one too many", **SMALL)
    assert info.value.response.headers["retry-after"].isdigit()
    assert "queue is full" in info.value.message
    for video in running + queued:
        client.videos.delete(video.id)
    until(lambda: not app.running(), "both replicas to be free again")


def _metric(app: App, name: str) -> float:
    request = urllib.request.Request(f"{app.cluster.url}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    raise AssertionError(f"no metric {name}")


def test_delete_stops_the_running_job_at_a_step_boundary(app: App) -> None:
    client = app.client()
    cancelled = 'k6fast_jobs_finished_total{outcome="cancelled"}'
    cancelled_before, steps_before = _metric(app, cancelled), _metric(app, "k6fast_step_seconds_count")
    slow = client.videos.create(
        prompt="a very long drone note", size="64x64", seconds="0.167", extra_body={"num_inference_steps": 1000}
    )
    _running_on(app, slow.id)
    assert client.videos.delete(slow.id).deleted
    until(lambda: slow.id not in app.running(), "the deleted job to stop")
    assert _metric(app, cancelled) == cancelled_before + 1
    steps_run = _metric(app, "k6fast_step_seconds_count") - steps_before
    assert steps_run < 1000, f"the job ran {steps_run} steps: it was not stopped at its next check"
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(slow.id)
    assert not (app.data_dir / "jobs" / slow.id).exists()
    assert _finished(client, client.videos.create(prompt="next one", **SMALL).id).status == "completed"


def test_replica_killed_mid_job_is_retried_on_another(app: App, tmp_path: Path) -> None:
    client = app.client()
    video = client.videos.create(prompt="a long crescendo", **LONG)
    victim = _running_on(app, video.id)
    app.cluster.ray.kill(app.cluster.ray.get_actor(victim["actor"], namespace="serve"), no_restart=True)
    done = _finished(client, video.id)
    assert done.status == "completed", done.error
    _check_clip(client, video.id, tmp_path / "retried.mp4", frames=5)
    ray_record = app.record(video.id).telemetry["ray"]
    assert ray_record["attempts"] == 2, ray_record
    assert [lost["replica"]["replica"] for lost in ray_record["lost"]] == [victim["replica"]]
    assert "ActorDiedError" in ray_record["lost"][0]["error"] or "Unavailable" in ray_record["lost"][0]["error"]
    assert ray_record["replica"]["replica"] != victim["replica"], "the retry ran on a live replica"
    # Serve replaces the dead replica: two again, the victim not among them.
    until(lambda: len(_replica_actors(app.cluster, "Generator")) == 2, "Serve to replace the killed replica")
    assert victim["actor"] not in _replica_actors(app.cluster, "Generator")


def test_ingress_killed_and_restarted_loses_no_job(app: App) -> None:
    client = app.client()
    running = [client.videos.create(prompt=f"a long sustained chord {i}", **ENDLESS) for i in range(2)]
    for video in running:
        _running_on(app, video.id)
    queued = [client.videos.create(prompt=f"footsteps {i}", **SMALL) for i in range(2)]
    (ingress,) = _replica_actors(app.cluster, "Ingress")
    app.cluster.ray.kill(app.cluster.ray.get_actor(ingress, namespace="serve"), no_restart=True)
    # The new ingress re-queues the running jobs from the store and runs them again. It needs free replicas: they
    # drop the dead ingress's calls (ray_replica.CallerWatch); otherwise nothing below happens for minutes.
    deadline = time.monotonic() + RESTART_S
    until(lambda: _replica_actors(app.cluster, "Ingress") - {ingress}, "a new ingress", deadline - time.monotonic())
    until(app.cluster.healthy, "the new ingress to report healthy", deadline - time.monotonic())
    client = app.client()
    for video in running:
        _running_on(app, video.id, deadline - time.monotonic())
        assert app.record(video.id).attempts == 2, "the job running at the kill runs again from the start"
        assert client.videos.delete(video.id).deleted
    for video in queued:
        done = _finished(client, video.id)
        assert done.status == "completed", done.error
        assert app.record(video.id).attempts == 1


def test_caller_watch_sees_a_dead_ingress(cluster: Cluster) -> None:
    from k6fast.server.ray_replica import CallerWatch

    @cluster.ray.remote(num_cpus=0)
    class Caller:
        def ping(self) -> bool:
            return True

    actor = Caller.options(name="k6fast-test-caller", namespace="k6fast-test").remote()
    assert cluster.ray.get(actor.ping.remote())
    watch = CallerWatch(("k6fast-test", "k6fast-test-caller"), interval=0.0)
    assert not watch(), "a live caller"
    cluster.ray.kill(actor)
    until(watch, "the watch to see the killed caller")
    assert CallerWatch(None, interval=0.0)() is False, "a job without a caller is never stopped by the watch"


def test_cli_serves_on_an_existing_cluster(cluster: Cluster, tiny_distill: Path, tmp_path: Path) -> None:
    """`k6fast serve --ray --address ...` as a user runs it: deploy, serve a job, stop on SIGINT with a job running
    (it goes back to the queue). Runs after the tests of the module's application, which it replaces."""
    cluster.serve.delete("k6fast")
    env = {k: v for k, v in os.environ.items() if not k.startswith("K6_")}
    env.update(HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    args = [sys.executable, "-m", "k6fast.server", "--model", str(tiny_distill), "--device", "cpu", "--ray"]
    args += ["--address", cluster.address, "--replicas", "1", "--gpus-per-replica", "0", "--port", str(cluster.port)]
    args += ["--data-dir", str(tmp_path / "data"), "--poll-after-ms", "50", "--max-steps", "1000", "--shared-data-dir"]
    log_path = tmp_path / "cli.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        until(lambda: proc.poll() is not None or cluster.healthy(), "the CLI's application to be healthy")
        assert proc.poll() is None, log_path.read_text()[-4000:]
        client = cluster.client(api_key="unused")  # no K6_API_KEY in the CLI's environment
        video = client.videos.create(prompt="a bell rings once", **SMALL)
        assert _finished(client, video.id).status == "completed"
        _check_clip(client, video.id, tmp_path / "cli.mp4", frames=5)
        running = client.videos.create(prompt="a long hum", **LONG)
        until(lambda: client.videos.retrieve(running.id).progress > 0, "the long job to make progress")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, log_path.read_text()[-4000:]
        assert "k6fast" not in cluster.serve.status().applications, "the CLI deletes its application on exit"
        store = JobStore(tmp_path / "data" / "jobs.sqlite3")
        try:
            assert store.get(video.id).telemetry["ray"]["files"] == "shared data dir"
            stopped = store.get(running.id)
            assert (stopped.status, stopped.progress, stopped.attempts) == ("queued", 0, 0), "back in the queue"
        finally:
            store.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_bench_script_smoke(cluster: Cluster, tiny_distill: Path, tmp_path: Path) -> None:
    """measurements/bench_ray_serve.py end to end on the CPU (its numbers mean nothing here)."""
    import importlib.util

    cluster.serve.delete("k6fast")
    script = Path(__file__).resolve().parents[1] / "measurements" / "bench_ray_serve.py"
    spec = importlib.util.spec_from_file_location("bench_ray_serve", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    argv = ["--smoke", "--model", str(tiny_distill), "--requests", "2", "--configs", "2x0"]  # one deploy: seconds
    assert bench.main([*argv, "--port", str(cluster.port), "--out", str(out)]) == 0
    (config,) = json.loads(out.read_text())["configs"]
    assert (config["replicas"], config["gpus_per_replica"], config["geometry"]) == (2, 0.0, [64, 64, 5])
    assert config["requests_per_hour"] > 0 and len(config["jobs"]) == 2
    assert len(config["per_replica"]) == 2, "two requests at once run on both replicas"
    assert all(r["jobs"] == 1 and r["peak_host_rss_bytes"] > 0 for r in config["per_replica"].values())
    assert {job["replica"] for job in config["jobs"]} == set(config["per_replica"])
    merged = tmp_path / "merged.json"
    assert bench.main(["--report", str(out), str(out), "--out", str(merged)]) == 0
    assert len(json.loads(merged.read_text())["configs"]) == 2
