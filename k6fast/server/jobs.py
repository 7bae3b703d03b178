"""Jobs that survive: a SQLite record per video job plus one folder of files per job in the data directory.

Layout of a data directory:
    jobs.sqlite3        the records (WAL journal, synchronous=FULL: a job acknowledged to a client is on disk)
    jobs/<id>/          input.png (the uploaded reference, re-encoded), video.mp4 + video.mp4.json, thumbnail.jpg
    server.lock         held (flock) by the one server using the directory

Everything in it is private to the server's user (prompts and videos are the clients' data): the directory and its
folders 0700, the database, the lock and job files 0600, whatever the umask.

Ordering rules that keep records and files consistent across a crash at any instant:
- a job's files are written (atomically) before its record says `completed`; a crash in between re-runs the job;
- a job's record is deleted before its files; a crash in between leaves files without a record, which `sweep`
  removes at the next start. So a record never points at missing files.

This module knows nothing of torch or the pipeline, so the store can be tested (and inspected) on its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..atomic import atomic_path

if TYPE_CHECKING:
    import PIL.Image

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
STATUSES = ("queued", "in_progress", "completed", "failed")
JOB_ID_RE = re.compile(r"video_[0-9a-f]{32}")
SCHEMA_VERSION = 1
RESTART_LIMIT_CODE = "restart_limit"

_SCHEMA = """
CREATE TABLE jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- AUTOINCREMENT: never reused, so FIFO order and list cursors hold
    id TEXT NOT NULL UNIQUE,
    status TEXT NOT NULL CHECK (status IN ('queued', 'in_progress', 'completed', 'failed')),
    progress INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL,
    started_at INTEGER,
    completed_at INTEGER,
    expires_at INTEGER,
    model TEXT NOT NULL,
    spec TEXT NOT NULL,
    arm TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    error_code TEXT,
    error_message TEXT,
    telemetry TEXT
);
CREATE INDEX jobs_by_status ON jobs (status, seq);
CREATE INDEX jobs_by_expiry ON jobs (expires_at) WHERE expires_at IS NOT NULL;
"""


class QueueFull(Exception):
    def __init__(self, depth: int):
        super().__init__(f"{depth} jobs are queued")
        self.depth = depth


class UnknownJob(KeyError):
    pass


class DataDirBusy(RuntimeError):
    """Another server holds the data directory's lock."""


def make_private_dir(path: Path) -> None:
    """Create `path` (and missing parents) if needed and make it 0700; an existing data directory is tightened."""
    path = Path(path)
    path.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o777 != PRIVATE_DIR:
        os.chmod(path, PRIVATE_DIR)


def make_private_file(path: Path) -> None:
    """Create `path` if missing, 0600 (SQLite gives its -wal and -shm files the database file's mode)."""
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, PRIVATE_FILE))
    if path.stat().st_mode & 0o777 != PRIVATE_FILE:
        os.chmod(path, PRIVATE_FILE)


@dataclass(frozen=True)
class JobSpec:
    """What to generate, fully resolved (defaults filled in), so a re-run after a restart makes the same clip."""

    prompt: str
    width: int
    height: int
    frames: int
    steps: int
    guidance: float
    seed: int
    seconds: str  # as the client gave it (or derived from frames), reported back unchanged
    audio: bool = True
    negative_prompt: str | None = None
    image: bool = False  # an input reference is stored as jobs/<id>/input.png

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class Job:
    id: str
    seq: int
    status: str
    progress: int
    created_at: int
    started_at: int | None
    completed_at: int | None
    expires_at: int | None
    model: str
    spec: JobSpec
    arm: dict[str, Any]  # provenance(options) of the server that accepted the job
    attempts: int  # how many times a worker has started it
    error_code: str | None
    error_message: str | None
    telemetry: dict[str, Any] | None


def new_job_id() -> str:
    return "video_" + secrets.token_hex(16)


def _job(row: sqlite3.Row) -> Job:
    return Job(
        id=row["id"],
        seq=row["seq"],
        status=row["status"],
        progress=row["progress"],
        created_at=row["created_at"],
        started_at=row["started_at"],
        completed_at=row["completed_at"],
        expires_at=row["expires_at"],
        model=row["model"],
        spec=JobSpec.from_json(row["spec"]),
        arm=json.loads(row["arm"]),
        attempts=row["attempts"],
        error_code=row["error_code"],
        error_message=row["error_message"],
        telemetry=None if row["telemetry"] is None else json.loads(row["telemetry"]),
    )


