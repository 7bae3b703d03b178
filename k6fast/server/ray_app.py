"""`k6fast serve --ray`: the same `/v1/videos` API in front of many generator replicas, as a Ray Serve application.

    HTTP (Serve's proxy) ──► Ingress (1 replica, pinned to the node holding --data-dir)
                               the FastAPI app of app.py: auth, validation, queue limits and 429, the SQLite job
                               store and the clips; its dispatcher (ray_dispatcher.py) keeps one job per replica
                                   │ DeploymentHandle, one streaming call per job attempt
                                   ▼
                             Generator × N (ray_replica.py): one warmed-up Pipeline each, one GPU or a share of one

Serve restarts a replica or the ingress that dies; the job store is what makes that lossless (see
ray_dispatcher.py). Requires `ray[serve]` (the `k6fast[ray]` extra) on every node, and the checkpoint at the same
path (or the same Hub id) on every node that runs a replica.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray import serve
from ray.serve._private.constants import SERVE_NAMESPACE

from ..switches import Options
from .app import create_app
from .config import ServerConfig
from .ray_dispatcher import RayDispatcher, describe_cluster
from .ray_replica import Generator, PipelineLoader, ensure_logging
from .ray_settings import RaySettings

if TYPE_CHECKING:
    from fastapi import FastAPI
    from ray.serve.handle import DeploymentHandle

log = logging.getLogger("k6fast.server")


class Ingress:
    """The ingress replica: builds the FastAPI app of app.py around a RayDispatcher. Besides HTTP, a Serve handle
    can ask it which replica runs which job (`running`)."""

    def __init__(self, config: ServerConfig, options: Options, settings: RaySettings, generator: DeploymentHandle):
        ensure_logging()
        # Serve's actors live in its own namespace, not the job's (`get_runtime_context().namespace`).
        self._caller = (SERVE_NAMESPACE, ray.get_runtime_context().get_actor_name() or "")
        self._config = config
        self._options = options
        self._settings = settings
        self._generator = generator
        self._app: FastAPI | None = None

    def __serve_build_asgi_app__(self) -> FastAPI:
        generator, options, settings = self._generator, self._options, self._settings
        dispatcher = functools.partial(RayDispatcher, generator=generator, settings=settings, caller=self._caller)
        self._app = create_app(
            self._config, options, load=lambda: describe_cluster(generator, options, settings), dispatcher=dispatcher
        )
        return self._app

    def running(self) -> dict[str, dict[str, Any] | None]:
        """Jobs in flight: job id -> the replica running it (ReplicaIdentity.as_dict()), None before it started."""
        worker = self._app.state.k6.worker if self._app is not None else None
        return worker.running() if isinstance(worker, RayDispatcher) else {}

    def stop_dispatching(self, timeout: float = 30.0) -> bool:
        """Before the application is deleted: running jobs stop at their next check and go back to the queue, as
        `k6fast serve` does on SIGTERM (left alone, Serve would let them run on while it drains the replicas)."""
        worker = self._app.state.k6.worker if self._app is not None else None
        return worker.stop(timeout) if worker is not None else True

    def ready(self) -> bool:
        return self._app is not None and self._app.state.k6.ready.is_set()


def cluster_config(config: ServerConfig) -> ServerConfig:
    """`config` with absolute paths: replicas and the ingress do not run in the directory `k6fast serve` ran in."""
    model = Path(config.model).expanduser()
    return dataclasses.replace(
        config,
        model=str(model.resolve()) if model.exists() else config.model,
        data_dir=config.data_dir.expanduser().resolve(),
    )


def build_app(
    config: ServerConfig, options: Options, settings: RaySettings, load: PipelineLoader | None = None
) -> serve.Application:
    """The Serve application (run it with `serve.run(app, name=settings.app_name, route_prefix="/")`). `load`
    replaces how a replica builds its pipeline (default: `config.model` as `k6fast serve` loads it)."""
    config = cluster_config(config)
    generator = serve.deployment(Generator).options(**settings.generator_options())
    ingress = serve.deployment(serve.ingress()(Ingress)).options(**settings.ingress_options())
    return ingress.bind(config, options, settings, generator.bind(config, options, settings, load))
