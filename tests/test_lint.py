"""The codebase stays ruff-clean (lint and format), checked with the same settings as pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_ruff_check_is_clean() -> None:
    run = _ruff("check", ".", "--exclude", ".venv")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_ruff_format_is_clean() -> None:
    run = _ruff("format", "--check", ".", "--exclude", ".venv")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
