"""The ingress side of `k6fast serve --ray`: claims jobs from the store and runs each on a generator replica through
a Serve deployment handle, keeping the job contract of the one-GPU worker (worker.py):

- progress: each `Progress` a replica streams becomes the job's progress in the store, as the worker's steps do;
- cancel: a DELETE cancels the call; the replica stops the job at its next check (a DiT block, a decode op,
  a frame of the mux) and frees itself;
- files: written atomically into the data directory before the record says `completed` (by the ingress from the
  bytes the replica returned, or by the replica itself into a shared data directory);
- a full disk (storage.py): files that do not fit fail the job (`insufficient_storage`), nothing is claimed until
  there is room again, and an outcome that cannot be recorded yet is retried by the job's thread;
- faults: a replica that dies mid-job (killed, node lost, host OOM) costs the job one attempt; it starts again from
  its first step on a live replica while it has attempts left (`max_attempts`, the same bound as a server crash),
  and every lost attempt is recorded in the job's telemetry (`ray.lost`). A job's own error (CUDA out of memory
  included) fails that job only. An ingress that dies loses nothing: its restart re-queues the running jobs from
  the store (`JobStore.recover`) and the replicas drop the calls of the dead ingress (ray_replica.CallerWatch).

Jobs in flight: one per replica (`RaySettings.capacity`); the rest wait in the store's queue with its limit and 429.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..atomic import write_bytes_atomic
from .config import ServerConfig
from .jobs import RESTART_LIMIT_CODE, Job, JobFiles, JobStore
from .metrics import Metrics
from .ray_messages import Finished, JobPayload, Progress, ReplicaIdentity, Started
from .ray_replica import CANCELLED_CODE
from .ray_settings import RaySettings
from .storage import INSUFFICIENT_STORAGE, RECHECK_S, QueueReader, is_disk_full
from .worker import FAILURES, InputUnreadable, classify_failure, progress_after_step

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

    from ..checkpoint import Checkpoint
    from ..request import Request
    from ..switches import Options

log = logging.getLogger("k6fast.server")
_IDLE_POLL_S = 1.0


@dataclass(frozen=True)
class ClusterModel:
    """The model as the HTTP side sees it when replicas hold the weights (see dispatch.py)."""

    ckpt: Checkpoint
    options: Options
    device: str

    def resolve(self, request: Request) -> tuple[int, float]:
        from ..request import resolve_request

        return resolve_request(self.ckpt, self.options, request)


def describe_cluster(generator: DeploymentHandle, options: Options, settings: RaySettings) -> ClusterModel:
    """Ask a replica for the checkpoint's configs (waits until one has loaded and warmed up)."""
    card = generator.describe.remote().result()
    count = f"{settings.replicas}-{settings.max_replicas}" if settings.max_replicas else str(settings.replicas)
    return ClusterModel(card.ckpt, options, f"ray: {count} replica(s) on {card.device}")


@dataclass
class _Run:
    job_id: str
    thread: threading.Thread | None = None
    response: Any = None  # the Serve call of the current attempt
    cancelled: bool = False  # deleted by a client (not a shutdown)
    replica: ReplicaIdentity | None = None


@dataclass(frozen=True)
class _Lost:
    """The replica running the attempt died (or could not be reached)."""

    replica: ReplicaIdentity | None
    message: str


_CANCELLED = object()
_REPLICA_ERROR = ("generation_failed", FAILURES["generation_failed"].format(stage="on its replica"))


def _replica_lost_errors() -> tuple[type[BaseException], ...]:
    from ray.exceptions import OutOfMemoryError, RayActorError, WorkerCrashedError
    from ray.serve.exceptions import ReplicaUnavailableError

    return (RayActorError, ReplicaUnavailableError, WorkerCrashedError, OutOfMemoryError)


def _cancelled_errors() -> tuple[type[BaseException], ...]:
    from ray.exceptions import TaskCancelledError  # RequestCancelledError is one

    return (TaskCancelledError, concurrent.futures.CancelledError, asyncio.CancelledError)


