"""The in-process dispatcher: one pipeline in this process, one job at a time, on the job loop every dispatcher
shares (dispatch.py: claiming, back-off, cancel and each outcome's record and files). Each job reports progress
every step and stops part-way when it is deleted or the server shuts down: within one DiT block, one video decode op
or one encoded frame, whichever phase the job is in (k6fast.cancel). The stop is logged with the phase it happened
in, the job's memory is released and the next job starts.

A job's outcome touches only that job: an exception (out of memory included) fails the job and the worker takes the
next one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..cli_args import torch_dtype_of
from .config import ServerConfig, frames_for_seconds
from .dispatch import STAGES, InputUnreadable, JobLoop, Run, Stage, classify_failure, stored_input
from .images import decode_stored
from .jobs import Job, JobFiles, JobSpec, JobStore, write_image
from .metrics import Metrics

if TYPE_CHECKING:
    from ..pipeline import Pipeline, Result
    from ..request import Request
    from ..sampler import StepEvent
    from ..switches import Options

__all__ = [
    "InputUnreadable",
    "STAGES",
    "Worker",
    "classify_failure",
    "load_pipeline",
    "release_memory",
    "request_from_spec",
]

log = logging.getLogger("k6fast.server")
WARMUP_SIZE = 64  # width and height of the warm-up clip
WARMUP_FRAMES = 5


def load_pipeline(config: ServerConfig, options: Options) -> Pipeline:
    """Load the checkpoint and run one small generation, so that the first request pays no first-call costs
    (kernel selection, allocator growth, lazy imports)."""
    from ..entry import prepare_pipeline_process
    from ..pipeline import Pipeline
    from ..request import Request
    from ..step_cache import fixed_cache_note, fixed_cache_steps

    # Resident blocks are planned for the default request; a larger one streams more of them for its own run, and
    # one that cannot fit the budget at all is refused before it is queued (`Pipeline.resolve`).
    plan_geometry = (*config.default_size, frames_for_seconds(config.default_seconds))
    prepare_pipeline_process(options, config.device)  # the server's process: in-process, or a Ray replica's
    dtype = torch_dtype_of(config.dtype)
    pipeline = Pipeline(config.model, options, device=config.device, dtype=dtype, plan_geometry=plan_geometry)
    # Two steps touch every phase; a cached-step switch needs the schedule long enough to contain its steps.
    fixed = fixed_cache_steps(pipeline.ckpt, options)
    steps = max(2, *(s + 1 for s in fixed)) if fixed else 2
    if note := fixed_cache_note(pipeline.ckpt, options):
        log.info(note)
    started = time.perf_counter()
    pipeline.generate(
        Request(prompt="warm-up", width=WARMUP_SIZE, height=WARMUP_SIZE, frames=WARMUP_FRAMES, steps=steps)
    )
    log.info("warm-up generation took %.1f s", time.perf_counter() - started)
    return pipeline


class Worker(JobLoop):
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
        super().__init__(store, files, config, metrics, capacity=1, name="k6fast-gpu-worker")
        self.pipeline = pipeline
        self.options = options

    def execute(self, run: Run, job: Job) -> None:
        from ..cancel import Cancelled

        spec = job.spec
        log.info(
            "job %s: started (attempt %d, %s, %d frames, %d steps)",
            job.id,
            job.attempts,
            spec.size,
            spec.request.frames,
            spec.request.steps,
        )
        started = time.perf_counter()
        stage = Stage()

        def on_step(event: StepEvent) -> None:
            stage.after_step(event)
            self.progress(job, event.index, event.total, (event.seconds,))

        try:
            request = request_from_spec(spec, stored_input(self.files, job))
            result = self._generate(run, job, request, on_step)
            stage.name = "write"
            telemetry = self._finish(job, result)
        except Cancelled as exc:
            self.stopped(run, job, f" during {exc.phase} ({exc.where}) after {time.perf_counter() - started:.1f} s")
            return
        except Exception as exc:
            code, message = classify_failure(exc, stage.name)
            self.fail(run, job, code, message, detail=STAGES[stage.name], exc=exc)
            return
        self.complete(run, job, telemetry, started)

    def _generate(self, run: Run, job: Job, request: Request, on_step: Callable[[StepEvent], None]) -> Result:
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
            should_stop=lambda: self.should_stop(run),
        )

    def _finish(self, job: Job, result: Result) -> dict[str, Any]:
        """The thumbnail beside the clip; the job's telemetry."""
        import PIL.Image

        from ..output import frames_to_uint8

        first = PIL.Image.fromarray(frames_to_uint8(result.frames[:1])[0])
        write_image(first, self.files.thumbnail(job.id), "JPEG", quality=90)
        self.files.make_private(job.id)
        return result.telemetry.as_dict()

    def after_job(self) -> None:
        release_memory(self.pipeline)


def release_memory(pipeline: Pipeline) -> None:
    """After a job, so the next one starts with the memory free: an exception that unwound a job may leave its
    tensors in reference cycles (an exception held by a frame on its own traceback), so they are collected before
    the allocator's cache is emptied."""
    gc.collect()
    if getattr(getattr(pipeline, "device", None), "type", None) == "cuda":
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
