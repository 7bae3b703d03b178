"""The Ray path without a cluster: settings and command-line checks, `JobStore.restart`, the replica's request
building, and the ingress dispatcher's decisions (retry a lost replica within max_attempts, then fail; write the
returned clip before completing; cancel; requeue on shutdown) against a scripted stand-in for the Serve handle.
What Ray itself does (streams, cancellation, replica death) is exercised on a real local cluster in
test_ray_serve.py; here each decision is driven deterministically.
"""

from __future__ import annotations

import dataclasses
import io
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import pytest
import server_testing

from k6fast.request import Request
from k6fast.server.config import ServerConfig
from k6fast.server.jobs import JobFiles, JobSpec, JobStore
from k6fast.server.metrics import Metrics
from k6fast.server.ray_messages import ClipFiles, Finished, JobPayload, Progress, ReplicaIdentity, Started
from k6fast.server.ray_replica import request_from_spec
from k6fast.server.ray_settings import RaySettings
from k6fast.server.worker import InputUnreadable
from k6fast.switches import Options

pytestmark = pytest.mark.filterwarnings("ignore:Using extra keyword arguments on `Field`")  # Ray Serve's models
SPEC = JobSpec(Request(prompt="a bell", width=64, height=64, frames=5, steps=4, guidance=1.0, seed=3), "0.167")
WITH_IMAGE = dataclasses.replace(SPEC, image=True)
REPLICA_A = ReplicaIdentity("aaaa", "SERVE_REPLICA::k6fast#Generator#aaaa", "node-1", 11)
REPLICA_B = ReplicaIdentity("bbbb", "SERVE_REPLICA::k6fast#Generator#bbbb", "node-2", 22)
DEADLINE_S = 30.0


def test_settings_check_themselves_and_lay_out_the_deployments() -> None:
    for bad, expected in (
        ({"replicas": 0}, "--replicas must be an integer >= 1"),
        ({"replicas": 2, "max_replicas": 2}, "--max-replicas must be an integer above --replicas"),
        ({"gpus_per_replica": 1.5}, "--gpus-per-replica must be in [0, 1]"),
        ({"gpus_per_replica": float("nan")}, "--gpus-per-replica must be in [0, 1]"),
    ):
        with pytest.raises(ValueError, match=expected.replace("[", r"\[").replace("]", r"\]")):
            RaySettings(**bad)
    fixed = RaySettings(replicas=3, gpus_per_replica=0.5, ingress_node_ip="10.0.0.7")
    options = fixed.generator_options()
    assert (options["num_replicas"], options["max_ongoing_requests"], fixed.capacity) == (3, 1, 3)
    assert options["ray_actor_options"] == {"num_gpus": 0.5, "num_cpus": 1.0}
    assert fixed.ingress_options()["ray_actor_options"]["resources"] == {"node:10.0.0.7": 0.001}
    assert fixed.ingress_options()["num_replicas"] == 1
    scaled = RaySettings(replicas=1, max_replicas=4)
    assert "num_replicas" not in scaled.generator_options() and scaled.capacity == 4
    assert scaled.generator_options()["autoscaling_config"]["max_replicas"] == 4
    assert "resources" not in scaled.ingress_options()["ray_actor_options"]


def test_cli_refuses_ray_options_without_ray_and_bad_ray_options(tmp_path: Path, capsys) -> None:
    from k6fast.server.cli import main

    base = ["--model", str(tmp_path / "no-model"), "--data-dir", str(tmp_path / "data")]
    assert main([*base, "--replicas", "2", "--address", "10.0.0.1:6379"]) == 2
    assert "--replicas, --address only apply with --ray" in capsys.readouterr().err
    assert main([*base, "--ray", "--gpus-per-replica", "2"]) == 2
    assert "--gpus-per-replica must be in [0, 1]" in capsys.readouterr().err
    assert main([*base, "--ray", "--replicas", "2", "--max-replicas", "1"]) == 2
    assert "--max-replicas must be an integer above --replicas" in capsys.readouterr().err


