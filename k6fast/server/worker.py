"""The one GPU worker: a thread that runs jobs oldest first, reports progress every step, and stops at a step
boundary when its job is deleted or the server shuts down.

A job's outcome is decided here, and each outcome touches only that job: an exception (out of memory included)
fails the job and the worker takes the next one. Files are written before the record says `completed`; a record
that vanished while the job ran (DELETE) means the files just written are removed again.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from .config import ServerConfig
from .jobs import Job, JobFiles, JobStore, write_image
from .metrics import Metrics

if TYPE_CHECKING:
    from ..pipeline import Pipeline, Request, Result
    from ..sampler import StepEvent
    from ..switches import Options

log = logging.getLogger("k6fast.server")
_IDLE_POLL_S = 1.0  # the worker also looks at the queue this often without being woken
_ERROR_BACKOFF_S = 1.0
WARMUP_SIZE = 64  # width and height of the warm-up clip
WARMUP_FRAMES = 5


def load_pipeline(config: ServerConfig, options: Options) -> Pipeline:
    """Load the checkpoint and run one small generation, so that the first request pays no first-call costs
    (kernel selection, allocator growth, lazy imports)."""
    import torch

    from ..pipeline import Pipeline, Request

    dtype = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[config.dtype]
    # The residency planner reserves activations for the largest request the server accepts (either orientation
    # has the same token count).
    plan_geometry = (config.max_size[0], config.max_size[1], config.max_frames)
    pipeline = Pipeline(config.model, options, device=config.device, dtype=dtype, plan_geometry=plan_geometry)
    # Two steps touch every phase; a cached-step switch needs the schedule long enough to contain its steps.
    steps = max(2, *(s + 1 for s in options.piflow_cache_steps)) if options.piflow_cache_steps else 2
    started = time.perf_counter()
    pipeline.generate(
        Request(prompt="warm-up", width=WARMUP_SIZE, height=WARMUP_SIZE, frames=WARMUP_FRAMES, steps=steps)
    )
    log.info("warm-up generation took %.1f s", time.perf_counter() - started)
    return pipeline


def classify_failure(exc: BaseException) -> tuple[str, str]:
    """(error code, message) recorded on a failed job."""
    import torch

    from ..pipeline import RequestError

    message = f"{type(exc).__name__}: {exc}"[:2000]
    if isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)):
        return "out_of_memory", message
    if isinstance(exc, RequestError):
        return "invalid_request", message
    return "generation_failed", message


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
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._current: str | None = None
        self._cancel_current = False
        self._thread = threading.Thread(target=self._run, name="k6fast-gpu-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def notify(self) -> None:
        self._wake.set()

    @property
    def current_job_id(self) -> str | None:
        return self._current

    def cancel(self, job_id: str) -> bool:
        """Ask the running job to stop at its next step boundary; False when `job_id` is not the running job."""
        with self._lock:
            if self._current != job_id:
                return False
            self._cancel_current = True
            return True

    def stop(self, timeout: float) -> bool:
        """Stop after the running job's next step boundary (the job goes back to the queue); True if stopped."""
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _should_stop(self) -> bool:
        return self._stopping.is_set() or self._cancel_current

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()
            try:
                job = self.store.claim_next()
            except Exception:
                log.exception("could not read the job queue")
                self._stopping.wait(_ERROR_BACKOFF_S)
                continue
            if job is None:
                self._wake.wait(_IDLE_POLL_S)
                continue
            with self._lock:
                self._current, self._cancel_current = job.id, False
            try:
                self._execute(job)
            except Exception:
                # Only the store itself failing lands here (the job's own errors are handled in _execute).
                log.exception("job %s: could not record its outcome", job.id)
                self._stopping.wait(_ERROR_BACKOFF_S)
            finally:
                with self._lock:
                    self._current, self._cancel_current = None, False
                self._free_memory()

    def _request(self, job: Job) -> Request:
        from ..pipeline import Request

        spec = job.spec
        image = None
        if spec.image:
            import PIL.Image

            with PIL.Image.open(self.files.input_image(job.id)) as stored:
                image = stored.convert("RGB")
        return Request(
            prompt=spec.prompt,
            width=spec.width,
            height=spec.height,
            frames=spec.frames,
            steps=spec.steps,
            guidance=spec.guidance,
            seed=spec.seed,
            negative_prompt=spec.negative_prompt,
            image=image,
            audio=spec.audio,
        )

    def _execute(self, job: Job) -> None:
        from ..sampler import Cancelled

        log.info(
            "job %s: started (attempt %d, %s, %d frames, %d steps)",
            job.id,
            job.attempts,
            job.spec.size,
            job.spec.frames,
            job.spec.steps,
        )
        started = time.perf_counter()

        def on_step(event: StepEvent) -> None:
            self.metrics.observe_step(event.seconds)
            self.store.set_progress(job.id, progress_after_step(event.index, event.total))

        try:
            request = self._request(job)
            result = self.pipeline.generate(request, on_step=on_step, should_stop=self._should_stop)
            telemetry = self._write(job, request, result)
        except Cancelled:
            if self._cancel_current:
                self.files.remove(job.id)
                self.metrics.observe_job("cancelled")
                log.info("job %s: cancelled (deleted) after %.1f s", job.id, time.perf_counter() - started)
            else:
                self.store.requeue(job.id)
                self.metrics.observe_job("requeued")
                log.info("job %s: interrupted by shutdown, back in the queue", job.id)
            return
        except Exception as exc:
            code, message = classify_failure(exc)
            # Record first, files second: a crash in between must not leave a re-runnable job without its input.
            recorded = self.store.fail(job.id, code, message, self.config.ttl_seconds)
            self.files.remove(job.id)
            if recorded:
                log.error("job %s: failed (%s) %s", job.id, code, message, exc_info=code == "generation_failed")
                self.metrics.observe_job("failed")
            else:
                self.metrics.observe_job("cancelled")
            return
        seconds = time.perf_counter() - started
        telemetry["job_s"] = round(seconds, 6)
        if self.store.complete(job.id, telemetry, self.config.ttl_seconds):
            self.files.input_image(job.id).unlink(missing_ok=True)
            self.metrics.observe_job("completed", seconds, int(telemetry.get("peak_vram_bytes", 0)))
            log.info("job %s: completed in %.1f s", job.id, seconds)
        else:
            # Deleted after its last step boundary: the record is gone, so the files must go too.
            self.files.remove(job.id)
            self.metrics.observe_job("cancelled")

    def _write(self, job: Job, request: Request, result: Result) -> dict[str, Any]:
        from ..output import frames_to_uint8, write_result

        self.files.folder(job.id, create=True)
        write_result(
            result, self.files.video(job.id), self.options, request, self.config.model, self.pipeline.ckpt.variant
        )
        import PIL.Image

        first = PIL.Image.fromarray(frames_to_uint8(result.frames[:1])[0])
        write_image(first, self.files.thumbnail(job.id), "JPEG", quality=90)
        return result.telemetry.as_dict()

    def _free_memory(self) -> None:
        device = getattr(self.pipeline, "device", None)
        if getattr(device, "type", None) == "cuda":
            import torch

            with contextlib.suppress(RuntimeError):
                torch.cuda.empty_cache()
