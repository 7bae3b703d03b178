"""The ingress side of `k6fast serve --ray`: claims jobs from the store and runs each on a generator replica through
a Serve deployment handle, on the job loop the one-GPU worker runs too (dispatch.py: claiming, back-off, cancel and
what each outcome records):

- fit: a request no replica's VRAM budget fits gets the 400 `k6fast serve` gives (naming what fits) before it is
  queued, from the fit table each replica computed once at its start and sent with its card and each job's start
  (`ReplicaFits`); the ingress never asks a busy replica;
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
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..atomic import write_bytes_atomic
from ..fit import FitTable, refusal
from .config import ServerConfig
from .dispatch import FAILURES, InputUnreadable, JobLoop, Run, classify_failure, stored_input
from .jobs import RESTART_LIMIT_CODE, Job, JobFiles, JobStore
from .metrics import Metrics
from .ray_messages import Finished, JobPayload, Progress, ReplicaIdentity, Started
from .ray_replica import CANCELLED_CODE
from .ray_settings import RaySettings
from .storage import is_disk_full

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

    from ..checkpoint import Checkpoint
    from ..request import Request
    from ..switches import Options

log = logging.getLogger("k6fast.server")


class ReplicaFits:
    """The FitTables of the replicas the ingress has heard from (`describe`, then each job's `Started`), one per
    distinct budget: a request fits when it fits one of them. Nothing is asked of a replica per request: a replica
    takes one call at a time (`max_ongoing_requests`), so a question would wait behind its running job."""

    def __init__(self, tables: Iterable[FitTable] = ()):
        self._lock = threading.Lock()
        self._tables: tuple[FitTable, ...] = ()
        for table in tables:
            self.add(table)

    def add(self, table: FitTable) -> None:
        with self._lock:
            if table not in self._tables:
                self._tables = (*self._tables, table)

    @property
    def tables(self) -> tuple[FitTable, ...]:
        return self._tables

    def refusal(self, request: Request) -> str | None:
        """`fit.refusal` over the tables known now: None when the request fits (or none is known yet)."""
        return refusal(self._tables, request.width, request.height, request.frames)


@dataclass(frozen=True)
class ClusterModel:
    """The model as the HTTP side sees it when replicas hold the weights (see dispatch.py). It checks a request as a
    `Pipeline` does: against the checkpoint, then against what fits the replicas' VRAM budgets (`replica_fits`), so
    that an oversize request gets the same 400 naming what fits, before it is queued."""

    ckpt: Checkpoint
    options: Options
    device: str
    replica_fits: ReplicaFits = field(default_factory=ReplicaFits)

    def resolve(self, request: Request) -> tuple[int, float]:
        from ..request import RequestError, resolve_request

        resolved = resolve_request(self.ckpt, self.options, request)
        message = self.replica_fits.refusal(request)
        if message is not None:
            raise RequestError(message)
        return resolved


def describe_cluster(generator: DeploymentHandle, options: Options, settings: RaySettings) -> ClusterModel:
    """Ask a replica for the checkpoint's configs and what fits its budget (waits until one has loaded and warmed
    up)."""
    card = generator.describe.remote().result()
    count = f"{settings.replicas}-{settings.max_replicas}" if settings.max_replicas else str(settings.replicas)
    return ClusterModel(card.ckpt, options, f"ray: {count} replica(s) on {card.device}", ReplicaFits([card.fit]))


@dataclass
class _Run(Run):
    response: Any = None  # the Serve call of the current attempt
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


class RayDispatcher(JobLoop):
    """Runs the queue on a generator deployment, one job per replica; implements dispatch.Dispatcher. `caller` is
    the (namespace, name) of the ingress actor this runs in."""

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
        super().__init__(store, files, config, metrics, capacity=settings.capacity, name="k6fast-ray-dispatcher")
        self.model = model
        self.options = options
        self.generator = generator
        self.settings = settings
        self.caller = caller
        self._lost_errors = _replica_lost_errors()
        self._cancelled_errors = _cancelled_errors()

    def running(self) -> dict[str, dict[str, Any] | None]:
        """Jobs in flight and the replica running each (None until it has started)."""
        with self._lock:
            return {job_id: run.replica.as_dict() if run.replica else None for job_id, run in self._running.items()}

    def new_run(self, job_id: str) -> _Run:
        return _Run(job_id)

    def interrupt(self, run: _Run) -> None:
        with self._lock:
            response = run.response
        if response is not None:
            response.cancel()

    def execute(self, run: _Run, job: Job) -> None:
        started = time.perf_counter()
        lost: list[dict[str, Any]] = []
        try:
            image = stored_input(self.files, job)
        except InputUnreadable as exc:
            self.fail(run, job, *classify_failure(exc, "prepare"), exc=exc)
            return
        while True:
            outcome = self._attempt(run, job, image)
            if isinstance(outcome, Finished):
                if outcome.error is None:
                    self._complete(run, job, outcome, lost, started)
                elif outcome.error[0] == CANCELLED_CODE:
                    self.stopped(run, job, f" on replica {outcome.replica.replica}")
                else:
                    self.fail(run, job, *outcome.error)
                return
            if outcome is _CANCELLED or self.stopping.is_set() or run.cancelled:
                self.stopped(run, job)
                return
            lost.append({"replica": outcome.replica.as_dict() if outcome.replica else None, "error": outcome.message})
            if job.attempts >= self.config.max_attempts:
                log.error(
                    "job %s: replica lost on attempt %d, the last allowed (%s)", job.id, job.attempts, outcome.message
                )
                self.fail(
                    run,
                    job,
                    RESTART_LIMIT_CODE,
                    f"the replica running this job stopped {len(lost)} time(s) here and it was started "
                    f"{job.attempts} times in all; it is not retried again",
                )
                return
            restarted = self.store.restart(job.id)
            if restarted is None:  # deleted while its replica died
                self.stopped(run, job)
                return
            log.warning("job %s: replica lost (%s); attempt %d", job.id, outcome.message, restarted.attempts)
            job = restarted

    def _attempt(self, run: _Run, job: Job, image: bytes | None) -> Finished | _Lost | object:
        payload = JobPayload(job.id, job.spec, job.attempts, self.caller, image)
        response = self.generator.options(stream=True).run.remote(payload)
        with self._lock:
            run.response, run.replica = response, None
            cancel_now = self.should_stop(run)
        if cancel_now:
            response.cancel()
        try:
            for message in response:
                if isinstance(message, Started):
                    with self._lock:
                        run.replica = message.replica
                    if message.fit is not None:
                        self.model.replica_fits.add(message.fit)
                elif isinstance(message, Progress):
                    self.progress(job, message.step, message.total, message.step_seconds)
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
        from ..atomic import sidecar_path

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
                self.fail(run, job, *classify_failure(exc, "write"))
                return
            self.files.make_private(job.id)
        ray = {
            "replica": finished.replica.as_dict(),
            "attempts": job.attempts,
            "lost": lost,
            "files": "shared data dir" if finished.files is None else "object store",
        }
        self.complete(run, job, finished.telemetry, started, where=f" on replica {finished.replica.replica}", ray=ray)
