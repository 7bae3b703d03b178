"""The HTTP side: OpenAI's Videos API (`/v1/videos`), `/health` and `/metrics`, on FastAPI.

The official `openai` SDK works unchanged against it (`client.videos.create / retrieve / list / download_content /
delete`, `base_url=http://HOST:PORT/v1`). The model loads in a background thread after the app starts, so `/health`
answers 503 until the checkpoint is loaded and warmed up; jobs already in the store can be listed, fetched and
deleted meanwhile, new ones are refused with 503 until then.

What a client sees is the API's own words: every error is in OpenAI's shape with a stable code, and nothing of the
server's insides (exception text or type names, paths, addresses) reaches a response body; an unexpected error is
logged with an error id that the 500 names. With an API key set, `/health` without the key says only whether the
server is alive (ok, loading or failed).
"""

from __future__ import annotations

import hmac
import logging
import math
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..switches import Options, provenance
from .body import read_fields
from .config import ServerConfig
from .datadir import own_data_dir
from .download import file_response, open_file
from .errors import ApiError, error_body
from .images import check_pixels, store_upload
from .jobs import (
    JOB_ID_RE,
    DataDirLock,
    Job,
    JobFiles,
    JobStore,
    QueueFull,
    UnknownJob,
    new_job_id,
)
from .metrics import CONTENT_TYPE, Metrics
from .storage import INSUFFICIENT_STORAGE, is_disk_full
from .validation import parse_create, parse_list_query, parse_variant, resolve_spec
from .worker import Worker, load_pipeline

if TYPE_CHECKING:
    from ..pipeline import Pipeline
    from .dispatch import Dispatcher, DispatcherFactory

log = logging.getLogger("k6fast.server")
_LOADING_RETRY_S = 5
_UNKNOWN_JOB_RETRY_S = 30  # Retry-After on a full queue before any job has finished
_STOP_TIMEOUT_S = 30.0


def video_object(job: Job) -> dict[str, Any]:
    """The job as OpenAI's `Video` object, plus k6fast's own parameters (clients ignore fields they do not know)."""
    spec, request = job.spec, job.spec.request
    return {
        "id": job.id,
        "object": "video",
        "model": job.model,
        "status": job.status,
        "progress": job.progress,
        "created_at": job.created_at,
        "completed_at": job.completed_at,
        "expires_at": job.expires_at,
        "prompt": request.prompt,
        "seconds": spec.seconds,
        "size": spec.size,
        "error": None if job.error_code is None else {"code": job.error_code, "message": job.error_message},
        "remixed_from_video_id": None,
        "num_frames": request.frames,
        "num_inference_steps": request.steps,
        "guidance_scale": request.guidance,
        "seed": request.seed,
        "sample_audio": request.audio,
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
        dispatcher: DispatcherFactory = Worker,
    ):
        self.config = config
        self.options = options
        self.metrics = Metrics()
        self.served_names = tuple(dict.fromkeys((config.served_model_name, config.model)))
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.pipeline: Pipeline | None = None
        self.worker: Dispatcher | None = None  # a Worker, or another dispatcher (see dispatch.py)
        self._dispatcher = dispatcher
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
        own_data_dir(self.config.data_dir)  # refuses a folder that holds what the server did not write (datadir.py)
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
            log.warning("the running job did not stop within %.0f s; it re-runs at the next start", _STOP_TIMEOUT_S)
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
            self.worker = self._dispatcher(self.store, self.files, pipeline, self.options, self.config, self.metrics)
            self.worker.start()
            self.ready.set()
            log.info("ready: %s loaded and warmed up in %.1f s", self.config.model, time.perf_counter() - started)
        except Exception as exc:
            self.load_error = "the model failed to load; the server log says why"
            log.error("could not load %s", self.config.model, exc_info=exc)
            if self._on_load_error is not None:
                self._on_load_error(exc)

    def _reap_loop(self) -> None:
        while not self._closing.wait(self.config.reap_interval_s):
            try:
                self.reap()
            except Exception:
                log.exception("could not remove expired jobs")

    def reap(self) -> list[str]:
        """Remove expired jobs: record first, then files (see jobs.py for why this order). On a full disk the files
        go first, to make room for the records' deletion (storage.py); with no room even then, nothing is removed
        and the next round tries again."""

        def free() -> None:
            for job_id in self.store.expired_ids():
                self.files.remove(job_id)

        expired = self.files.storage.write_with_room(self.store.expire, free=free, gone=lambda: True) or []
        for job_id in expired:
            self.files.remove(job_id)
        if expired:
            log.info("expired %d job(s)", len(expired))
        return expired

    def retry_after_s(self) -> int:
        mean = self.metrics.mean_job_seconds()
        return max(1, math.ceil(mean)) if mean is not None else _UNKNOWN_JOB_RETRY_S

    def queue_full(self, depth: int) -> ApiError:
        retry = self.retry_after_s()
        return ApiError(
            429,
            f"the queue is full ({depth} jobs waiting, at most {self.config.max_queue}); retry in about {retry} s",
            code="queue_full",
            headers={"Retry-After": str(retry)},
        )

    def accept(self, fields: dict[str, Any]) -> Job:
        """Validate a create request and queue it (runs in a thread pool: the pixel check and fsync block). The
        cheap checks come first: fields, the image's format and size from its header, the queue's room; then the
        image's pixel data, in bounded memory. The job waits with the upload's bytes; the worker decodes them when
        the job starts (images.py)."""
        draft = parse_create(fields, self.config, self.served_names)
        spec = resolve_spec(draft, self.pipeline, self.config.max_steps)
        depth = self.store.queue_depth()
        if depth >= self.config.max_queue:
            raise self.queue_full(depth)
        job_id = new_job_id()
        if draft.image is not None:
            check_pixels(draft.image)
            # Stored before the record exists: the worker may claim the job the moment it is inserted.
            try:
                self.files.folder(job_id, create=True)
                store_upload(draft.image, self.files.input_image(job_id))
            except BaseException:
                self.files.remove(job_id)
                raise
        try:
            job = self.store.create(job_id, spec, self.config.served_model_name, self.arm, self.config.max_queue)
        except QueueFull as exc:  # filled up while this upload was checked and stored
            self.files.remove(job_id)
            raise self.queue_full(exc.depth) from None
        except BaseException:  # not stored (a full disk, for one): nor is its input
            self.files.remove(job_id)
            raise
        self.worker.notify()
        return job

    def job_or_404(self, video_id: str) -> Job:
        job = self.store.get(video_id) if JOB_ID_RE.fullmatch(video_id) else None
        if job is None:
            raise not_found(video_id)
        return job


