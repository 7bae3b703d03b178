"""Atomic writes: whatever a user keeps (clips, records, reports, checkpoints) appears whole or not at all.

Files go through a hidden temporary file beside the target, are flushed to disk and renamed over it; directories
are built beside the target and renamed into place. On any error the temporary is removed and an existing target
is left as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yields a temporary path beside `path` for the caller to write; on success it is fsynced and renamed over
    `path` (and the rename made durable), on failure removed."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    # Created with mode 0o666 so the umask applies as to any new file (mkstemp's 0o600 would leave a published file
    # unreadable to a server running as another user).
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_json_atomic(path: str | Path, data: Any) -> None:
    write_bytes_atomic(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def build_dir_atomically(out_dir: str | Path, build: Callable[[Path], None], what: str) -> Path:
    """Run `build(tmp_dir)` in a temporary directory beside `out_dir`, then rename it into place. A missing or empty
    `out_dir` is accepted; anything else is refused before any work."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        kind = "a non-empty directory" if out_dir.is_dir() else "a file"
        raise FileExistsError(f"expected a missing or empty directory for the {what}, found {kind}: {out_dir}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        build(tmp)
        # mkdtemp makes a private (0700) folder and some writers make 0600 files; a checkpoint is shared data.
        for folder, _, files in os.walk(tmp):
            os.chmod(folder, 0o755)
            for name in files:
                os.chmod(os.path.join(folder, name), 0o644)
        # rename(2) replaces an empty directory atomically; a non-empty one appearing meanwhile makes it fail.
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def sidecar_path(out: Path) -> Path:
    """The JSON record written beside a clip: `clip.mp4` → `clip.mp4.json`."""
    return out.with_name(out.name + ".json")