def test_store_restart_counts_an_attempt_only_for_a_running_job(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite3")
    try:
        store.create("video_" + "1" * 32, SPEC, "m", {}, max_queue=4)
        assert store.restart("video_" + "1" * 32) is None, "a queued job is not restarted"
        job = store.claim_next()
        store.set_progress(job.id, 40)
        again = store.restart(job.id)
        assert (again.status, again.attempts, again.progress) == ("in_progress", 2, 0)
        store.delete(job.id)
        assert store.restart(job.id) is None
    finally:
        store.close()


def test_replica_request_carries_the_stored_reference_image() -> None:
    buffer = io.BytesIO()
    PIL.Image.fromarray(np.full((8, 12, 3), (10, 200, 30), np.uint8)).save(buffer, format="PNG")
    request = request_from_spec(WITH_IMAGE, buffer.getvalue())
    assert request.image.size == (12, 8) and request.image.getpixel((0, 0)) == (10, 200, 30)
    assert (request.prompt, request.steps, request.seed, request.frames) == ("a bell", 4, 3, 5)
    assert request_from_spec(SPEC, None).image is None
    for unreadable in (None, b"not a png"):
        with pytest.raises(InputUnreadable):
            request_from_spec(WITH_IMAGE, unreadable)


def test_an_input_unreadable_on_disk_fails_as_invalid_input(tmp_path: Path) -> None:
    """Both dispatchers read the stored reference with `stored_input`: a file gone or unreadable since it was accepted
    (here a folder where the PNG was) is the job's invalid input, not a generation failure."""
    from types import SimpleNamespace

    from k6fast.server.dispatch import classify_failure, stored_input

    files = JobFiles(tmp_path)
    job = SimpleNamespace(id="video_" + "0" * 32, spec=WITH_IMAGE)
    for make_unreadable in (lambda path: None, lambda path: path.mkdir(parents=True)):
        make_unreadable(files.input_image(job.id))
        with pytest.raises(InputUnreadable) as caught:
            stored_input(files, job)
        assert classify_failure(caught.value)[0] == "invalid_input"

    class FailingDisk:  # the file is there, but reading it fails (EIO, or gone between a check and the read)
        def is_file(self) -> bool:
            return True

        def read_bytes(self) -> bytes:
            raise OSError(5, "Input/output error")

    with pytest.raises(InputUnreadable):
        stored_input(SimpleNamespace(input_image=lambda job_id: FailingDisk()), job)


class ScriptedHandle:
    """Stands in for the generator's DeploymentHandle: `options(stream=True).run.remote(payload)` returns the
    next scripted call, an iterator of what a replica streams (or raises)."""

    def __init__(self, *calls: Callable[[JobPayload], Iterator[Any]]):
        self.calls = list(calls)
        self.payloads: list[JobPayload] = []

    def options(self, stream: bool) -> ScriptedHandle:
        assert stream
        return self

    @property
    def run(self) -> ScriptedHandle:
        return self

    def remote(self, payload: JobPayload) -> Call:
        self.payloads.append(payload)
        return Call(self.calls[len(self.payloads) - 1](payload))


class Call:
    def __init__(self, messages: Iterator[Any]):
        self.messages = messages
        self.cancelled = threading.Event()

    def __iter__(self) -> Iterator[Any]:
        for message in self.messages:
            if callable(message):  # a step that waits for cancel()
                message(self.cancelled)
            else:
                yield message

    def cancel(self) -> None:
        self.cancelled.set()


def dies(replica: ReplicaIdentity) -> Callable[[JobPayload], Iterator[Any]]:
    def call(payload: JobPayload) -> Iterator[Any]:
        from ray.exceptions import ActorDiedError

        yield Started(replica)
        yield Progress(0, 4, (0.01,))
        raise ActorDiedError()

    return call


def finishes(replica: ReplicaIdentity, video: bytes, fit: Any = None) -> Callable[[JobPayload], Iterator[Any]]:
    def call(payload: JobPayload) -> Iterator[Any]:
        yield Started(replica, fit)
        yield Progress(1, 4, (0.01, 0.02))
        yield Finished(replica, 0.5, telemetry={"peak_vram_bytes": 7}, files=ClipFiles(video, b"{}\n", b"\xff\xd8"))

    return call


def waits_for_cancel(replica: ReplicaIdentity) -> Callable[[JobPayload], Iterator[Any]]:
    def call(payload: JobPayload) -> Iterator[Any]:
        from ray.exceptions import TaskCancelledError

        yield Started(replica)
        yield Progress(0, 4, (0.01,))

        def wait(cancelled: threading.Event) -> None:
            assert cancelled.wait(DEADLINE_S), "the dispatcher never cancelled the call"
            raise TaskCancelledError()

        yield wait

    return call


class Ingress:
    """A store, files and a RayDispatcher over a scripted handle, with one job queued."""

    def __init__(self, tmp_path: Path, handle: ScriptedHandle, max_attempts: int = 3):
        pytest.importorskip("ray")
        from k6fast.server.ray_dispatcher import ClusterModel, RayDispatcher

        self.config = ServerConfig(model="m", served_model_name="m", data_dir=tmp_path, max_attempts=max_attempts)
        self.store = JobStore(self.config.jobs_db)
        self.files = JobFiles(tmp_path)
        self.metrics = Metrics()
        self.job = self.store.create("video_" + "a" * 32, SPEC, "m", {}, max_queue=4)
        model = ClusterModel(ckpt=None, options=Options(), device="ray")
        self.dispatcher = RayDispatcher(
            self.store,
            self.files,
            model,
            Options(),
            self.config,
            self.metrics,
            generator=handle,
            settings=RaySettings(replicas=2),
            caller=("serve", "ingress"),
        )
        self.dispatcher.start()

    def until(self, check: Callable[[], Any], what: str) -> Any:
        return server_testing.until(check, what, DEADLINE_S)

    def finished(self, status: str) -> Any:
        """The job once it has `status` and the dispatcher is done with it (metrics counted, files settled)."""
        self.until(lambda: not self.dispatcher.running() and self.store.get(self.job.id).status == status, status)
        return self.store.get(self.job.id)

    def close(self) -> None:
        assert self.dispatcher.stop(DEADLINE_S)
        self.store.close()


def test_a_lost_replica_is_retried_and_the_clip_is_written_before_completion(tmp_path: Path) -> None:
    ingress = Ingress(tmp_path, ScriptedHandle(dies(REPLICA_A), finishes(REPLICA_B, b"mp4 bytes")))
    try:
        done = ingress.finished("completed")
        assert [p.attempt for p in ingress.dispatcher.generator.payloads] == [1, 2]
        assert all(
            p.caller == ("serve", "ingress") and p.job_id == done.id for p in ingress.dispatcher.generator.payloads
        )
        assert done.attempts == 2 and done.progress == 100
        ray_record = done.telemetry["ray"]
        assert ray_record["replica"] == REPLICA_B.as_dict() and ray_record["files"] == "object store"
        assert [lost["replica"]["replica"] for lost in ray_record["lost"]] == ["aaaa"]
        assert "ActorDiedError" in ray_record["lost"][0]["error"]
        assert ingress.files.video(done.id).read_bytes() == b"mp4 bytes"
        assert ingress.files.thumbnail(done.id).read_bytes() == b"\xff\xd8"
        assert (ingress.files.folder(done.id) / "video.mp4.json").read_bytes() == b"{}\n"
        assert not list(ingress.files.folder(done.id).glob(".*.tmp"))
        assert ingress.metrics.steps.count == 3 and ingress.metrics.outcomes["completed"] == 1
    finally:
        ingress.close()


def test_a_job_whose_replicas_keep_dying_fails_at_max_attempts(tmp_path: Path) -> None:
    ingress = Ingress(tmp_path, ScriptedHandle(*(dies(r) for r in (REPLICA_A, REPLICA_B, REPLICA_A))))
    try:
        failed = ingress.finished("failed")
        assert (failed.error_code, failed.attempts) == ("restart_limit", 3)
        assert "stopped 3 time(s) here and it was started 3 times in all" in failed.error_message
        assert len(ingress.dispatcher.generator.payloads) == 3
        assert not ingress.files.folder(failed.id).exists()
        assert ingress.metrics.outcomes["failed"] == 1
    finally:
        ingress.close()


def test_delete_cancels_the_call_and_shutdown_requeues(tmp_path: Path) -> None:
    ingress = Ingress(tmp_path, ScriptedHandle(waits_for_cancel(REPLICA_A), waits_for_cancel(REPLICA_B)))
    try:
        ingress.until(lambda: ingress.dispatcher.running().get(ingress.job.id), "the job to start")
        assert ingress.store.delete(ingress.job.id) is not None
        assert ingress.dispatcher.cancel(ingress.job.id)
        ingress.until(lambda: not ingress.dispatcher.running(), "the cancelled job to end")
        assert ingress.metrics.outcomes["cancelled"] == 1 and ingress.store.get(ingress.job.id) is None

        second = ingress.store.create("video_" + "b" * 32, SPEC, "m", {}, max_queue=4)
        ingress.dispatcher.notify()
        ingress.until(lambda: ingress.dispatcher.running().get(second.id) == REPLICA_B.as_dict(), "the next job")
        assert ingress.dispatcher.stop(DEADLINE_S)
        requeued = ingress.store.get(second.id)
        assert (requeued.status, requeued.attempts, requeued.progress) == ("queued", 0, 0)
        assert ingress.metrics.outcomes["requeued"] == 1
    finally:
        ingress.store.close()


def test_cluster_model_checks_requests_as_the_pipeline_does(tiny_distill: Path) -> None:
    from k6fast.checkpoint import open_checkpoint
    from k6fast.pipeline import Request, RequestError
    from k6fast.server.ray_dispatcher import ClusterModel

    model = ClusterModel(open_checkpoint(tiny_distill), Options(), "ray: 2 replica(s) on cuda")
    steps, guidance = model.resolve(Request(prompt="a bell", width=64, height=64, frames=5))
    assert (steps, guidance) == (model.ckpt.default_steps, 1.0)
    assert model.resolve(Request(prompt="a bell", width=64, height=64, frames=5, steps=3)) == (3, 1.0)
    with pytest.raises(RequestError, match="distilled"):
        model.resolve(Request(prompt="a bell", width=64, height=64, frames=5, guidance=2.0))
    with pytest.raises(RequestError, match="K6_PIFLOW_CACHE_STEPS"):
        ClusterModel(model.ckpt, Options(piflow_cache_steps=(8,)), "x").resolve(
            Request(prompt="a bell", width=64, height=64, frames=5, steps=4)
        )


class _Budget:
    """A replica's fit predicates over plain arithmetic (a FitModel): fits while width/16 x height/16 x (latent frames
    + 1) stays within `tokens`, as the DiT planner's activations do."""

    def __init__(self, tokens: int, budget_gb: int):
        self.tokens, self.budget_bytes = tokens, budget_gb * 2**30

    def fits(self, w: int, h: int, f: int) -> bool:
        return (w // 16) * (h // 16) * ((f - 1) // 4 + 2) <= self.tokens

    dit_fits = fits


def test_the_ingress_refuses_what_no_replica_fits_before_queueing_and_learns_budgets_from_started_jobs(
    tiny_distill: Path, tmp_path: Path
) -> None:
    """The Ray ingress's app over a scripted handle: a request the known replica's fit table refuses gets the 400 a
    pipeline gives (`fit.refusal` over the table; test_fit_table.py holds tables to `Pipeline.fits`), nothing is
    queued and no replica is asked; a replica with a larger budget that starts a job makes it fit."""
    pytest.importorskip("ray")
    pytest.importorskip("fastapi")
    import functools

    from fastapi.testclient import TestClient

    from k6fast.checkpoint import open_checkpoint
    from k6fast.fit import fit_table, refusal
    from k6fast.server.app import create_app
    from k6fast.server.ray_dispatcher import ClusterModel, RayDispatcher, ReplicaFits

    config = server_testing.tiny_server_config(tmp_path / "data", max_size=(640, 640), max_frames=97, max_queue=4)
    small = fit_table(_Budget(20 * 20 * 10, 24), max(config.max_size), config.max_frames)
    large = fit_table(_Budget(30 * 30 * 20, 80), max(config.max_size), config.max_frames)
    model = ClusterModel(open_checkpoint(tiny_distill), Options(), "ray: 2 replica(s) on cuda", ReplicaFits([small]))
    handle = ScriptedHandle(finishes(REPLICA_B, b"mp4 one", fit=large), finishes(REPLICA_B, b"mp4 two", fit=large))
    dispatcher = functools.partial(RayDispatcher, generator=handle, settings=RaySettings(replicas=2), caller=None)
    app = create_app(config, Options(), load=lambda: model, dispatcher=dispatcher)

    def create(size: str) -> Any:
        fields = {"prompt": "a fox", "size": size, "num_frames": "33", "num_inference_steps": "2"}
        return client.post("/v1/videos", files=[(k, (None, v)) for k, v in fields.items()])

    def completed(video_id: str) -> bool:
        return client.get(f"/v1/videos/{video_id}").json()["status"] == "completed"

    with TestClient(app) as client:
        server_testing.until(lambda: client.get("/health").status_code == 200, "the ingress to be ready")
        refused = create("336x336")
        assert refused.status_code == 400, refused.text
        error = server_testing.check_error_body(refused.json())
        assert (error["param"], error["code"]) == ("size", "invalid_value")
        assert error["message"] == refusal([small], 336, 336, 33)
        assert error["message"].startswith("336x336 with 33 frames does not fit the VRAM budget of 24.0 GiB")
        assert app.state.k6.store.queue_depth() == 0 and handle.payloads == [], "refused before it was queued"

        first = create("64x64")
        assert first.status_code == 200, first.text
        server_testing.until(lambda: completed(first.json()["id"]), "the fitting job to complete")
        assert model.replica_fits.tables == (small, large), "the replica that started the job told its budget"
        second = create("336x336")  # fits the larger replica's budget now known
        assert second.status_code == 200, second.text
        server_testing.until(lambda: completed(second.json()["id"]), "the second job to complete")
        assert [p.spec.request.width for p in handle.payloads] == [64, 336]
