"""Shared fixtures: tiny random-weight checkpoints built once per test session (no downloads)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    from k6fast.testing.tiny import make_tiny

    root = tmp_path_factory.mktemp("tiny")
    return {variant: make_tiny(root / variant, variant=variant, seed=0) for variant in ("distill", "base")}


@pytest.fixture(scope="session")
def tiny_distill(tiny_checkpoints) -> Path:
    return tiny_checkpoints["distill"]
