"""The command line answers `--help` and refuses bad arguments in well under a second: nothing heavy (PyTorch,
diffusers, transformers) is imported before the arguments are known to be valid.

Each case runs `python -X importtime -m k6fast.cli ...` in a fresh process, checks its answer, that no heavy package
appears in the import log, and its wall time. The bound is 2 s: the commands take a fraction of a second, and a
loaded 2-core CI machine must not make the test flaky; importing PyTorch alone takes longer than that on such a
machine, so an accidental heavy import fails the time check as well as the import check.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from k6fast.cli import build_parser

HEAVY = ("torch", "diffusers", "transformers")
MAX_SECONDS = 2.0


def _subcommands() -> list[str]:
    (sub,) = [a for a in build_parser()._actions if a.dest == "command"]
    return sorted(sub.choices)


def _run(args: list[str], cwd) -> tuple[subprocess.CompletedProcess, float, list[str]]:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "k6fast.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=60,
    )
    seconds = time.perf_counter() - start
    imported = [line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    heavy = sorted({name for name in imported if name.split(".")[0] in HEAVY})
    return done, seconds, heavy


def test_every_subcommand_is_registered_without_heavy_imports() -> None:
    assert {"generate", "serve", "gate", "bench", "doctor", "quantize", "make-tiny"} <= set(_subcommands())


@pytest.mark.parametrize("command", [[], *([name] for name in _subcommands())], ids=lambda c: " ".join(c) or "k6fast")
def test_help_answers_fast_without_heavy_imports(tmp_path, command: list[str]) -> None:
    done, seconds, heavy = _run([*command, "--help"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: k6fast")
    assert heavy == [], f"k6fast {' '.join(command)} --help imported {heavy[:5]}"
    assert seconds < MAX_SECONDS


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["generate", "--model", "x", "--prompt", "p", "--size", "65x64", "--out", "a.mp4"],
            "error: width 65 is not a positive multiple of 16 (nearest valid: 64 or 80)",
        ),
        (["generate", "--model", "x", "--prompt", "p", "--frames", "10", "--out", "a.mp4"], "frame count 10"),
        (["generate", "--model", "x", "--prompt", "p", "--out", "a.mkv"], "expected a path ending in .mp4"),
        (["gate", "--model", "x"], "error: nothing to do: expected at least one --arm, --exact or --floor"),
        (["gate", "--model", "x", "--arm", "final", "--size", "65x64"], "error: width 65 is not a positive multiple"),
        (["make-tiny", "tiny", "--seed", "-1"], "error: seed must be an int in [0, 2**32), got -1"),
        (["make-synthetic", "syn", "--blocks", "99"], "error: --blocks must be in 1..60 for pro-distill, found 99"),
    ],
    ids=[
        "generate-size",
        "generate-frames",
        "generate-out",
        "gate-nothing",
        "gate-size",
        "make-tiny-seed",
        "make-synthetic-blocks",
    ],  # fmt: skip
)
def test_bad_arguments_are_refused_fast_without_heavy_imports(tmp_path, args: list[str], message: str) -> None:
    done, seconds, heavy = _run(args, tmp_path)
    assert done.returncode == 2
    assert message in done.stderr
    assert heavy == [], f"k6fast {' '.join(args)} imported {heavy[:5]} before refusing its arguments"
    assert seconds < MAX_SECONDS
    assert list(tmp_path.iterdir()) == []  # refused before writing anything
