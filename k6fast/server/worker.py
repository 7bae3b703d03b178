"""The one GPU worker: a thread that runs jobs oldest first, reports progress every step, and stops part-way when its
job is deleted or the server shuts down: within one DiT block, one video decode op or one encoded frame, whichever
phase the job is in (k6fast.cancel). The stop is logged with the phase it happened in, the job's memory is released
and the next job starts.

A job's outcome is decided here, and each outcome touches only that job: an exception (out of memory included)
fails the job and the worker takes the next one. A failed job's error says what happened in fixed words; the
exception and its traceback go to the server log under the job's id. Files are written before the record says
`completed`; a record that vanished while the job ran (DELETE) means the files just written are removed again.

A full disk (storage.py) fails the job that could not write its files (`insufficient_storage`), and the worker then
starts nothing until there is room again. A job whose outcome cannot be recorded for want of space stays with the
worker, which retries, so no job is `in_progress` in the store without a worker holding it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .config import ServerConfig, frames_for_seconds
from .images import decode_stored
from .jobs import Job, JobFiles, JobSpec, JobStore, write_image
from .metrics import Metrics
from .storage import INSUFFICIENT_STORAGE, RECHECK_S, QueueReader, is_disk_full

if TYPE_CHECKING:
    from ..pipeline import Pipeline, Result
    from ..request import Request
    from ..sampler import StepEvent
    from ..switches import Options

log = logging.getLogger("k6fast.server")
_IDLE_POLL_S = 1.0  # the worker also looks at the queue this often without being woken
WARMUP_SIZE = 64  # width and height of the warm-up clip
WARMUP_FRAMES = 5


def load_pipeline(config: ServerConfig, options: Options) -> Pipeline:
    """Load the checkpoint and run one small generation, so that the first request pays no first-call costs
    (kernel selection, allocator growth, lazy imports)."""
    import torch

    from ..pipeline import Pipeline
    from ..request import Request

    dtype = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[config.dtype]
    # Resident blocks are planned for the default request; a larger one streams more of them for its own run, and
    # one that cannot fit the budget at all is refused before it is queued (`Pipeline.resolve`).
    plan_geometry = (*config.default_size, frames_for_seconds(config.default_seconds))
    pipeline = Pipeline(config.model, options, device=config.device, dtype=dtype, plan_geometry=plan_geometry)
    # Two steps touch every phase; a cached-step switch needs the schedule long enough to contain its steps.
    steps = max(2, *(s + 1 for s in options.piflow_cache_steps)) if options.piflow_cache_steps else 2
    started = time.perf_counter()
    pipeline.generate(
        Request(prompt="warm-up", width=WARMUP_SIZE, height=WARMUP_SIZE, frames=WARMUP_FRAMES, steps=steps)
    )
    log.info("warm-up generation took %.1f s", time.perf_counter() - started)
    return pipeline


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


def progress_after_step(index: int, total: int) -> int:
    """Percent after step `index` (0-based) of `total`: decoding and writing follow the last step, so the steps
    take the range up to 100 * total / (total + 1) and 100 is reached only when the MP4 is written."""
    return (index + 1) * 100 // (total + 1)


class Worker:
    """Runs the queue on one pipeline. `notify()` after queueing a job, `cancel(id)` after deleting a running one."""

    def __init__(
        self,
        store: JobStore,
        files: JobFiles,
        pipeline: Pipeline,
        options: Options,
        config: ServerConfig,
        metrics: Metrics,
    ):
        self.store = store
        self.files = files
        self.pipeline = pipeline
        self.options = options
        self.config = config
        self.metrics = metrics
        self.storage = files.storage
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._current: str | None = None
        self._cancel_current = False
        # Deleted while the worker was claiming them (in progress in the store, not yet the current job).
        self._doomed: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="k6fast-gpu-worker", daemon=True)

    def start(self) -> None:
        self.storage.ensure_reserve()
        self._thread.start()

    def notify(self) -> None:
        self._wake.set()

    @property
    def current_job_id(self) -> str | None:
        return self._current

    def cancel(self, job_id: str) -> bool:
        """Ask the running job to stop at its next check (a DiT block, a decode op, a frame of the mux); False when
        `job_id` is not running yet (it is stopped as soon as it starts, should the worker be claiming it now)."""
        with self._lock:
            if self._current != job_id:
                self._doomed.add(job_id)
                return False
            self._cancel_current = True
            return True

    def stop(self, timeout: float) -> bool:
        """Stop the running job at its next check (the job goes back to the queue); True if stopped."""
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _should_stop(self) -> bool:
        return self._stopping.is_set() or self._cancel_current

    def _run(self) -> None:
        queue = QueueReader(self.store.claim_next, self.storage)
        while not self._stopping.is_set():
            self._wake.clear()
            job = queue.claim()
            if job is None:
                if queue.blocked:  # a full disk or a failing store: a new job changes nothing, so no early wake-up
                    self._stopping.wait(RECHECK_S)
                else:
                    self._wake.wait(_IDLE_POLL_S)
                continue
            with self._lock:
                self._current, self._cancel_current = job.id, job.id in self._doomed
                self._doomed.clear()
            try:
                self._execute(job)
            except Exception:
                # Only the store itself failing lands here (the job's own errors are handled in _execute).
                log.exception("job %s: could not record its outcome", job.id)
                self._stopping.wait(RECHECK_S)
            finally:
                with self._lock:
                    self._current, self._cancel_current = None, False
                self._free_memory()

    def _request(self, job: Job) -> Request:
        image = None
        if job.spec.image:
            # Missing or unreadable since it was accepted: request_from_spec then raises InputUnreadable.
            with contextlib.suppress(OSError):
                image = self.files.input_image(job.id).read_bytes()
        return request_from_spec(job.spec, image)

    def _execute(self, job: Job) -> None:
        from ..cancel import Cancelled

        log.info(
            "job %s: started (attempt %d, %s, %d frames, %d steps)",
            job.id,
            job.attempts,
            job.spec.size,
            job.spec.request.frames,
            job.spec.request.steps,
        )
        started = time.perf_counter()
        stage = ["prepare"]  # where the job is, for a failure's message (the pipeline reports only its steps)

        def on_step(event: StepEvent) -> None:
            stage[0] = "decode" if event.index + 1 == event.total else "denoise"
            self.metrics.observe_step(event.seconds)
            try:
                self.store.set_progress(job.id, progress_after_step(event.index, event.total))
            except Exception as exc:  # progress is a hint: a full disk shows when the job's files are written
                if not is_disk_full(exc):
                    raise
                self.storage.full()

        try:
            request = self._request(job)
            result = self._generate(job, request, on_step)
            stage[0] = "write"
            telemetry = self._finish(job, result)
        except Cancelled as exc:
            seconds = time.perf_counter() - started
            if self._cancel_current:
                self.files.remove(job.id)
                self.metrics.observe_job("cancelled")
                log.info(
                    "job %s: cancelled (deleted) during %s (%s) after %.1f s", job.id, exc.phase, exc.where, seconds
                )
            else:
                self.store.requeue(job.id)
                self.metrics.observe_job("requeued")
                log.info("job %s: stopped by shutdown during %s (%s), back in the queue", job.id, exc.phase, exc.where)
            return
        except Exception as exc:
            code, message = classify_failure(exc, stage[0])
            if code == INSUFFICIENT_STORAGE:
                self.storage.full()
            # Record first, files second: a crash in between must not leave a re-runnable job without its input
            # (unless the disk is too full to record anything: the files then go first, to make room).
            recorded = self._record(
                lambda: self.store.fail(job.id, code, message, self.config.ttl_seconds),
                free=lambda: self.files.remove(job.id),
            )
            self.files.remove(job.id)
            if recorded:
                log.error("job %s: failed (%s) %s", job.id, code, STAGES[stage[0]], exc_info=exc)
                self.metrics.observe_job("failed")
            else:
                self.metrics.observe_job("cancelled")
            return
        seconds = time.perf_counter() - started
        telemetry["job_s"] = round(seconds, 6)
        if self._record(lambda: self.store.complete(job.id, telemetry, self.config.ttl_seconds)):
            self.files.input_image(job.id).unlink(missing_ok=True)
            self.metrics.observe_job("completed", seconds, int(telemetry.get("peak_vram_bytes", 0)))
            log.info("job %s: completed in %.1f s", job.id, seconds)
        else:
            # Deleted after its last step boundary: the record is gone, so the files must go too.
            self.files.remove(job.id)
            self.metrics.observe_job("cancelled")

    def _record(self, write: Callable[[], bool], free: Callable[[], None] | None = None) -> bool:
        """A store write of the running job's outcome, retried until the disk has room for it (storage.py); False
        when the job no longer exists (deleted meanwhile)."""
        return bool(
            self.storage.write_with_room(write, free=free, gone=lambda: self._cancel_current, stopping=self._stopping)
        )

    def _generate(self, job: Job, request: Request, on_step: Callable[[StepEvent], None]) -> Result:
        """The job's clip, its MP4 encoded while the video decodes (`generate_to_mp4`: written atomically, with its
        sidecar; a stop or an error leaves neither)."""
        from ..output import generate_to_mp4

        self.files.folder(job.id, create=True)
        return generate_to_mp4(
            self.pipeline,
            request,
            self.files.video(job.id),
            self.config.model,
            on_step=on_step,
            should_stop=self._should_stop,
        )

    def _finish(self, job: Job, result: Result) -> dict[str, Any]:
        """The thumbnail beside the clip; the job's telemetry."""
        import PIL.Image

        from ..output import frames_to_uint8

        first = PIL.Image.fromarray(frames_to_uint8(result.frames[:1])[0])
        write_image(first, self.files.thumbnail(job.id), "JPEG", quality=90)
        self.files.make_private(job.id)
        return result.telemetry.as_dict()

    def _free_memory(self) -> None:
        # An exception that unwound a job may leave its tensors in reference cycles (an exception held by a frame on
        # its own traceback); collect them before the allocator's cache is emptied, so the next job starts with the
        # memory free.
        gc.collect()
        device = getattr(self.pipeline, "device", None)
        if getattr(device, "type", None) == "cuda":
            import torch

            with contextlib.suppress(RuntimeError):
                torch.cuda.empty_cache()


def request_from_spec(spec: JobSpec, image_bytes: bytes | None) -> Request:
    """The pipeline request of a stored job, its input reference decoded here, as the job starts, from the upload's
    bytes the ingress stored (PNG, JPEG or WebP); InputUnreadable when they are missing or cannot be decoded."""
    if not spec.image:
        return spec.request
    if image_bytes is None:
        raise InputUnreadable()
    try:
        image = decode_stored(image_bytes)
    except Exception as exc:
        raise InputUnreadable() from exc
    return dataclasses.replace(spec.request, image=image)
