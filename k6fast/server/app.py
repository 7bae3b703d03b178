"""The HTTP side: OpenAI's Videos API (`/v1/videos`), `/health` and `/metrics`, on FastAPI.

The official `openai` SDK works unchanged against it (`client.videos.create / retrieve / list / download_content /
delete`, `base_url=http://HOST:PORT/v1`). The model loads in a background thread after the app starts, so `/health`
answers 503 until the checkpoint is loaded and warmed up; jobs already in the store can be listed, fetched and
deleted meanwhile, new ones are refused with 503 until then.
"""

from __future__ import annotations

import hmac
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..switches import Options, provenance
from .config import ServerConfig
from .errors import ApiError, error_body
from .jobs import JOB_ID_RE, DataDirLock, Job, JobFiles, JobStore, QueueFull, UnknownJob, new_job_id, write_image
from .metrics import CONTENT_TYPE, Metrics
from .validation import parse_create, parse_list_query, parse_variant, read_fields, resolve_spec
from .worker import Worker, load_pipeline

if TYPE_CHECKING:
    from ..pipeline import Pipeline

log = logging.getLogger("k6fast.server")
_LOADING_RETRY_S = 5
_UNKNOWN_JOB_RETRY_S = 30  # Retry-After on a full queue before any job has finished
_STOP_TIMEOUT_S = 30.0


def video_object(job: Job) -> dict[str, Any]:
    """The job as OpenAI's `Video` object, plus k6fast's own parameters (clients ignore fields they do not know)."""
    spec = job.spec
    return {
        "id": job.id,
        "object": "video",
        "model": job.model,
        "status": job.status,
        "progress": job.progress,
        "created_at": job.created_at,
        "completed_at": job.completed_at,
        "expires_at": job.expires_at,
        "prompt": spec.prompt,
        "seconds": spec.seconds,
        "size": spec.size,
        "error": None if job.error_code is None else {"code": job.error_code, "message": job.error_message},
        "remixed_from_video_id": None,
        "num_frames": spec.frames,
        "num_inference_steps": spec.steps,
        "guidance_scale": spec.guidance,
        "seed": spec.seed,
        "sample_audio": spec.audio,
    }