class RayDispatcher:
    """Runs the queue on a generator deployment; implements dispatch.Dispatcher. `caller` is the (namespace, name)
    of the ingress actor this runs in."""

    def __init__(
        self,
        store: JobStore,
        files: JobFiles,
        model: ClusterModel,
        options: Options,
        config: ServerConfig,
        metrics: Metrics,
        *,
        generator: DeploymentHandle,
        settings: RaySettings,
        caller: tuple[str, str] | None = None,
    ):
        self.store = store
        self.files = files
        self.model = model
        self.options = options
        self.config = config
        self.metrics = metrics
        self.storage = files.storage
        self.generator = generator
        self.settings = settings
        self.caller = caller
        self._running: dict[str, _Run] = {}
        # Deleted while being claimed (in progress in the store, not yet running here): stopped as soon as they start.
        self._doomed: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="k6fast-ray-dispatcher", daemon=True)
        self._lost_errors = _replica_lost_errors()
        self._cancelled_errors = _cancelled_errors()

    def start(self) -> None:
        self.storage.ensure_reserve()
        self._thread.start()

    def notify(self) -> None:
        self._wake.set()

    @property
    def current_job_id(self) -> str | None:
        with self._lock:
            return next(iter(self._running), None)

    def running(self) -> dict[str, dict[str, Any] | None]:
        """Jobs in flight and the replica running each (None until it has started)."""
        with self._lock:
            return {job_id: run.replica.as_dict() if run.replica else None for job_id, run in self._running.items()}

    def cancel(self, job_id: str) -> bool:
        with self._lock:
            run = self._running.get(job_id)
            if run is None:
                self._doomed.add(job_id)
                return False
            run.cancelled = True
            response = run.response
        if response is not None:
            response.cancel()
        return True

    def stop(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():  # first, so that no job is claimed after the ones cancelled below
            self._thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            runs = list(self._running.values())
            responses = [run.response for run in runs if run.response is not None]
        for response in responses:
            response.cancel()
        threads = [self._thread] + [run.thread for run in runs if run.thread is not None]
        for thread in threads:
            if thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in threads)

    def _loop(self) -> None:
        queue = QueueReader(self.store.claim_next, self.storage)
        while not self._stopping.is_set():
            self._wake.clear()
            with self._lock:
                full = len(self._running) >= self.settings.capacity
            if full:
                self._wake.wait(_IDLE_POLL_S)
                continue
            job = queue.claim()
            if job is None:
                if queue.blocked:  # a full disk or a failing store: a new job changes nothing, so no early wake-up
                    self._stopping.wait(RECHECK_S)
                else:
                    self._wake.wait(_IDLE_POLL_S)
                continue
            run = _Run(job.id)
            run.thread = threading.Thread(target=self._run_job, args=(run, job), name=f"k6fast-{job.id}", daemon=True)
            with self._lock:
                run.cancelled = job.id in self._doomed
                self._doomed.clear()  # one claim at a time: nothing else can be between claimed and running
                self._running[job.id] = run
            run.thread.start()

    def _run_job(self, run: _Run, job: Job) -> None:
        try:
            self._execute(run, job)
        except Exception:
            log.exception("job %s: could not record its outcome", job.id)
        finally:
            with self._lock:
                self._running.pop(job.id, None)
            self._wake.set()

    def _execute(self, run: _Run, job: Job) -> None:
        started = time.perf_counter()
        lost: list[dict[str, Any]] = []
        image = None
        if job.spec.image:
            try:
                image = self.files.input_image(job.id).read_bytes()
            except OSError as exc:
                log.error("job %s: the stored input reference is unreadable (%s)", job.id, exc)
                self._fail(run, job, *classify_failure(InputUnreadable(), "prepare"))
                return
        while True:
            outcome = self._attempt(run, job, image)
            if isinstance(outcome, Finished):
                if outcome.error is None:
                    self._complete(run, job, outcome, lost, started)
                elif outcome.error[0] == CANCELLED_CODE:
                    self._cancelled(run, job)
                else:
                    self._fail(run, job, *outcome.error)
                return
            if outcome is _CANCELLED or self._stopping.is_set() or run.cancelled:
                self._cancelled(run, job)
                return
            lost.append({"replica": outcome.replica.as_dict() if outcome.replica else None, "error": outcome.message})
            if job.attempts >= self.config.max_attempts:
                log.error(
                    "job %s: replica lost on attempt %d, the last allowed (%s)", job.id, job.attempts, outcome.message
                )
                self._fail(
                    run,
                    job,
                    RESTART_LIMIT_CODE,
                    f"the replica running this job stopped {len(lost)} time(s) here and it was started "
                    f"{job.attempts} times in all; it is not retried again",
                )
                return
            restarted = self.store.restart(job.id)
            if restarted is None:  # deleted while its replica died
                self._cancelled(run, job)
                return
            log.warning("job %s: replica lost (%s); attempt %d", job.id, outcome.message, restarted.attempts)
            job = restarted

    def _attempt(self, run: _Run, job: Job, image: bytes | None) -> Finished | _Lost | object:
        payload = JobPayload(job.id, job.spec, job.attempts, self.caller, image)
        response = self.generator.options(stream=True).run.remote(payload)
        with self._lock:
            run.response, run.replica = response, None
            cancel_now = run.cancelled or self._stopping.is_set()
        if cancel_now:
            response.cancel()
        try:
            for message in response:
                if isinstance(message, Started):
                    with self._lock:
                        run.replica = message.replica
                elif isinstance(message, Progress):
                    for seconds in message.step_seconds:
                        self.metrics.observe_step(seconds)
                    self.store.set_progress(job.id, progress_after_step(message.step, message.total))
                elif isinstance(message, Finished):
                    return message
        except self._cancelled_errors:
            return _CANCELLED
        except self._lost_errors as exc:
            return _Lost(run.replica, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        except Exception:
            # The replica's own code raised (a bug, not the job's input): fail this job only.
            log.exception("job %s: the replica call failed", job.id)
            return Finished(run.replica, 0.0, error=_REPLICA_ERROR)
        finally:
            with self._lock:
                run.response = None
        log.error("job %s: the replica ended the call without an outcome", job.id)
        return Finished(run.replica, 0.0, error=_REPLICA_ERROR)

    def _complete(self, run: _Run, job: Job, finished: Finished, lost: list[dict[str, Any]], started: float) -> None:
        from ..output import sidecar_path

        if finished.files is not None:
            try:
                self.files.folder(job.id, create=True)
                # The thumbnail and sidecar first: a clip that is present is complete with its companions.
                write_bytes_atomic(self.files.thumbnail(job.id), finished.files.thumbnail)
                write_bytes_atomic(sidecar_path(self.files.video(job.id)), finished.files.sidecar)
                write_bytes_atomic(self.files.video(job.id), finished.files.video)
            except OSError as exc:
                if not is_disk_full(exc):
                    raise
                self._fail(run, job, *classify_failure(exc, "write"))
                return
            self.files.make_private(job.id)
        seconds = time.perf_counter() - started
        telemetry = dict(finished.telemetry)
        telemetry["job_s"] = round(seconds, 6)
        telemetry["ray"] = {
            "replica": finished.replica.as_dict(),
            "attempts": job.attempts,
            "lost": lost,
            "files": "shared data dir" if finished.files is None else "object store",
        }
        recorded = self.storage.write_with_room(
            lambda: self.store.complete(job.id, telemetry, self.config.ttl_seconds),
            gone=lambda: run.cancelled,
            stopping=self._stopping,
        )
        if recorded:
            self.files.input_image(job.id).unlink(missing_ok=True)
            self.metrics.observe_job("completed", seconds, int(telemetry.get("peak_vram_bytes", 0)))
            log.info("job %s: completed in %.1f s on replica %s", job.id, seconds, finished.replica.replica)
        else:
            self.files.remove(job.id)  # deleted after its last check
            self.metrics.observe_job("cancelled")

    def _fail(self, run: _Run, job: Job, code: str, message: str) -> None:
        if code == INSUFFICIENT_STORAGE:
            self.storage.full()
        # Record first, files second (see worker.py), unless the disk is too full to record anything.
        recorded = self.storage.write_with_room(
            lambda: self.store.fail(job.id, code, message, self.config.ttl_seconds),
            free=lambda: self.files.remove(job.id),
            gone=lambda: run.cancelled,
            stopping=self._stopping,
        )
        self.files.remove(job.id)
        if recorded:
            log.error("job %s: failed (%s) %s", job.id, code, message)
            self.metrics.observe_job("failed")
        else:
            self.metrics.observe_job("cancelled")

    def _cancelled(self, run: _Run, job: Job) -> None:
        if run.cancelled:
            self.files.remove(job.id)
            self.metrics.observe_job("cancelled")
            log.info("job %s: cancelled (deleted)", job.id)
        else:
            self.store.requeue(job.id)
            self.metrics.observe_job("requeued")
            log.info("job %s: interrupted by shutdown, back in the queue", job.id)
