"""Whether the packages a `k6fast generate` process imports have compiled bytecode (.pyc) to read.

Without it every process compiles them from source before its first check: the generate path's imports took 2.2-2.5x
as long on the CPU machine (measurements/sessions/2026-12-02_imports-cpu). `pip install` compiles bytecode; `uv pip
install` (without `--compile-bytecode`), `pip install --no-compile` and unpacked wheels do not. Python then writes it
at the first import where it can, so only the first process pays, unless PYTHONDONTWRITEBYTECODE is set (common in
container images) or the folder is read-only: then every process pays. `k6fast doctor` reports it from here.

Looks for files only (importlib's spec finder and cache_from_source): nothing is imported.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

# The packages whose import dominates a generate process's start-up, in import order.
PACKAGES = ("torch", "transformers", "diffusers", "k6fast")


@dataclass(frozen=True)
class Bytecode:
    package: str
    folder: Path
    compiled: bool  # its __init__'s bytecode for this interpreter exists
    writable: bool  # this process could write it (not PYTHONDONTWRITEBYTECODE, folder writable)


def package_bytecode(package: str, *, dont_write: bool | None = None) -> Bytecode | None:
    """`package`'s bytecode state, judged by its `__init__.py` (pip and compileall compile a package whole); None
    when it is not installed or is not a source package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    init = Path(spec.origin)
    cached = Path(importlib.util.cache_from_source(str(init)))
    dont_write = sys.dont_write_bytecode if dont_write is None else dont_write
    writable = not dont_write and os.access(cached.parent if cached.parent.exists() else init.parent, os.W_OK)
    return Bytecode(package, init.parent, cached.is_file(), writable)


def bytecode_advice(states: list[Bytecode]) -> str | None:
    """One doctor line when some package has no bytecode, else None."""
    missing = [s for s in states if not s.compiled]
    if not missing:
        return None
    names = ", ".join(s.package for s in missing)
    folders = " ".join(sorted({str(s.folder.parent) for s in missing}))
    # This interpreter by its path: a bare `python3` outside the venv may be another Python, whose bytecode (its own
    # cpython-3XY tag) this one never reads.
    fix = f"`{sys.executable} -m compileall -q -j 0 {folders}`"
    if all(s.writable for s in missing):
        return f"bytecode: {names} not compiled yet; the first process compiles and writes it, or run {fix} now"
    return (f"bytecode: {names} not compiled, and this environment cannot write it (PYTHONDONTWRITEBYTECODE or a "
            f"read-only folder): every process compiles it again before it starts; run {fix}")  # fmt: skip


def check(packages: tuple[str, ...] | None = None) -> str | None:
    """The doctor's bytecode line for this interpreter's packages (default PACKAGES)."""
    return bytecode_advice([s for p in packages or PACKAGES if (s := package_bytecode(p)) is not None])
