"""What runs the queue: the contract between the HTTP side and whatever executes jobs, and the job loop every
implementation of it shares.

Two implementations: `worker.Worker` (one pipeline in this process, one job at a time) and
`ray_dispatcher.RayDispatcher` (Ray Serve replicas, one job per replica). The app holds either as `state.worker`
and talks to it only through `Dispatcher`; the job store is the one place a job's state lives, so the HTTP side
never needs to know where a job runs.

Both are a `JobLoop`: one thread claims jobs oldest first while fewer than `capacity` run, waits when the queue is
empty (woken by `notify`) or blocked (a full disk or a failing store: storage.py), and runs each job on a thread of
its own through the implementation's `execute`. The loop owns what a job's outcome does to the store, its files and
the metrics, the same wherever the job ran:
- completed: the files are written before the record says so; a record that vanished meanwhile (DELETE) means the
  files just written are removed again;
- failed: fixed words per error code and stage (`FAILURES`, `STAGES`), never an exception's text; the exception goes
  to the server log under the job's id; the record is written before the files are removed;
- stopped: a deleted job's files are removed; a job stopped by shutdown goes back to its place in the queue;
- an outcome that cannot be recorded for want of space is retried (storage.py), so no job is `in_progress` in the
  store without a dispatcher holding it.

What the app needs from the model it serves (`state.pipeline`) is likewise small: `ckpt` (the checkpoint's configs,
for /health and request defaults), `device` (reported by /health) and `resolve(request)` (checking a request before it
is queued). A loaded `Pipeline` has all three; so does `ray_dispatcher.ClusterModel`, which loads no weights.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .storage import INSUFFICIENT_STORAGE, RECHECK_S, QueueReader, is_disk_full

if TYPE_CHECKING:
    from ..sampler import StepEvent
    from ..switches import Options
    from .config import ServerConfig
    from .jobs import Job, JobFiles, JobStore
    from .metrics import Metrics

log = logging.getLogger("k6fast.server")
IDLE_POLL_S = 1.0  # a dispatcher also looks at the queue this often without being woken


class Dispatcher(Protocol):
    def start(self) -> None:
        """Begin claiming queued jobs from the store."""

    def notify(self) -> None:
        """A job was queued: look at the queue now rather than at the next poll."""

    def cancel(self, job_id: str) -> bool:
        """The running job `job_id` was deleted: stop it at its next check; False when it is not running."""

    def stop(self, timeout: float) -> bool:
        """Stop claiming; running jobs go back to the queue at their next check. True when all stopped."""

    @property
    def current_job_id(self) -> str | None:
        """A running job's id (any one of them where several run), None when idle."""


# Called once the model is ready: (store, files, model, options, config, metrics) -> a dispatcher, not yet started.
DispatcherFactory = Callable[["JobStore", "JobFiles", Any, "Options", "ServerConfig", "Metrics"], Dispatcher]


class InputUnreadable(Exception):
    """The job's stored input image could not be opened again."""


# Error code → the message a client sees, {stage} being where the job was (STAGES); the exception and its traceback
# are in the server log, under the job's id.
FAILURES = {
    "out_of_memory": "the server ran out of memory {stage}; a smaller size or fewer frames may fit",
    "invalid_request": (
        "this video cannot be generated within the server's memory budget and settings (it stopped {stage}); a "
        "smaller size or fewer frames may fit"
    ),
    "invalid_input": "the stored input_reference image of this job could not be read back; submit the job again",
    INSUFFICIENT_STORAGE: (
        "the server's disk was full {stage}, so the video could not be stored; submit the job again once there is "
        "room (deleting finished videos frees it)"
    ),
    "generation_failed": "generation failed {stage} because of an error in the server; its log has the details",
}
STAGES = {
    "prepare": "before its first denoising step completed",
    "denoise": "while denoising",
    "decode": "after denoising, while decoding the video and audio",
    "write": "while writing the MP4",
}


def classify_failure(exc: BaseException, stage: str = "prepare") -> tuple[str, str]:
    """(error code, message) recorded on a failed job: fixed words per code and stage (a key of STAGES), never the
    exception's text."""
    import torch

    from ..request import RequestError

    if is_disk_full(exc):
        code = INSUFFICIENT_STORAGE
    elif isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)):
        code = "out_of_memory"
    elif isinstance(exc, RequestError):
        code = "invalid_request"
    elif isinstance(exc, InputUnreadable):
        code = "invalid_input"
    else:
        code = "generation_failed"
    return code, FAILURES[code].format(stage=STAGES[stage])


