"""Shared by the Triton kernel tests: the interpreter switch and the subprocess that runs the `interpret` tests.

Triton reads TRITON_INTERPRET when it is imported, so the interpreted tests of a file run in a child pytest with the
variable set; it never leaks into the other test modules of this process. bf16 dots and fp8 rounding are wrong in
the interpreter, so those cases are `gpu` tests instead.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(
    not INTERPRETING, reason="runs under TRITON_INTERPRET=1 (the file's interpreter test spawns that run)"
)
spawns_interpreter = pytest.mark.skipif(INTERPRETING, reason="this test is what starts the interpreter run")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def run_interpret_tests(test_file: str, timeout: int = 600) -> None:
    """Run `test_file`'s `interpret`-marked tests in a child pytest under TRITON_INTERPRET=1; fail with its output."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", test_file, "-m", "interpret", "-q", "-p", "no:cacheprovider"]
    run = subprocess.run(cmd, env=env, cwd=Path(test_file).parents[1], capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout, run.stdout[-2000:]  # a child that collected nothing proves nothing


def assert_ptxas_sm90a_clean(ptx: str, tmp_path: Path) -> None:
    """Assemble `ptx` for sm_90a with the installed Triton's ptxas: no serialized wgmmas (warning C7514), no spills."""
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    (tmp_path / "k.ptx").write_text(ptx)
    out = subprocess.run(
        [str(ptxas), "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    log = out.stdout + out.stderr
    assert "C7514" not in log, f"ptxas serialized the wgmmas:\n{log}"
    assert re.search(r"0 bytes spill stores, 0 bytes spill loads", log), log


def compile_gluon_sm90(kernel, signature: dict, constants: dict, num_warps: int):
    """Compile a Gluon kernel for sm_90a with the installed Triton, no GPU needed (its `.asm["ptx"]`, `.metadata`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    src = GluonASTSource(kernel, signature, constants, {})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
