"""Shared by the Triton kernel tests: the interpreter switch and the subprocess that runs the `interpret` tests, the
DiT-like GEMM operands and the relative error the kernels are judged by, and the sm_90 compile and SASS helpers.

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

from k6fast.kernels import gluon_hopper

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(
    not INTERPRETING, reason="runs under TRITON_INTERPRET=1 (the file's interpreter test spawns that run)"
)
spawns_interpreter = pytest.mark.skipif(INTERPRETING, reason="this test is what starts the interpreter run")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


GLUON = gluon_hopper.GLUON_AVAILABLE
needs_gluon = pytest.mark.skipif(not GLUON, reason="this Triton has no Gluon")
needs_sm90_gluon = pytest.mark.skipif(
    not (GLUON and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="needs an sm_90 GPU and Gluon",
)


def dit_like_gemm(
    m: int, k: int, n: int, *, device: str = "cpu", seed: int = 0, dtype=torch.float32, outlier_weights: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A DiT-like linear layer's operands in `dtype`: x [m, k] ~ N(0, 1) with k/512 outlier channels (x30), w [n, k]
    ~ N(0, 0.02²) (with outlier_weights one weight in 4096 x20), bias [n] ~ N(0, 0.1²). Drawn in that order from one
    generator seeded with `seed` on `device`, so a seed gives the same tensors to every test."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=device)
    x[:, torch.randperm(k, generator=g, device=device)[: max(1, k // 512)]] *= 30.0
    w = torch.randn(n, k, generator=g, device=device) * 0.02
    if outlier_weights:
        w.view(-1)[torch.randperm(n * k, generator=g, device=device)[: max(1, n * k // 4096)]] *= 20.0
    bias = torch.randn(n, generator=g, device=device) * 0.1
    return x.to(dtype), w.to(dtype), bias.to(dtype)


# The DiT's linear layers at W1 (864x480, 121 frames): video tokens, and (K, N) of the fused blocks' GEMMs.
W1_TOKENS = 50220
W1_GEMM_SHAPES = [(4096, 4096), (4096, 16384), (16384, 4096)]


def checked_rows(m: int, device: str) -> torch.Tensor:
    """The rows a W1 GEMM test compares: the first 2048 and the last 300 (which include the partial last tile);
    references on every row of a 50220 x 16384 product would cost more memory and time than the kernels."""
    return torch.cat([torch.arange(2048), torch.arange(m - 300, m)]).to(device)


def run_interpret_tests(test_file: str, timeout: int = 600) -> None:
    """Run `test_file`'s `interpret`-marked tests in a child pytest under TRITON_INTERPRET=1; fail with its output."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", test_file, "-m", "interpret", "-q", "-p", "no:cacheprovider"]
    run = subprocess.run(cmd, env=env, cwd=Path(test_file).parents[1], capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout, run.stdout[-2000:]  # a child that collected nothing proves nothing


def interpreter_suite(test_file: str, timeout: int = 600):
    """The plain test that runs `test_file`'s `interpret` tests in a child pytest (`run_interpret_tests`); a kernel
    test file binds it to a test name: `test_triton_kernels_under_interpreter = interpreter_suite(__file__)`."""

    @pytest.mark.interpret
    @spawns_interpreter
    def test() -> None:
        run_interpret_tests(test_file, timeout=timeout)

    return test


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


def sass_loop_body(cubin: Path, marker: str) -> list[str]:
    """The instructions of the first loop (a backward branch) in `cubin`'s SASS that contains `marker` (an opcode such
    as QGMMA), disassembled with the installed Triton's cuobjdump; predicates stripped."""
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    ins = [(int(m[1], 16), m[2].strip()) for m in re.finditer(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", sass, re.M)]
    index = {addr: i for i, (addr, _) in enumerate(ins)}
    for i, (addr, text) in enumerate(ins):
        branch = re.search(r"BRA (0x[0-9a-f]+)", text)
        if branch and int(branch[1], 16) < addr:
            body = [re.sub(r"^@!?U?P\w+\s+", "", t) for _, t in ins[index[int(branch[1], 16)] : i + 1]]
            if any(t.split()[0].split(".")[0] == marker for t in body):
                return body
    raise AssertionError(f"no loop with {marker} in {cubin}")


def longest_dependent_chain(body: list[str], opcodes: set[str]) -> int:
    """The longest run of `opcodes` instructions in straight-line `body` where each reads the previous one's result
    (first register operand = destination); any other instruction writing a register ends its chain."""
    depth: dict[str, int] = {}
    longest = 0
    for text in body:
        regs = re.findall(r"\bR(\d+)\b", text)
        if not regs:
            continue
        if text.split()[0].split(".")[0] in opcodes:
            depth[regs[0]] = 1 + max((depth.get(r, 0) for r in regs[1:]), default=0)
            longest = max(longest, depth[regs[0]])
        else:
            depth[regs[0]] = 0
    return longest


def compile_gluon_sm90(kernel, signature: dict, constants: dict, num_warps: int):
    """Compile a Gluon kernel for sm_90a with the installed Triton, no GPU needed (its `.asm["ptx"]`, `.metadata`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    src = GluonASTSource(kernel, signature, constants, {})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
