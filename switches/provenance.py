"""Provenance: what produced a result (version, source commit, arm and every switch), for records and metadata."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path
from typing import Any

from .. import __version__
from .options import Options

UNKNOWN = "unknown"
_GIT_TIMEOUT_S = 5.0
_SOURCE_DIR = Path(__file__).resolve().parent


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=_GIT_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.SubprocessError):
        # git missing, cwd gone, or git hung (a network filesystem): provenance degrades to "unknown".
        return None
    return done.stdout if done.returncode == 0 else None


@functools.cache
def git_state(source_dir: Path = _SOURCE_DIR) -> tuple[str, bool | None]:
    """(commit, dirty) of the k6fast checkout holding `source_dir`, or ("unknown", None) when it is not one.

    Cached per process. An installed k6fast can sit inside some other repository (a venv in a project), so the
    enclosing repository counts only when its top level is a k6fast checkout.
    """
    toplevel = _git(["rev-parse", "--show-toplevel"], source_dir)
    if toplevel is None or not _is_k6fast_checkout(Path(toplevel.strip())):
        return UNKNOWN, None
    commit = _git(["rev-parse", "HEAD"], source_dir)
    status = _git(["status", "--porcelain"], source_dir)
    if commit is None:
        return UNKNOWN, None
    return commit.strip(), None if status is None else bool(status.strip())


def _is_k6fast_checkout(toplevel: Path) -> bool:
    try:
        pyproject = (toplevel / "pyproject.toml").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    return any(line.replace(" ", "") == 'name="k6fast"' for line in pyproject.splitlines())


def provenance(options: Options) -> dict[str, Any]:
    """JSON-ready record of what generated a result; secrets appear only as "<set>"."""
    commit, dirty = git_state()
    return {
        "k6fast_version": __version__,
        "git_commit": commit,
        "git_dirty": dirty,
        "arm": options.arm_name,
        "arm_hash": options.arm_hash(),
        "switches": options.snapshot(),
    }