class ServerState:
    """Everything one server holds: store, files, metrics, and (once loaded) the pipeline and its worker."""

    def __init__(
        self,
        config: ServerConfig,
        options: Options,
        load: Callable[[], Pipeline],
        on_load_error: Callable[[BaseException], None] | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.config = config
        self.options = options
        self.metrics = Metrics()
        self.served_names = tuple(dict.fromkeys((config.served_model_name, config.model)))
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.pipeline: Pipeline | None = None
        self.worker: Worker | None = None
        self.store: JobStore | None = None
        self.files: JobFiles | None = None
        self._load = load
        self._on_load_error = on_load_error
        self._clock = clock
        self._lock = DataDirLock(config.data_dir)
        self._closing = threading.Event()
        self._reaper: threading.Thread | None = None
        self.arm: dict[str, Any] = {}  # provenance(options), recorded on every job

    def start(self) -> None:
        self.config.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock.acquire()
        try:
            self.store = JobStore(self.config.jobs_db, clock=self._clock)
            self.files = JobFiles(self.config.data_dir)
            self.arm = provenance(self.options)
            requeued, failed = self.store.recover(self.config.max_attempts, self.config.ttl_seconds)
        except BaseException:
            self._lock.release()
            raise
        if requeued or failed:
            log.info(
                "recovered after a stop: %d job(s) re-queued, %d failed at the restart limit",
                len(requeued),
                len(failed),
            )
        removed = self.files.sweep(self.store.ids())
        if removed:
            log.info("removed %d leftover file(s) without a job record", len(removed))
        self.reap()
        self._reaper = threading.Thread(target=self._reap_loop, name="k6fast-reaper", daemon=True)
        self._reaper.start()
        threading.Thread(target=self._load_and_start, name="k6fast-loader", daemon=True).start()

    def stop(self) -> None:
        self._closing.set()
        if self.worker is not None and not self.worker.stop(_STOP_TIMEOUT_S):
            log.warning(
                "the running job did not reach a step boundary in %.0f s; it re-runs at the next start", _STOP_TIMEOUT_S
            )
        if self._reaper is not None:
            self._reaper.join(_STOP_TIMEOUT_S)
        if self.store is not None:
            self.store.close()
        self._lock.release()

    def _load_and_start(self) -> None:
        try:
            started = time.perf_counter()
            pipeline = self._load()
            if self._closing.is_set():
                return
            self.pipeline = pipeline
            self.worker = Worker(self.store, self.files, pipeline, self.options, self.config, self.metrics)
            self.worker.start()
            self.ready.set()
            log.info("ready: %s loaded and warmed up in %.1f s", self.config.model, time.perf_counter() - started)
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.error("could not load %s: %s", self.config.model, self.load_error)
            if self._on_load_error is not None:
                self._on_load_error(exc)

    def _reap_loop(self) -> None:
        while not self._closing.wait(self.config.reap_interval_s):
            try:
                self.reap()
            except Exception:
                log.exception("could not remove expired jobs")

    def reap(self) -> list[str]:
        """Remove expired jobs: record first, then files (see jobs.py for why this order)."""
        expired = self.store.expire()
        for job_id in expired:
            self.files.remove(job_id)
        if expired:
            log.info("expired %d job(s)", len(expired))
        return expired

    def retry_after_s(self) -> int:
        mean = self.metrics.mean_job_seconds()
        return max(1, math.ceil(mean)) if mean is not None else _UNKNOWN_JOB_RETRY_S

    def accept(self, fields: dict[str, Any]) -> Job:
        """Validate a create request and queue it (runs in a thread pool: image decoding and fsync block)."""
        draft = parse_create(fields, self.config, self.served_names)
        spec = resolve_spec(draft, self.pipeline, self.config.max_steps)
        job_id = new_job_id()
        if draft.image is not None:
            # Stored before the record exists: the worker may claim the job the moment it is inserted.
            self.files.folder(job_id, create=True)
            write_image(draft.image, self.files.input_image(job_id), "PNG")
        try:
            job = self.store.create(job_id, spec, self.config.served_model_name, self.arm, self.config.max_queue)
        except QueueFull as exc:
            self.files.remove(job_id)
            retry = self.retry_after_s()
            raise ApiError(
                429,
                f"the queue is full ({exc.depth} jobs waiting, at most {self.config.max_queue}); retry in about "
                f"{retry} s",
                code="queue_full",
                headers={"Retry-After": str(retry)},
            ) from None
        self.worker.notify()
        return job

    def job_or_404(self, video_id: str) -> Job:
        job = self.store.get(video_id) if JOB_ID_RE.fullmatch(video_id) else None
        if job is None:
            raise not_found(video_id)
        return job


def not_found(video_id: str) -> ApiError:
    return ApiError(
        404,
        f"no video with id {video_id!r} (it never existed, was deleted or expired)",
        param="video_id",
        code="video_not_found",
    )


def create_app(
    config: ServerConfig,
    options: Options,
    load: Callable[[], Pipeline] | None = None,
    on_load_error: Callable[[BaseException], None] | None = None,
    clock: Callable[[], float] = time.time,
) -> FastAPI:
    """The ASGI app. `load` builds the (warmed-up) pipeline in a background thread; the default loads
    `config.model` with `options`. `clock` (seconds) dates jobs and expiries."""
    state = ServerState(config, options, load or (lambda: load_pipeline(config, options)), on_load_error, clock)
    poll_headers = {"openai-poll-after-ms": str(config.poll_after_ms)}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await run_in_threadpool(state.start)
        try:
            yield
        finally:
            await run_in_threadpool(state.stop)

    app = FastAPI(
        title="k6fast", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.k6 = state

    def authenticate(request: Request) -> None:
        key = options.api_key
        if not key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken must not tell an attacker how much of a guess was right.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(
                401,
                "missing or wrong API key; expected the header 'Authorization: Bearer <key>' with the server's "
                "K6_API_KEY",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    def require_ready() -> None:
        if not state.ready.is_set():
            why = f"the model failed to load ({state.load_error})" if state.load_error else "the model is loading"
            raise ApiError(
                503,
                f"{why}; expected GET /health to return 200 before jobs are submitted",
                code="not_ready",
                headers={"Retry-After": str(_LOADING_RETRY_S)},
            )

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}; the Videos API is under /v1/videos"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        body = error_body(message, "invalid_request_error" if exc.status_code < 500 else "server_error")
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(f"invalid request: {exc.errors()}", "invalid_request_error"), status_code=400)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"), status_code=500)

    @app.get("/health")
    def health() -> JSONResponse:
        if not state.ready.is_set():
            status = {"status": "failed", "error": state.load_error} if state.load_error else {"status": "loading"}
            return JSONResponse(status, status_code=503, headers={"Retry-After": str(_LOADING_RETRY_S)})
        pipeline = state.pipeline
        return JSONResponse(
            {
                "status": "ok",
                "model": config.served_model_name,
                "variant": pipeline.ckpt.variant,
                "device": str(pipeline.device),
                "arm": state.arm["arm"],
                "arm_hash": state.arm["arm_hash"],
                "version": __version__,
            }
        )

    @app.get("/metrics", dependencies=[Depends(authenticate)])
    def metrics() -> PlainTextResponse:
        busy = state.worker is not None and state.worker.current_job_id is not None
        text = state.metrics.render(state.store.counts(), state.ready.is_set(), busy)
        return PlainTextResponse(text, media_type=CONTENT_TYPE)

    @app.post("/v1/videos", dependencies=[Depends(authenticate)])
    async def create_video(request: Request) -> JSONResponse:
        require_ready()
        fields = await read_fields(request, config.max_upload_bytes)
        job = await run_in_threadpool(state.accept, fields)
        return JSONResponse(video_object(job), headers=poll_headers)

    @app.get("/v1/videos", dependencies=[Depends(authenticate)])
    def list_videos(request: Request) -> JSONResponse:
        after, limit, order = parse_list_query(request.query_params)
        try:
            jobs, has_more = state.store.page(after, limit, order)
        except UnknownJob:
            raise ApiError(
                400,
                f"after {after!r} is not the id of a video in this server's list",
                param="after",
                code="invalid_value",
            ) from None
        data = [video_object(job) for job in jobs]
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
                "has_more": has_more,
            },
            headers=poll_headers,
        )

    @app.get("/v1/videos/{video_id}", dependencies=[Depends(authenticate)])
    def retrieve_video(video_id: str) -> JSONResponse:
        return JSONResponse(video_object(state.job_or_404(video_id)), headers=poll_headers)

    @app.get("/v1/videos/{video_id}/content", dependencies=[Depends(authenticate)])
    def video_content(video_id: str, request: Request) -> FileResponse:
        variant = parse_variant(request.query_params)
        job = state.job_or_404(video_id)
        if job.status != "completed":
            detail = f"it failed: {job.error_message}" if job.status == "failed" else "it is not finished"
            raise ApiError(
                409,
                f"video {video_id} is {job.status}, so it has no content ({detail})",
                code="video_not_ready" if job.status != "failed" else "video_failed",
            )
        if variant == "video":
            path, media_type, name = state.files.video(video_id), "video/mp4", f"{video_id}.mp4"
        else:
            path, media_type, name = state.files.thumbnail(video_id), "image/jpeg", f"{video_id}.jpg"
        if not path.is_file():
            raise ApiError(404, f"the {variant} of video {video_id} is gone (it expired)", code="video_not_found")
        return FileResponse(path, media_type=media_type, filename=name)

    @app.delete("/v1/videos/{video_id}", dependencies=[Depends(authenticate)])
    def delete_video(video_id: str) -> JSONResponse:
        job = state.store.delete(video_id) if JOB_ID_RE.fullmatch(video_id) else None
        if job is None:
            raise not_found(video_id)
        if job.status == "in_progress" and state.worker is not None:
            # The worker stops at its next step boundary and frees the GPU; the record is already gone.
            state.worker.cancel(video_id)
        state.files.remove(video_id)
        return JSONResponse({"id": video_id, "object": "video.deleted", "deleted": True})

    return app
