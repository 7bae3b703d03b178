"""Jobs that survive: a SQLite record per video job plus one folder of files per job in the data directory.

Layout of a data directory:
    k6fast-data-dir.txt the marker that makes the folder the server's (datadir.py: what it may contain)
    jobs.sqlite3        the records (WAL journal, synchronous=FULL: a job acknowledged to a client is on disk)
    jobs/<id>/          input.png (the uploaded reference, re-encoded), video.mp4 + video.mp4.json, thumbnail.jpg
    server.lock         held (flock) by the one server using the directory
    storage.reserve     room kept for the records on a full disk (storage.py)

Everything in it is private to the server's user (prompts and videos are the clients' data): the directory and its
folders 0700, the database, the lock and job files 0600, whatever the umask.

Ordering rules that keep records and files consistent across a crash at any instant:
- a job's files are written (atomically) before its record says `completed`; a crash in between re-runs the job;
- a job's record is deleted before its files; a crash in between leaves files without a record, which `sweep`
  removes at the next start. So a record never points at missing files (except on a full disk, where a DELETE
  removes the files first to make room for the record's deletion: see storage.py).
Only what the server wrote is ever removed or re-permissioned: a job folder's own files (datadir.JOB_FILES), never
anything else a user put in `jobs/`.

This module knows nothing of torch or the pipeline, so the store can be tested (and inspected) on its own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..atomic import atomic_path
from ..request import Request
from .datadir import JOB_ID_RE, PRIVATE_DIR, PRIVATE_FILE, is_job_file, is_job_temporary, make_private_dir
from .datadir import DataDirBusy as DataDirBusy
from .datadir import DataDirLock as DataDirLock
from .storage import Storage

if TYPE_CHECKING:
    import PIL.Image

log = logging.getLogger("k6fast.server")
STATUSES = ("queued", "in_progress", "completed", "failed")
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


class StoreUnreadable(RuntimeError):
    """jobs.sqlite3 is not a job store this version can read (corrupt, not SQLite, another schema version)."""


def make_private_file(path: Path) -> None:
    """Create `path` if missing, 0600 (SQLite gives its -wal and -shm files the database file's mode)."""
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, PRIVATE_FILE))
    if path.stat().st_mode & 0o777 != PRIVATE_FILE:
        os.chmod(path, PRIVATE_FILE)


