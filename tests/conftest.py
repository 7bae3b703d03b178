"""Shared fixtures: tiny random-weight checkpoints built once per test session (no downloads), and how many
processes run the suite."""

from __future__ import annotations

import fcntl
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


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """`-n auto` (pyproject's addopts): one worker per CPU core (pytest-xdist's own count, which
    PYTEST_XDIST_AUTO_NUM_WORKERS overrides), except where a second process would change what a test measures or
    only add one. A machine with a GPU runs its tests in one process: the `gpu` tests read the card's free memory
    and time kernels, so they share the card with nothing. A pytest that a test starts (the Triton interpreter
    suites' child runs) runs in one process too: its parent already keeps every core busy."""
    if Path("/dev/nvidia0").exists() or "PYTEST_CURRENT_TEST" in os.environ:
        return 0
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files of end-to-end runs first, the Ray cluster's before the others: `--dist loadfile` (pyproject's addopts,
    with `--no-loadscope-reorder`) hands files to the workers in this order, so the longest ones start at once and
    the many short files fill in beside them, rather than one long file starting last while the other worker idles.
    The sort is stable: each file keeps its own order."""
    ray = {item.path for item in items if item.get_closest_marker("ray")}
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (item.path not in ray, item.path not in slow))


@pytest.fixture(autouse=True, scope="session")
def _private_cache_home(tmp_path_factory) -> None:
    """`k6fast generate` keeps encoded prompts under the user's cache folder by default: the tests' runs keep theirs
    in a folder of their own (the subprocesses they start inherit it), not in the home of whoever runs them."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache-home"))


def _cpu_flash_attention_breaks() -> bool:
    """Whether PyTorch's CPU flash attention fails in bf16 here: under a forced lower ATEN_CPU_CAPABILITY (CI's AVX2
    and scalar reruns) on a CPU with AMX, it still sees the hardware's bf16 support and calls a packing routine the
    lower build lacks ("pack_vnni2 is only supported when avx512 is supported", torch 2.14.1). A CPU without
    AVX-512, the one the reruns stand in for, takes the unpacked path and does not fail."""
    if not os.environ.get("ATEN_CPU_CAPABILITY"):
        return False
    import torch

    q = torch.zeros(1, 2, 64, 64, dtype=torch.bfloat16)  # a size the CPU flash kernel takes
    try:
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    except RuntimeError as exc:
        return "pack_vnni2" in str(exc)
    return False


@pytest.fixture(autouse=True, scope="session")
def _cpu_attention_under_forced_capability():
    """Where `_cpu_flash_attention_breaks`, CPU attention runs PyTorch's math backend for the whole run."""
    if not _cpu_flash_attention_breaks():
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        yield


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory, request) -> dict[str, Path]:
    """Both tiny checkpoints, built once per run. The workers of a parallel run share one pair: the first worker to
    need them builds them in the run's base folder while the others wait on the lock, then read the same files. No
    test writes into them."""
    from k6fast.testing.tiny import VARIANTS, make_tiny

    if not hasattr(request.config, "workerinput"):  # one process: a folder of this session's own
        root = tmp_path_factory.mktemp("tiny")
        return {variant: make_tiny(root / variant, variant=variant, seed=0) for variant in VARIANTS}
    root = tmp_path_factory.getbasetemp().parent / "tiny"  # each worker's base folder is a child of the run's
    root.mkdir(exist_ok=True)
    with open(root / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # make_tiny renames a finished checkpoint into place: a folder that exists is complete.
        return {v: root / v if (root / v).is_dir() else make_tiny(root / v, variant=v, seed=0) for v in VARIANTS}


@pytest.fixture(scope="session")
def tiny_distill(tiny_checkpoints) -> Path:
    return tiny_checkpoints["distill"]


@pytest.fixture(scope="session")
def tiny_bf16(tiny_distill, tmp_path_factory) -> Path:
    """The tiny checkpoint (float32) with its transformer stored BF16, norms left F32: what `k6fast quantize --format
    df11` compresses."""
    import shutil

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from k6fast.checkpoint import open_checkpoint

    root = tmp_path_factory.mktemp("bf16") / "ckpt"
    shutil.copytree(tiny_distill, root, copy_function=shutil.copy)
    for file in open_checkpoint(root).transformer_files:
        with safe_open(file, "pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        tensors = {k: t if "norm" in k else t.to(torch.bfloat16) for k, t in tensors.items()}
        save_file(tensors, file, metadata=meta)
    return root
