"""Shared fixtures: tiny random-weight checkpoints built once per test session (no downloads)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# On a machine without a GPU, PyTorch (and the subprocesses the tests start: bench visits, servers, the CLI) computes
# on one thread. The tiny models' ops are far too small to gain from a second thread, and on a small machine shared
# with the tests' own subprocesses OpenMP's threads wait on each other for whole scheduler slices: the same tiny
# request ran many times slower on two threads than on one with another process busy. Set before torch is imported;
# an OMP_NUM_THREADS the caller set wins.
if not Path("/dev/nvidia0").exists():
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True, scope="session")
def _private_cache_home(tmp_path_factory) -> None:
    """`k6fast generate` keeps encoded prompts under the user's cache folder by default: the tests' runs keep theirs
    in a folder of their own (the subprocesses they start inherit it), not in the home of whoever runs them."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache-home"))


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    from k6fast.testing.tiny import make_tiny

    root = tmp_path_factory.mktemp("tiny")
    return {variant: make_tiny(root / variant, variant=variant, seed=0) for variant in ("distill", "base")}


@pytest.fixture(scope="session")
def tiny_distill(tiny_checkpoints) -> Path:
    return tiny_checkpoints["distill"]