@dataclass(frozen=True)
class JobSpec:
    """What to generate, resolved (the checkpoint's default steps and guidance filled in) so that a re-run after a
    restart makes the same clip; `image` says whether an input reference is stored as jobs/<id>/input.png. Stored as
    the request's JSON (`Request.to_dict`, which loads a record older than a field and refuses an unknown one) with
    `seconds` beside it."""

    request: Request
    seconds: str  # as the client gave it (or derived from frames), reported back unchanged
    image: bool = False

    @property
    def size(self) -> str:
        return f"{self.request.width}x{self.request.height}"

    def to_json(self) -> str:
        return json.dumps({**self.request.to_dict(), "image": self.image, "seconds": self.seconds}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        raw = json.loads(text)
        seconds, image = raw.pop("seconds"), bool(raw.pop("image", False))
        return cls(Request.from_dict(raw), seconds, image)


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
        try:
            self._open()
        except BaseException as exc:
            self._db.close()
            # DatabaseError proper is a corrupt file or not SQLite at all; an OperationalError (locked, full,
            # unwritable) says nothing about the file's content.
            if isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError):
                raise self._unreadable(str(exc)) from None
            raise

    def _open(self) -> None:
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version == 0:
            # One script, one transaction: a crash while creating leaves no half-made schema behind.
            self._db.executescript(f"BEGIN;\n{_SCHEMA}\nPRAGMA user_version = {SCHEMA_VERSION};\nCOMMIT;")
        elif version != SCHEMA_VERSION:
            raise StoreUnreadable(
                f"{self.path}: job store schema version {version}, expected {SCHEMA_VERSION} "
                "(written by another k6fast version); use another --data-dir"
            )
        # Reads every page (the store holds records only, so this is quick): a damaged page fails the start, not a
        # request days later.
        problems = [row[0] for row in self._db.execute("PRAGMA quick_check(3)")]
        if problems != ["ok"]:
            raise self._unreadable("; ".join(problems))

    def _unreadable(self, why: str) -> StoreUnreadable:
        name = self.path.name
        why = " ".join(why.split())  # SQLite's report spans lines; the error is one
        why = why if len(why) <= 160 else why[:157] + "..."
        return StoreUnreadable(
            f"{self.path} is not a readable job store ({why}); move it aside together with {name}-wal and "
            f"{name}-shm beside it if present (the server then starts with an empty store), or choose another "
            "--data-dir"
        )

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @property
    def connection(self) -> sqlite3.Connection:
        """The store's one SQLite connection. Settable, so that a test can put a connection whose writes fail (a full
        disk) in its place."""
        return self._db

    @connection.setter
    def connection(self, db: sqlite3.Connection) -> None:
        self._db = db

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

    def expired_ids(self) -> list[str]:
        """The ids whose expiry has passed, their records kept (what `expire` deletes next)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT id FROM jobs WHERE expires_at IS NOT NULL AND expires_at <= ?", (self.now(),)
            ).fetchall()
        return [r[0] for r in rows]

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
    """Where a job's files live: one folder per job, removed with its files (only those the server names: anything
    else put there keeps the folder). `storage` is the data directory's room for writes (storage.py), shared by
    everything that writes into it."""

    def __init__(self, data_dir: Path):
        self.root = Path(data_dir) / "jobs"
        make_private_dir(self.root)
        self.storage = Storage(data_dir)

    def folder(self, job_id: str, create: bool = False) -> Path:
        if not JOB_ID_RE.fullmatch(job_id):
            raise ValueError(f"expected a job id like video_<32 hex digits>, found {job_id!r}")
        path = self.root / job_id
        if create:
            path.mkdir(mode=PRIVATE_DIR, exist_ok=True)
        return path

    def _own_files(self, folder: Path) -> list[Path]:
        return [entry for entry in folder.iterdir() if is_job_file(entry.name) and not entry.is_symlink()]

    def make_private(self, job_id: str) -> None:
        """0600 on every file of a job (written through atomic_path, which follows the umask): the folder is 0700
        already, this keeps the files private wherever they are copied with their modes."""
        for entry in self._own_files(self.folder(job_id)):
            if entry.is_file():
                os.chmod(entry, PRIVATE_FILE)

    def video(self, job_id: str) -> Path:
        return self.folder(job_id) / "video.mp4"

    def thumbnail(self, job_id: str) -> Path:
        return self.folder(job_id) / "thumbnail.jpg"

    def input_image(self, job_id: str) -> Path:
        return self.folder(job_id) / "input.png"

    def remove(self, job_id: str) -> None:
        self._remove_folder(self.folder(job_id))

    def _remove_folder(self, folder: Path) -> list[Path]:
        """The job's own files and then its folder; anything else in it stays (and so does the folder). Returns what
        stayed."""
        try:
            for entry in self._own_files(folder):
                entry.unlink(missing_ok=True)
            folder.rmdir()
        except FileNotFoundError:
            return []
        except OSError:  # not empty: something the server did not write is in it
            with contextlib.suppress(OSError):
                return sorted(folder.iterdir())
        return []

    def sweep(self, known: set[str]) -> list[str]:
        """At start (no writer is running): remove the files of jobs without a record and half-written temporary
        files. Only a job folder's own files go; anything else in the jobs folder is left as it is and logged.
        Returns what was removed, relative to the jobs folder."""
        removed, foreign = [], []
        for entry in sorted(self.root.iterdir()):
            if not JOB_ID_RE.fullmatch(entry.name) or entry.is_symlink() or not entry.is_dir():
                foreign.append(entry.name)
            elif entry.name not in known:
                left = self._remove_folder(entry)
                foreign += [f"{entry.name}/{path.name}" for path in left]
                removed += [] if left else [entry.name]
            else:
                for tmp in self._own_files(entry):
                    if is_job_temporary(tmp.name):
                        tmp.unlink(missing_ok=True)
                        removed.append(f"{entry.name}/{tmp.name}")
        if foreign:
            log.warning(
                "left %d thing(s) in %s that this server did not write, as they are: %s",
                len(foreign),
                self.root,
                ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else ""),
            )
        return removed


def write_image(image: PIL.Image.Image, path: Path, format: str, **params: Any) -> None:
    """Save `image` at `path` atomically: a hidden temporary file beside it, fsync, rename."""
    with atomic_path(path) as tmp:
        os.chmod(tmp, PRIVATE_FILE)
        image.save(tmp, format=format, **params)
