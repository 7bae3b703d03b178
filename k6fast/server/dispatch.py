"""What runs the queue: the contract between the HTTP side and whatever executes jobs.

Two implementations: `worker.Worker` (one pipeline in this process, one job at a time) and
`ray_dispatcher.RayDispatcher` (Ray Serve replicas, one job per replica). The app holds either as `state.worker`
and talks to it only through this interface; the job store is the one place a job's state lives, so the HTTP side
never needs to know where a job runs.

What the app needs from the model it serves (`state.pipeline`) is likewise small: `ckpt` (the checkpoint's configs,
for /health and request defaults), `device` (reported by /health) and `resolve(request)` (checking a request before it
is queued). A loaded `Pipeline` has all three; so does `ray_dispatcher.ClusterModel`, which loads no weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..switches import Options
    from .config import ServerConfig
    from .jobs import JobFiles, JobStore
    from .metrics import Metrics


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