def insufficient_storage(what: str) -> ApiError:
    """507: the data directory's disk is full (storage.py); `what` says what could not be stored."""
    return ApiError(
        507,
        f"the server's disk is full, so {what}; retry once there is room (deleting finished videos frees it)",
        code=INSUFFICIENT_STORAGE,
    )


def not_found(video_id: str) -> ApiError:
    if not JOB_ID_RE.fullmatch(video_id):
        message = "no such video: expected an id like video_<32 hex digits> as this server gives out"
    else:
        message = f"no video with id {video_id} (it never existed, was deleted or expired)"
    return ApiError(404, message, param="video_id", code="video_not_found")


def create_app(
    config: ServerConfig,
    options: Options,
    load: Callable[[], Pipeline] | None = None,
    on_load_error: Callable[[BaseException], None] | None = None,
    clock: Callable[[], float] = time.time,
    dispatcher: DispatcherFactory = Worker,
) -> FastAPI:
    """The ASGI app. `load` builds the (warmed-up) pipeline in a background thread; the default loads
    `config.model` with `options`. `clock` (seconds) dates jobs and expiries. `dispatcher` runs the queue once the
    model is loaded (default: one in-process GPU `Worker`; see dispatch.py)."""
    load = load or (lambda: load_pipeline(config, options))
    state = ServerState(config, options, load, on_load_error, clock, dispatcher)
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
            why = state.load_error or "the model is loading"
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
        status = exc.status_code
        if status == 404:
            message, code = "no such route; the Videos API is under /v1/videos", "not_found"
        elif status == 405:
            message, code = "this method is not allowed on this route; the Videos API is under /v1/videos", None
        else:
            message, code = _phrase(status), None
        body = error_body(message, "invalid_request_error" if status < 500 else "server_error", code=code)
        return JSONResponse(body, status_code=status, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        where = "; ".join(
            f"{'.'.join(str(part)[:40] for part in error.get('loc', ()))}: {error.get('msg', 'invalid')}"
            for error in exc.errors()[:5]
        )
        return JSONResponse(error_body(f"invalid request: {where}", "invalid_request_error"), status_code=400)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        error_id = "err_" + secrets.token_hex(8)
        log.error("unhandled error %s on %s %s", error_id, request.method, request.url.path, exc_info=exc)
        message = f"internal error: the server could not handle this request; its log has the details ({error_id})"
        return JSONResponse(error_body(message, "server_error", code="internal_error"), status_code=500)

    def has_key(request: Request) -> bool:
        try:
            authenticate(request)
        except ApiError:
            return False
        return True

    @app.get("/health")
    def health(request: Request) -> JSONResponse:
        detailed = has_key(request)
        if not state.ready.is_set():
            status = {"status": "failed" if state.load_error else "loading"}
            if detailed and state.load_error:
                status["error"] = state.load_error
            return JSONResponse(status, status_code=503, headers={"Retry-After": str(_LOADING_RETRY_S)})
        # Still 200 when degraded: the server answers and frees space on DELETE; `reason` says what is wrong.
        problem = state.files.storage.problem
        status = {"status": "degraded"} if problem else {"status": "ok"}
        if not detailed:  # alive and ready, and nothing about what it serves
            return JSONResponse(status)
        if problem:
            status["reason"] = problem
        pipeline = state.pipeline
        return JSONResponse(
            {
                **status,
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
        try:
            fields = await read_fields(request, config.max_upload_bytes, config.body_timeout_s)
            job = await run_in_threadpool(state.accept, fields)
        except Exception as exc:
            if not is_disk_full(exc):
                raise
            state.files.storage.full()
            raise insufficient_storage("this job could not be stored") from None
        return JSONResponse(video_object(job), headers=poll_headers)

    @app.get("/v1/videos", dependencies=[Depends(authenticate)])
    def list_videos(request: Request) -> JSONResponse:
        after, limit, order = parse_list_query(request.query_params)
        try:
            jobs, has_more = state.store.page(after, limit, order)
        except UnknownJob:
            raise ApiError(
                400,
                f"after {after[:40]!r} is not the id of a video in this server's list",
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
    def video_content(video_id: str, request: Request) -> Response:
        variant = parse_variant(request.query_params)
        job = state.job_or_404(video_id)
        if job.status != "completed":
            detail = f"it failed ({job.error_code}; see its error)" if job.status == "failed" else "it is not finished"
            raise ApiError(
                409,
                f"video {video_id} is {job.status}, so it has no content ({detail})",
                code="video_not_ready" if job.status != "failed" else "video_failed",
            )
        if variant == "video":
            path, media_type, name = state.files.video(video_id), "video/mp4", f"{video_id}.mp4"
        else:
            path, media_type, name = state.files.thumbnail(video_id), "image/jpeg", f"{video_id}.jpg"
        # Opened here, before the response starts: a DELETE from now on removes the name, not what this sends.
        opened = open_file(path)
        if opened is None:
            raise ApiError(
                404, f"the {variant} of video {video_id} is gone (it was deleted or expired)", code="video_not_found"
            )
        return file_response(opened, media_type, name, request.headers)

    @app.delete("/v1/videos/{video_id}", dependencies=[Depends(authenticate)])
    def delete_video(video_id: str) -> JSONResponse:
        if not JOB_ID_RE.fullmatch(video_id):
            raise not_found(video_id)
        try:
            # DELETE is how space is freed, so it must work on a full disk: there the job's files go first, to make
            # room for the record's deletion (storage.py).
            job = state.files.storage.write_with_room(
                lambda: state.store.delete(video_id), free=lambda: state.files.remove(video_id)
            )
        except Exception as exc:
            if not is_disk_full(exc):
                raise
            raise insufficient_storage("the record of this video could not be deleted (its files were)") from None
        if job is None:
            raise not_found(video_id)
        if job.status == "in_progress" and state.worker is not None:
            # The worker stops within one DiT block, decode op or frame of the mux and frees the GPU; the record is
            # already gone.
            state.worker.cancel(video_id)
        state.files.remove(video_id)
        return JSONResponse({"id": video_id, "object": "video.deleted", "deleted": True})

    return app


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase.lower()
    except ValueError:
        return f"HTTP status {status}"
