"""A full disk is a state of the server, not a hang: the data directory's room for writes, shared by the HTTP side
and whatever runs the queue.

- A write that fails for want of space (ENOSPC, EDQUOT, SQLite's SQLITE_FULL) puts the server in the `full` state,
  logged once when it begins and once when it ends; `/health` reports it. A job whose files do not fit fails with the
  code INSUFFICIENT_STORAGE, a create request that cannot be stored gets a 507.
- While full, no job is started (it would only fail at its last write); every RECHECK_S a probe write tells whether
  there is room again, and the queue moves on as soon as there is.
- A record that must be written (a job's outcome, a DELETE) gets room first: the server keeps RESERVE_BYTES in
  `storage.reserve`, released when such a write finds the disk full, so that SQLite can append to its journal (it
  needs a few pages even to delete a row); the reserve is rewritten once there is room again. A job whose outcome
  still cannot be recorded stays with its worker, which retries, so it is never `in_progress` without one.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from .datadir import PRIVATE_FILE

log = logging.getLogger("k6fast.server")
INSUFFICIENT_STORAGE = "insufficient_storage"
FULL_REASON = (
    "the disk holding the data directory is full: new jobs are refused and queued ones wait until there is room"
)
RESERVE_NAME = "storage.reserve"
PROBE_NAME = "storage.probe"
# A DELETE or an outcome rewrites a few SQLite pages (4 KiB each) in the journal: this is room for dozens of them.
RESERVE_BYTES = 256 * 1024
RECHECK_S = 2.0
_SQLITE_FULL = 13  # sqlite3.SQLITE_FULL (Python 3.11+)
_OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)
T = TypeVar("T")


def is_disk_full(exc: BaseException | None) -> bool:
    """Whether `exc`, or an exception it was raised from or while handling, says the disk (or quota) is full."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _OUT_OF_SPACE:
            return True
        if getattr(exc, "sqlite_errorcode", None) == _SQLITE_FULL or "database or disk is full" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _write_filler(path: Path, size: int) -> None:
    """`size` bytes at `path`, on disk (fsync): a write that does not fit fails here, not later. Random bytes, since
    a compressing filesystem (ZFS, btrfs) stores zeros in no space at all."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE)
    try:
        data = memoryview(os.urandom(size))
        written = 0
        while written < size:
            written += os.write(fd, data[written:])
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)


class Storage:
    """The data directory's room for writes: `full()` when a write did not fit, `recheck()` until one does again."""

    def __init__(self, data_dir: Path):
        self.data_dir = Path(data_dir)
        self.reserve = self.data_dir / RESERVE_NAME
        self._lock = threading.Lock()
        self._problem: str | None = None
        self._probe_error: str | None = None  # logged once, not at every recheck

    @property
    def problem(self) -> str | None:
        """Why writes fail now, in words; None while there is room."""
        return self._problem

    def full(self) -> None:
        """A write failed for want of space."""
        with self._lock:
            began, self._problem = self._problem is None, FULL_REASON
        if began:
            log.warning(
                "the disk holding %s is full: jobs wait (none is started) until there is room again; deleting "
                "videos (DELETE /v1/videos/ID) frees space",
                self.data_dir,
            )

    def ensure_reserve(self) -> bool:
        """Put the reserve in place if it is not; False (and the state `full`) when it does not fit."""
        try:
            if self.reserve.is_file() and self.reserve.stat().st_size == RESERVE_BYTES:
                return True
            _write_filler(self.reserve, RESERVE_BYTES)
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            self.full()
            return False
        return True

    def release_reserve(self) -> bool:
        """Free the reserve for a record that must be written; False when there was none left to free."""
        try:
            self.reserve.unlink()
        except FileNotFoundError:
            return False
        log.warning("released the storage reserve (%d KiB) to record a change on a full disk", RESERVE_BYTES // 1024)
        return True

    def recheck(self) -> bool:
        """True when writes fit: at once while not full; while full, once the reserve is back in place and a probe
        as large fits beside it (the state then ends)."""
        if self._problem is None:
            return True
        if not self.ensure_reserve():
            return False
        probe = self.data_dir / PROBE_NAME
        try:
            _write_filler(probe, RESERVE_BYTES)
            probe.unlink()
        except OSError as exc:
            if not is_disk_full(exc) and str(exc) != self._probe_error:
                log.warning("could not write to %s: %s", self.data_dir, exc)
            self._probe_error = str(exc)
            return False
        self._probe_error = None
        with self._lock:
            self._problem = None
        log.info("the disk holding %s has room again; queued jobs start again", self.data_dir)
        return True

    def write_with_room(
        self,
        write: Callable[[], T],
        *,
        free: Callable[[], None] | None = None,
        gone: Callable[[], bool] = lambda: False,
        stopping: threading.Event | None = None,
    ) -> T | None:
        """Run the store write `write` until it fits. On a full disk: `free` (files that go anyway, such as a failed
        or deleted job's) and retry, then release the reserve and retry, then wait for room, retrying every RECHECK_S.
        Returns None without writing once `gone()` (the job was deleted meanwhile); when `stopping` is set, the
        error is raised (the job stays `in_progress` in the store, and the next start re-queues it)."""
        freeing = ([free] if free is not None else []) + [self.release_reserve]
        while True:
            try:
                return write()
            except Exception as exc:
                if not is_disk_full(exc):
                    raise
                self.full()
                if freeing:
                    freeing.pop(0)()
                    continue
                if gone():
                    return None
                if stopping is None or stopping.wait(RECHECK_S):
                    raise
                self.recheck()


class QueueReader:
    """How a dispatcher claims its next job: none while the disk is full, and a store that cannot be read is logged
    once per change of its error (with the traceback the first time), not once per poll."""

    def __init__(self, claim: Callable[[], T], storage: Storage):
        self._claim = claim
        self._storage = storage
        self._error: str | None = None
        self.blocked = False  # the last claim found the disk full or the store failing: wait before the next

    def claim(self) -> T | None:
        self.blocked = not self._storage.recheck()
        if self.blocked:
            return None
        try:
            job = self._claim()
        except Exception as exc:
            self.blocked = True
            if is_disk_full(exc):
                self._storage.full()
            elif str(exc) != self._error:
                self._error = str(exc)
                log.exception("could not read the job queue (logged again only when the error changes)")
            return None
        if self._error is not None:
            log.info("the job queue can be read again")
            self._error = None
        return job
