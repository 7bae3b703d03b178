"""What the ingress and a generator replica say to each other (plain dataclasses, pickled by Ray).

One job is one streaming call of `Generator.run(JobPayload)`: the replica yields `Started` once, `Progress` after
denoising steps (several steps coalesce into one message when the ingress reads slower than they come), then one
`Finished`. A DELETE or a shutdown cancels the call; a replica that dies breaks the stream with a Ray error. Nothing
here imports Ray or torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .jobs import JobSpec

if TYPE_CHECKING:
    from ..fit import FitTable


@dataclass(frozen=True)
class ReplicaIdentity:
    """Which replica ran a job: Serve's replica id, its actor's name (for `ray.get_actor`/`ray.kill`), node, pid."""

    replica: str
    actor: str
    node: str
    pid: int

    def as_dict(self) -> dict[str, Any]:
        return {"replica": self.replica, "actor": self.actor, "node": self.node, "pid": self.pid}


@dataclass(frozen=True)
class JobPayload:
    """One attempt at a job. `caller` is the ingress actor's name: a replica stops an attempt whose ingress has
    died (its result would have nowhere to go; the restarted ingress runs the job again)."""

    job_id: str
    spec: JobSpec
    attempt: int
    caller: str | None = None
    image_png: bytes | None = None  # the stored input reference, when spec.image


@dataclass(frozen=True)
class ClipFiles:
    """A finished clip's files, carried back through Ray's object store (no shared data directory)."""

    video: bytes  # video.mp4
    sidecar: bytes  # video.mp4.json
    thumbnail: bytes  # thumbnail.jpg


@dataclass(frozen=True)
class ModelCard:
    """What the ingress needs to check requests without loading weights (see dispatch.py): the checkpoint's configs,
    and what fits the replica's VRAM budget over the server's size grid (`fit.FitTable`, computed once at its start)."""

    ckpt: Any  # checkpoint.Checkpoint: configs only, paths as seen by the replica
    device: str
    replica: ReplicaIdentity
    fit: FitTable


@dataclass(frozen=True)
class Started:
    """A replica took the job. `fit`: its FitTable, so the ingress learns the budget of every replica that runs a
    job (one started after the ingress asked `describe`, or on a card with another budget); None from a stand-in."""

    replica: ReplicaIdentity
    fit: FitTable | None = None


@dataclass(frozen=True)
class Progress:
    step: int  # 0-based index of the last step finished
    total: int
    step_seconds: tuple[float, ...]  # every step finished since the previous message


@dataclass(frozen=True)
class Finished:
    """The outcome of an attempt. `error` is (code, message) for a job that failed; else `telemetry` holds the
    pipeline's telemetry and `files` the clip (None when written into a shared data directory)."""

    replica: ReplicaIdentity
    seconds: float
    error: tuple[str, str] | None = None
    telemetry: dict[str, Any] = field(default_factory=dict)
    files: ClipFiles | None = None
