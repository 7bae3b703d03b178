"""The generator deployment: each Ray Serve replica holds one warmed-up `Pipeline` (one GPU, or a share of one) and
runs one job at a time for the ingress (`max_ongoing_requests=1`).

`run(payload)` is an async generator: the pipeline runs in the replica's one worker thread while the event loop
forwards its step events as `Progress` messages. When Serve cancels the call (the job was deleted, or the ingress is
stopping) the thread is told to stop and the call returns only once the thread has reached its next check, so a
replica never runs two jobs on its pipeline at once. A job's errors (out of memory included) come back as a
`Finished` with an error code and fail only that job; the replica stays up and frees its cached GPU memory.

Serve applies `serve.deployment(...)` in ray_app.py; this module imports Ray only inside the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from ..fit import fit_table
from .config import ServerConfig
from .dispatch import STAGES, Stage, classify_failure
from .jobs import JobFiles, write_image
from .ray_messages import ClipFiles, Finished, JobPayload, ModelCard, Progress, ReplicaIdentity, Started
from .ray_settings import RaySettings
from .worker import load_pipeline, release_memory, request_from_spec

if TYPE_CHECKING:
    from ..pipeline import Pipeline, Result
    from ..request import Request
    from ..sampler import StepEvent
    from ..switches import Options

log = logging.getLogger("k6fast.server")
CALLER_CHECK_S = 2.0  # how often a running job looks up whether its ingress is still alive
CANCELLED_CODE = "cancelled"

PipelineLoader = Callable[[ServerConfig, "Options"], "Pipeline"]


def ensure_logging() -> None:
    logger = logging.getLogger("k6fast")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _identity() -> ReplicaIdentity:
    import ray
    from ray import serve

    context = ray.get_runtime_context()
    return ReplicaIdentity(
        replica=serve.get_replica_context().replica_id.unique_id,
        actor=context.get_actor_name() or "",
        node=context.get_node_id(),
        pid=os.getpid(),
    )


class CallerWatch:
    """Whether the ingress that sent a job is still alive, looked up at most every `interval` seconds. An ingress
    that died does not cancel its calls; without this a replica would finish a job nobody will receive while the
    restarted ingress queues the same job again."""

    def __init__(self, caller: tuple[str, str] | None, interval: float = CALLER_CHECK_S):
        self.caller = caller
        self.interval = interval
        self._next = time.monotonic() + interval
        self.gone = False

    def __call__(self) -> bool:
        if self.caller is None or self.gone or time.monotonic() < self._next:
            return self.gone
        import ray

        namespace, name = self.caller
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:  # no live actor of that name: Ray frees a name when its actor dies
            self.gone = True
            log.warning("the ingress %s is gone; stopping its job at this step", name)
        except Exception as exc:  # the cluster's control store unreachable for a moment: not a reason to stop
            log.warning("could not look up the ingress %s (%s); the job goes on", name, exc)
        self._next = time.monotonic() + self.interval
        return self.gone


class Generator:
    """One replica: one pipeline, one job at a time. `load` builds the warmed-up pipeline (default: the checkpoint
    in `config`, as `k6fast serve` loads it)."""

    def __init__(
        self, config: ServerConfig, options: Options, settings: RaySettings, load: PipelineLoader | None = None
    ):
        ensure_logging()
        self.config = config
        self.options = options
        self.identity = _identity()
        started = time.perf_counter()
        self.pipeline = (load or load_pipeline)(config, options)
        loaded = time.perf_counter()
        # What fits this replica's budget, for the ingress to refuse an oversize request before it is queued:
        # asking a replica per request would wait behind its running job (it takes one call at a time).
        self.fit = fit_table(self.pipeline, max(config.max_size), config.max_frames)
        self._fit_seconds = time.perf_counter() - loaded
        self._files = JobFiles(config.data_dir) if settings.shared_data_dir else None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="k6fast-replica")
        self._busy = threading.Lock()
        log.info(
            "replica %s on node %s: %s loaded on %s in %.1f s (its fit table in %.1f s)",
            self.identity.replica,
            self.identity.node[:12],
            config.model,
            self.pipeline.device,
            time.perf_counter() - started,
            self._fit_seconds,
        )

    def describe(self) -> ModelCard:
        return ModelCard(self.pipeline.ckpt, str(self.pipeline.device), self.identity, self.fit)

    async def run(self, payload: JobPayload) -> AsyncIterator[Started | Progress | Finished]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[StepEvent | None] = asyncio.Queue()
        stop = threading.Event()

        def on_step(event: StepEvent) -> None:  # in the pipeline thread
            loop.call_soon_threadsafe(events.put_nowait, event)

        future = loop.run_in_executor(self._executor, self._execute, payload, on_step, stop)
        # Scheduled after every step event the thread queued, so None marks the end of the stream.
        future.add_done_callback(lambda _: events.put_nowait(None))
        try:
            yield Started(self.identity, self.fit)
            finished = False
            while not finished:
                batch = [await events.get()]
                while not events.empty():
                    batch.append(events.get_nowait())
                finished = batch[-1] is None
                steps = [event for event in batch if event is not None]
                if steps:
                    yield Progress(steps[-1].index, steps[-1].total, tuple(event.seconds for event in steps))
            yield future.result()
        except BaseException:
            # Cancelled (DELETE or shutdown) or closed: stop at the next check, and hold this call until
            # the thread is out of the pipeline, so Serve does not hand this replica a second job meanwhile.
            stop.set()
            while not future.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait({future})
            raise

    def _execute(self, payload: JobPayload, on_step: Callable[[StepEvent], None], stop: threading.Event) -> Finished:
        from ..cancel import Cancelled

        with self._busy:
            started = time.perf_counter()
            watch = CallerWatch(payload.caller)
            stage = Stage()

            def should_stop() -> bool:
                return stop.is_set() or watch()

            def step(event: StepEvent) -> None:
                stage.after_step(event)
                on_step(event)

            log.info("job %s: attempt %d on replica %s", payload.job_id, payload.attempt, self.identity.replica)
            try:
                request = request_from_spec(payload.spec, payload.image_png)
                result = self.pipeline.generate(request, on_step=step, should_stop=should_stop)
                stage.name = "write"
                files = self._write(payload.job_id, request, result, should_stop)
                telemetry = result.telemetry.as_dict()
                return Finished(self.identity, time.perf_counter() - started, telemetry=telemetry, files=files)
            except Cancelled as exc:
                why = "its ingress is gone" if watch.gone else "cancelled"
                log.info("job %s: stopped during %s (%s): %s", payload.job_id, exc.phase, exc.where, why)
                return Finished(self.identity, time.perf_counter() - started, error=(CANCELLED_CODE, why))
            except Exception as exc:
                code, message = classify_failure(exc, stage.name)
                log.error("job %s: failed (%s) %s", payload.job_id, code, STAGES[stage.name], exc_info=exc)
                return Finished(self.identity, time.perf_counter() - started, error=(code, message))
            finally:
                release_memory(self.pipeline)

    def _write(
        self, job_id: str, request: Request, result: Result, should_stop: Callable[[], bool]
    ) -> ClipFiles | None:
        """The clip written atomically straight into a shared data directory (None returned), or into a temporary
        folder and returned as bytes for the ingress to write."""
        if self._files is not None:
            self._files.folder(job_id, create=True)
            video, thumbnail = self._files.video(job_id), self._files.thumbnail(job_id)
            self._write_files(video, thumbnail, request, result, should_stop)
            self._files.make_private(job_id)
            return None
        from ..atomic import sidecar_path

        with tempfile.TemporaryDirectory(prefix="k6fast-clip-") as tmp:
            video, thumbnail = Path(tmp) / "video.mp4", Path(tmp) / "thumbnail.jpg"
            self._write_files(video, thumbnail, request, result, should_stop)
            return ClipFiles(video.read_bytes(), sidecar_path(video).read_bytes(), thumbnail.read_bytes())

    def _write_files(
        self, video: Path, thumbnail: Path, request: Request, result: Result, should_stop: Callable[[], bool]
    ) -> None:
        import PIL.Image

        from ..output import frames_to_uint8, write_result

        variant = self.pipeline.ckpt.variant
        write_result(result, video, self.options, request, self.config.model, variant, should_stop)
        first = PIL.Image.fromarray(frames_to_uint8(result.frames[:1])[0])
        write_image(first, thumbnail, "JPEG", quality=90)