class JobStore:
    """The job records. Thread-safe: one connection, one lock (the API threads and the worker share it)."""

    def __init__(self, path: Path, clock: Callable[[], float] = time.time):
        self.path = Path(path)
        self._clock = clock
        self._lock = threading.Lock()
        make_private_file(self.path)
        for companion in (self.path.with_name(self.path.name + "-wal"), self.path.with_name(self.path.name + "-shm")):
            if companion.exists():
                os.chmod(companion, PRIVATE_FILE)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30.0)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version == 0:
            # One script, one transaction: a crash while creating leaves no half-made schema behind.
            self._db.executescript(f"BEGIN;\n{_SCHEMA}\nPRAGMA user_version = {SCHEMA_VERSION};\nCOMMIT;")
        elif version != SCHEMA_VERSION:
            self._db.close()
            raise RuntimeError(
                f"{self.path}: job store schema version {version}, expected {SCHEMA_VERSION} "
                "(written by another k6fast version); use another --data-dir"
            )

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def now(self) -> int:
        return int(self._clock())

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        # BEGIN IMMEDIATE takes the write lock up front, so a read-then-write (queue room, FIFO claim) is atomic.
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _one(self, sql: str, args: tuple = ()) -> Job | None:
        row = self._db.execute(sql, args).fetchone()
        return None if row is None else _job(row)

    def create(self, job_id: str, spec: JobSpec, model: str, arm: dict[str, Any], max_queue: int) -> Job:
        """Insert a queued job; raises QueueFull when `max_queue` jobs are already waiting."""
        with self._lock, self._transaction() as db:
            depth = db.execute("SELECT COUNT(*) FROM jobs WHERE status = 'queued'").fetchone()[0]
            if depth >= max_queue:
                raise QueueFull(depth)
            db.execute(
                "INSERT INTO jobs (id, status, created_at, model, spec, arm) VALUES (?, 'queued', ?, ?, ?, ?)",
                (job_id, self.now(), model, spec.to_json(), json.dumps(arm, sort_keys=True)),
            )
            return self._one("SELECT * FROM jobs WHERE id = ?", (job_id,))

    def queue_depth(self) -> int:
        """Jobs waiting (not counting the one running)."""
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM jobs WHERE status = 'queued'").fetchone()[0]

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self._one("SELECT * FROM jobs WHERE id = ?", (job_id,))

    def page(self, after: str | None, limit: int, order: str) -> tuple[list[Job], bool]:
        """Up to `limit` jobs after the job `after` in creation order (`asc`) or reverse (`desc`); + has_more."""
        if order not in ("asc", "desc"):
            raise ValueError(f"order must be 'asc' or 'desc', found {order!r}")
        with self._lock:
            if after is None:
                cursor = -1 if order == "asc" else 2**63 - 1
            else:
                row = self._db.execute("SELECT seq FROM jobs WHERE id = ?", (after,)).fetchone()
                if row is None:
                    raise UnknownJob(after)
                cursor = row[0]
            op, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
            rows = self._db.execute(
                f"SELECT * FROM jobs WHERE seq {op} ? ORDER BY seq {direction} LIMIT ?", (cursor, limit + 1)
            ).fetchall()
        return [_job(r) for r in rows[:limit]], len(rows) > limit

    def claim_next(self) -> Job | None:
        """The oldest queued job, now marked in_progress (attempts + 1); None when the queue is empty."""
        with self._lock, self._transaction() as db:
            row = db.execute("SELECT id FROM jobs WHERE status = 'queued' ORDER BY seq LIMIT 1").fetchone()
            if row is None:
                return None
            db.execute(
                "UPDATE jobs SET status = 'in_progress', progress = 0, started_at = ?, attempts = attempts + 1 "
                "WHERE id = ?",
                (self.now(), row["id"]),
            )
            return self._one("SELECT * FROM jobs WHERE id = ?", (row["id"],))

    def set_progress(self, job_id: str, progress: int) -> bool:
        with self._lock:
            cur = self._db.execute(
                "UPDATE jobs SET progress = ? WHERE id = ? AND status = 'in_progress'", (int(progress), job_id)
            )
            return cur.rowcount == 1

    def complete(self, job_id: str, telemetry: dict[str, Any], ttl_seconds: float) -> bool:
        """Mark a running job completed; False when it no longer exists (deleted while it ran)."""
        now = self.now()
        with self._lock:
            cur = self._db.execute(
                "UPDATE jobs SET status = 'completed', progress = 100, completed_at = ?, expires_at = ?, "
                "telemetry = ? WHERE id = ? AND status = 'in_progress'",
                (now, now + int(ttl_seconds), json.dumps(telemetry), job_id),
            )
            return cur.rowcount == 1

    def fail(self, job_id: str, code: str, message: str, ttl_seconds: float) -> bool:
        """Mark a queued or running job failed; False when it no longer exists."""
        now = self.now()
        with self._lock:
            cur = self._db.execute(
                "UPDATE jobs SET status = 'failed', completed_at = ?, expires_at = ?, error_code = ?, "
                "error_message = ? WHERE id = ? AND status IN ('queued', 'in_progress')",
                (now, now + int(ttl_seconds), code, message, job_id),
            )
            return cur.rowcount == 1

    def requeue(self, job_id: str) -> bool:
        """Put a running job back at its place in the queue (the server is stopping; not the job's fault)."""
        with self._lock:
            cur = self._db.execute(
                "UPDATE jobs SET status = 'queued', progress = 0, started_at = NULL, "
                "attempts = MAX(attempts - 1, 0) WHERE id = ? AND status = 'in_progress'",
                (job_id,),
            )
            return cur.rowcount == 1

    def restart(self, job_id: str) -> Job | None:
        """Start a running job again from its first step (what ran it died): attempts + 1, progress 0. None when
        the job no longer runs (deleted meanwhile)."""
        with self._lock, self._transaction() as db:
            cur = db.execute(
                "UPDATE jobs SET progress = 0, started_at = ?, attempts = attempts + 1 "
                "WHERE id = ? AND status = 'in_progress'",
                (self.now(), job_id),
            )
            return self._one("SELECT * FROM jobs WHERE id = ?", (job_id,)) if cur.rowcount == 1 else None

    def recover(self, max_attempts: int, ttl_seconds: float) -> tuple[list[str], list[str]]:
        """After a crash: jobs left in_progress run again from the start, unless they have been started
        `max_attempts` times already (a job that keeps killing the server), which fail. Returns (re-queued, failed).
        """
        requeued, failed = [], []
        now = self.now()
        with self._lock, self._transaction() as db:
            for row in db.execute("SELECT id, attempts FROM jobs WHERE status = 'in_progress'").fetchall():
                if row["attempts"] >= max_attempts:
                    db.execute(
                        "UPDATE jobs SET status = 'failed', completed_at = ?, expires_at = ?, error_code = ?, "
                        "error_message = ? WHERE id = ?",
                        (
                            now,
                            now + int(ttl_seconds),
                            RESTART_LIMIT_CODE,
                            f"the server stopped {row['attempts']} times while running this job; "
                            "it is not retried again",
                            row["id"],
                        ),
                    )
                    failed.append(row["id"])
                else:
                    db.execute(
                        "UPDATE jobs SET status = 'queued', progress = 0, started_at = NULL WHERE id = ?", (row["id"],)
                    )
                    requeued.append(row["id"])
        return requeued, failed

    def delete(self, job_id: str) -> Job | None:
        """Remove a record; returns it as it was (None when there was none)."""
        with self._lock, self._transaction() as db:
            job = self._one("SELECT * FROM jobs WHERE id = ?", (job_id,))
            if job is not None:
                db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
            return job

    def expire(self) -> list[str]:
        """Delete the records whose expiry has passed; returns their ids (the caller removes the files next)."""
        with self._lock:
            rows = self._db.execute(
                "DELETE FROM jobs WHERE expires_at IS NOT NULL AND expires_at <= ? RETURNING id", (self.now(),)
            ).fetchall()
        return [r[0] for r in rows]

    def counts(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall()
        found = {r[0]: r[1] for r in rows}
        return {status: found.get(status, 0) for status in STATUSES}

    def ids(self) -> set[str]:
        with self._lock:
            return {r[0] for r in self._db.execute("SELECT id FROM jobs")}


class JobFiles:
    """Where a job's files live: one folder per job, removed as a whole."""

    def __init__(self, data_dir: Path):
        self.root = Path(data_dir) / "jobs"
        make_private_dir(self.root)

    def folder(self, job_id: str, create: bool = False) -> Path:
        if not JOB_ID_RE.fullmatch(job_id):
            raise ValueError(f"expected a job id like video_<32 hex digits>, found {job_id!r}")
        path = self.root / job_id
        if create:
            path.mkdir(mode=PRIVATE_DIR, exist_ok=True)
        return path

    def make_private(self, job_id: str) -> None:
        """0600 on every file of a job (written through atomic_path, which follows the umask): the folder is 0700
        already, this keeps the files private wherever they are copied with their modes."""
        for entry in self.folder(job_id).iterdir():
            if entry.is_file():
                os.chmod(entry, PRIVATE_FILE)

    def video(self, job_id: str) -> Path:
        return self.folder(job_id) / "video.mp4"

    def thumbnail(self, job_id: str) -> Path:
        return self.folder(job_id) / "thumbnail.jpg"

    def input_image(self, job_id: str) -> Path:
        return self.folder(job_id) / "input.png"

    def remove(self, job_id: str) -> None:
        shutil.rmtree(self.folder(job_id), ignore_errors=True)

    def sweep(self, known: set[str]) -> list[str]:
        """At start (no writer is running): remove folders without a record and half-written temporary files.
        Returns what was removed, relative to the jobs folder."""
        removed = []
        for entry in sorted(self.root.iterdir()):
            if entry.name not in known:
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
                removed.append(entry.name)
                continue
            for tmp in entry.glob(".*.tmp"):
                tmp.unlink(missing_ok=True)
                removed.append(f"{entry.name}/{tmp.name}")
        return removed


def write_image(image: PIL.Image.Image, path: Path, format: str, **params: Any) -> None:
    """Save `image` at `path` atomically: a hidden temporary file beside it, fsync, rename."""
    with atomic_path(path) as tmp:
        os.chmod(tmp, PRIVATE_FILE)
        image.save(tmp, format=format, **params)


class DataDirLock:
    """An exclusive flock on <data_dir>/server.lock for the life of a server. The kernel drops it when the process
    dies, however it dies, so a SIGKILLed server never leaves a stale lock behind."""

    def __init__(self, data_dir: Path):
        self.path = Path(data_dir) / "server.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, PRIVATE_FILE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DataDirBusy(
                f"the data directory {self.path.parent} is in use by another k6fast server (pid {holder}); "
                "expected one server per data directory"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