class Stage:
    """Where a running job is, a key of STAGES, for a failure's message (the pipeline reports only its steps)."""

    def __init__(self) -> None:
        self.name = "prepare"

    def after_step(self, event: StepEvent) -> None:
        self.name = "decode" if event.index + 1 == event.total else "denoise"


def progress_after_step(index: int, total: int) -> int:
    """Percent after step `index` (0-based) of `total`: decoding and writing follow the last step, so the steps
    take the range up to 100 * total / (total + 1) and 100 is reached only when the MP4 is written."""
    return (index + 1) * 100 // (total + 1)


def stored_input(files: JobFiles, job: Job) -> bytes | None:
    """The bytes of the job's stored input reference, None when it has none; InputUnreadable when they are gone or
    cannot be read since the job was accepted."""
    if not job.spec.image:
        return None
    try:
        return files.input_image(job.id).read_bytes()
    except OSError as exc:
        raise InputUnreadable() from exc


@dataclass
class Run:
    """A job a dispatcher runs: its thread, and whether a client deleted it (else a stop is a shutdown's)."""

    job_id: str
    thread: threading.Thread | None = None
    cancelled: bool = False


class JobLoop(ABC):
    """The queue loop and the job outcomes a dispatcher shares (the module's docstring says what each does). An
    implementation gives `execute(run, job)`, which ends each job with one of `complete`, `fail` or `stopped`, and
    where it needs to: `new_run` (a `Run` that holds more), `interrupt` (stop a run that does not poll
    `should_stop`) and `after_job` (release what a job left)."""

    def __init__(
        self, store: JobStore, files: JobFiles, config: ServerConfig, metrics: Metrics, *, capacity: int, name: str
    ):
        self.store = store
        self.files = files
        self.config = config
        self.metrics = metrics
        self.storage = files.storage
        self.capacity = capacity
        self.stopping = threading.Event()
        self._running: dict[str, Run] = {}
        # Deleted while being claimed (in progress in the store, not yet running here): stopped as soon as they start.
        self._doomed: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    # The implementation's part.

    @abstractmethod
    def execute(self, run: Run, job: Job) -> None:
        """Run `job` (claimed, recorded in `run`) and end it with `complete`, `fail` or `stopped`."""

    def new_run(self, job_id: str) -> Run:
        return Run(job_id)

    def interrupt(self, run: Run) -> None:
        """Called after `run` was cancelled or the loop told to stop; a run that polls `should_stop` needs nothing."""
        return None  # the default: nothing to interrupt

    def after_job(self) -> None:
        """Called on the job's thread once it has ended, before the next job can start."""
        return None  # the default: nothing to release

    # Dispatcher.

    def start(self) -> None:
        self.storage.ensure_reserve()
        self._thread.start()

    def notify(self) -> None:
        self._wake.set()

    @property
    def current_job_id(self) -> str | None:
        with self._lock:
            return next(iter(self._running), None)

    def cancel(self, job_id: str) -> bool:
        """Ask the running job to stop at its next check; False when `job_id` is not running yet (it is stopped as
        soon as it starts, should it be being claimed now)."""
        with self._lock:
            run = self._running.get(job_id)
            if run is None:
                self._doomed.add(job_id)
                return False
            run.cancelled = True
        self.interrupt(run)
        return True

    def stop(self, timeout: float) -> bool:
        """Stop claiming and stop the running jobs at their next check (they go back to the queue); True when every
        thread has ended within `timeout`."""
        deadline = time.monotonic() + timeout
        self.stopping.set()
        self._wake.set()
        if self._thread.is_alive():  # first, so that no job is claimed after the ones interrupted below
            self._thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            runs = list(self._running.values())
        for run in runs:
            self.interrupt(run)
        threads = [self._thread] + [run.thread for run in runs if run.thread is not None]
        for thread in threads:
            if thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in threads)

    def should_stop(self, run: Run) -> bool:
        return self.stopping.is_set() or run.cancelled

    # The loop.

    def _loop(self) -> None:
        queue = QueueReader(self.store.claim_next, self.storage)
        while not self.stopping.is_set():
            self._wake.clear()
            with self._lock:
                full = len(self._running) >= self.capacity
            if full:
                self._wake.wait(IDLE_POLL_S)
                continue
            job = queue.claim()
            if job is None:
                if queue.blocked:  # a full disk or a failing store: a new job changes nothing, so no early wake-up
                    self.stopping.wait(RECHECK_S)
                else:
                    self._wake.wait(IDLE_POLL_S)
                continue
            run = self.new_run(job.id)
            run.thread = threading.Thread(target=self._run_job, args=(run, job), name=f"k6fast-{job.id}", daemon=True)
            with self._lock:
                run.cancelled = job.id in self._doomed
                self._doomed.clear()  # one claim at a time: nothing else can be between claimed and running
                self._running[job.id] = run
            run.thread.start()

    def _run_job(self, run: Run, job: Job) -> None:
        try:
            self.execute(run, job)
        except Exception:
            # Only the store itself failing lands here (a job's own errors are its outcome): wait before the next.
            log.exception("job %s: could not record its outcome", job.id)
            self.stopping.wait(RECHECK_S)
        finally:
            self.after_job()
            with self._lock:
                self._running.pop(job.id, None)
            self._wake.set()

    # Outcomes.

    def progress(self, job: Job, index: int, total: int, step_seconds: Iterable[float]) -> None:
        """Steps up to `index` (0-based) of `total` are done, these ones having taken `step_seconds`."""
        for seconds in step_seconds:
            self.metrics.observe_step(seconds)
        try:
            self.store.set_progress(job.id, progress_after_step(index, total))
        except Exception as exc:  # progress is a hint: a full disk shows when the job's files are written
            if not is_disk_full(exc):
                raise
            self.storage.full()

    def complete(
        self, run: Run, job: Job, telemetry: dict[str, Any], started: float, *, where: str = "", **extra: Any
    ) -> None:
        """The job's files are written: record it completed, with its telemetry, the job's wall time since
        `started` (time.perf_counter) and `extra`."""
        seconds = time.perf_counter() - started
        telemetry = {**telemetry, "job_s": round(seconds, 6), **extra}
        if self._record(run, lambda: self.store.complete(job.id, telemetry, self.config.ttl_seconds)):
            self.files.input_image(job.id).unlink(missing_ok=True)
            self.metrics.observe_job("completed", seconds, int(telemetry.get("peak_vram_bytes", 0)))
            log.info("job %s: completed in %.1f s%s", job.id, seconds, where)
        else:
            # Deleted after its last check: the record is gone, so the files must go too.
            self.files.remove(job.id)
            self.metrics.observe_job("cancelled")

    def fail(
        self, run: Run, job: Job, code: str, message: str, *, detail: str = "", exc: BaseException | None = None
    ) -> None:
        """Record the job failed with `code` and `message` (what a client sees); `detail` and `exc` go to the log."""
        if code == INSUFFICIENT_STORAGE:
            self.storage.full()
        # Record first, files second: a crash in between must not leave a re-runnable job without its input (unless
        # the disk is too full to record anything: the files then go first, to make room).
        recorded = self._record(
            run,
            lambda: self.store.fail(job.id, code, message, self.config.ttl_seconds),
            free=lambda: self.files.remove(job.id),
        )
        self.files.remove(job.id)
        if recorded:
            log.error("job %s: failed (%s) %s", job.id, code, detail or message, exc_info=exc)
            self.metrics.observe_job("failed")
        else:
            self.metrics.observe_job("cancelled")

    def stopped(self, run: Run, job: Job, detail: str = "") -> None:
        """The job stopped before its end: deleted (its files go) or stopped by a shutdown (back in the queue)."""
        if run.cancelled:
            self.files.remove(job.id)
            self.metrics.observe_job("cancelled")
            log.info("job %s: cancelled (deleted)%s", job.id, detail)
        else:
            self.store.requeue(job.id)
            self.metrics.observe_job("requeued")
            log.info("job %s: stopped by shutdown%s, back in the queue", job.id, detail)

    def _record(self, run: Run, write: Callable[[], bool], free: Callable[[], None] | None = None) -> bool:
        """A store write of the job's outcome, retried until the disk has room for it (storage.py); False when the
        job no longer exists (deleted meanwhile)."""
        return bool(self.storage.write_with_room(write, free=free, gone=lambda: run.cancelled, stopping=self.stopping))
