"""Which folder a server may use as its data directory, and what in it is the server's.

A server removes and re-permissions only what it made. It owns a data directory by the marker file MARKER, written
when it creates a new folder or adopts an empty one; from then on the folder is private (0700) and its `jobs/` folder
is the server's. A folder that holds anything else and no marker is refused at start (`DataDirRefused`, one line
that says why and what to do): it may be a user's folder given by mistake, whose files the leftover sweep would
otherwise take for the server's.

A data directory of a k6fast from before the marker (jobs.sqlite3, server.lock, jobs/<job id>/ with a job's files)
is adopted when it holds nothing but what k6fast writes; one file of anything else and it is refused like any other.

The lock (`DataDirLock`) keeps a data directory to one server at a time.
"""

from __future__ import annotations

import fcntl
import os
import re
from pathlib import Path

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
MARKER = "k6fast-data-dir.txt"
MARKER_TEXT = (
    "This folder is the data directory of a k6fast server (`k6fast serve --data-dir`): its job records\n"
    "(jobs.sqlite3), their files (jobs/<job id>/), its lock (server.lock) and a small space reserve\n"
    "(storage.reserve). The server removes only what it wrote here; keep nothing else in this folder.\n"
)
JOB_ID_RE = re.compile(r"video_[0-9a-f]{32}")
# What k6fast writes at the top of a data directory (SQLite's companions of jobs.sqlite3 included).
OWN_TOP_FILES = frozenset(
    {
        MARKER,
        "jobs.sqlite3",
        "jobs.sqlite3-wal",
        "jobs.sqlite3-shm",
        "jobs.sqlite3-journal",
        "server.lock",
        "storage.reserve",
        "storage.probe",
    }
)
JOBS_FOLDER = "jobs"
# A job folder's files, and the hidden temporaries that atomic writes leave behind when a crash interrupts them.
JOB_FILES = frozenset({"input.png", "video.mp4", "video.mp4.json", "thumbnail.jpg"})
_JOB_TEMPORARY_RE = re.compile(r"\..+\.tmp")


class DataDirRefused(RuntimeError):
    """The folder holds files the server did not write, or is not a folder."""


class DataDirBusy(RuntimeError):
    """Another server holds the data directory's lock."""


def is_job_file(name: str) -> bool:
    """A name the server gives a file in a job's folder (a temporary of an atomic write included)."""
    return name in JOB_FILES or bool(_JOB_TEMPORARY_RE.fullmatch(name))


def is_job_temporary(name: str) -> bool:
    return bool(_JOB_TEMPORARY_RE.fullmatch(name))


def _plain_file(path: Path) -> bool:
    return not path.is_symlink() and path.is_file()


def _plain_dir(path: Path) -> bool:
    return not path.is_symlink() and path.is_dir()


def _own_job_file(path: Path) -> bool:
    return _plain_file(path) and is_job_file(path.name)


def foreign_entries(data_dir: Path) -> list[str]:
    """What in `data_dir` k6fast would not have written (paths relative to it, sorted); empty for an empty folder
    or one only k6fast wrote into."""
    foreign = []
    for entry in sorted(data_dir.iterdir()):
        if entry.name == JOBS_FOLDER and _plain_dir(entry):
            for job in sorted(entry.iterdir()):
                name = f"{JOBS_FOLDER}/{job.name}"
                if not (JOB_ID_RE.fullmatch(job.name) and _plain_dir(job)):
                    foreign.append(name)
                else:
                    foreign += [f"{name}/{f.name}" for f in sorted(job.iterdir()) if not _own_job_file(f)]
        elif not (entry.name in OWN_TOP_FILES and _plain_file(entry)):
            foreign.append(entry.name)
    return foreign


def make_private_dir(path: Path) -> None:
    """Create `path` (and missing parents) if needed and make it 0700; only for folders the server owns."""
    path = Path(path)
    path.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o777 != PRIVATE_DIR:
        os.chmod(path, PRIVATE_DIR)


def own_data_dir(path: Path) -> None:
    """Make `path` this server's data directory: create it when missing, adopt it when it is empty or holds only what
    k6fast writes, refuse it (DataDirRefused) otherwise; then make it private. OSError when the folder cannot be
    read or written."""
    path = Path(path)
    marker = path / MARKER
    if _plain_file(marker):
        make_private_dir(path)
        return
    if path.exists() or path.is_symlink():
        if not _plain_dir(path):
            raise DataDirRefused(
                f"the data directory {path} is not a folder; expected a new or empty folder, or one a k6fast "
                "server made: choose another --data-dir (or K6_DATA_DIR)"
            )
        foreign = foreign_entries(path)
        if foreign:
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            raise DataDirRefused(
                f"the data directory {path} holds files or folders k6fast did not write ({shown}) and no {MARKER} "
                "marker; a server removes what it takes for its own leftovers, so it uses only a new or empty folder "
                "or one a k6fast server made: choose another --data-dir (or K6_DATA_DIR), or move those files out"
            )
    else:
        path.mkdir(mode=PRIVATE_DIR, parents=True)
    fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE)
    try:
        os.write(fd, MARKER_TEXT.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    make_private_dir(path)


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
