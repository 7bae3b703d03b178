"""The command line answers `--help` and refuses every bad argument, switch, arm, checkpoint and image before it
imports anything heavy (PyTorch, diffusers, transformers): importing those alone takes seconds, the checks a fraction
of one.

Each case runs `python -X importtime -m k6fast.cli ...` (or `-m k6fast.server`) in a fresh process and checks its exit
status, that its stderr is the one `error: ...` line, and that no heavy package appears in the import log. The import
log, not the wall time, is what is asserted: a busy machine makes any time bound flaky, while one heavy import is
already most of the time the command is allowed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k6fast.cli import build_parser
from k6fast.cli_args import no_gpu_device_files

HEAVY = ("torch", "diffusers", "transformers")
IMPORT_LOG = "import time:"


def _subcommands() -> list[str]:
    (sub,) = [a for a in build_parser()._actions if a.dest == "command"]
    return sorted(sub.choices)


def _run(args: list[str], cwd, env: dict[str, str] | None = None, module: str = "k6fast.cli"):
    """(the finished process, its stderr without the import log, the heavy packages it imported)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("K6_")} | (env or {})
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", module, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=environ,
        timeout=120,
    )
    log = done.stderr.splitlines()
    imported = [line.rsplit("|", 1)[1].strip() for line in log if line.startswith(IMPORT_LOG)]
    heavy = sorted({name for name in imported if name.split(".")[0] in HEAVY})
    return done, [line for line in log if not line.startswith(IMPORT_LOG)], heavy


def test_every_subcommand_is_registered_without_heavy_imports() -> None:
    assert {"generate", "serve", "gate", "bench", "doctor", "quantize", "make-tiny"} <= set(_subcommands())


@pytest.mark.parametrize("command", [[], *([name] for name in _subcommands())], ids=lambda c: " ".join(c) or "k6fast")
def test_help_answers_without_heavy_imports(tmp_path, command: list[str]) -> None:
    done, _, heavy = _run([*command, "--help"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: k6fast")
    assert heavy == [], f"k6fast {' '.join(command)} --help imported {heavy[:5]}"


GEN = ["generate", "--prompt", "p", "--size", "32x32", "--frames", "9", "--out", "a.mp4"]
# (arguments, environment, the error line's words); {tiny} is a tiny distilled checkpoint, {broken} a copy of it
# without its vocoder, {text} a text file, {here} the (empty) folder the command runs in.
CASES = {
    "generate-size": ([*GEN, "--model", "x", "--size", "65x64"], {}, "width 65 is not a positive multiple of 16"),
    "generate-frames": ([*GEN, "--model", "x", "--frames", "10"], {}, "frame count 10 is not of the form 4k+1"),
    "generate-out": ([*GEN, "--model", "x", "--out", "a.mkv"], {}, "expected a path ending in .mp4"),
    "generate-seed": ([*GEN, "--model", "x", "--seed", "-1"], {}, "--seed: expected an integer in [0, "),
    "generate-steps": ([*GEN, "--model", "x", "--steps", "0"], {}, "--steps: expected an integer >= 1, found 0"),
    "generate-guidance-nan": ([*GEN, "--model", "x", "--guidance", "nan"], {}, "--guidance: expected a finite"),
    "generate-prompt": ([*GEN, "--model", "x", "--prompt", " "], {}, "--prompt is empty"),
    "generate-switch": ([*GEN, "--model", "{tiny}"], {"K6_GEMM": "bogus"}, "Unable to use K6_GEMM='bogus'"),
    "generate-cache-steps": (
        [*GEN, "--model", "{tiny}"],
        {"K6_PIFLOW_CACHE_STEPS": "abc"},
        "Unable to use K6_PIFLOW_CACHE_STEPS='abc'",
    ),
    "generate-arm": ([*GEN, "--model", "{tiny}", "--arm", "nope"], {}, "Unknown arm 'nope': expected one of"),
    "generate-model-missing": ([*GEN, "--model", "{here}/nowhere"], {}, "no such directory"),
    "generate-model-not-a-checkpoint": ([*GEN, "--model", "{here}"], {}, "missing file {here}/model_index.json"),
    "generate-model-component": ([*GEN, "--model", "{broken}"], {}, "missing component folder {broken}/vocoder"),
    "generate-image-missing": (
        [*GEN, "--model", "{tiny}", "--image", "/nonexistent/ref.png"],
        {},
        "--image /nonexistent/ref.png: No such file or directory",
    ),
    "generate-image-unreadable": (
        [*GEN, "--model", "{tiny}", "--image", "{text}"],
        {},
        "--image {text}: not an image Pillow can read",
    ),
    "generate-guidance-distilled": ([*GEN, "--model", "{tiny}", "--guidance", "3.0"], {}, "must be exactly 1.0"),
    "generate-cache-step-past-end": (
        [*GEN, "--model", "{tiny}", "--steps", "3"],
        {"K6_PIFLOW_CACHE_STEPS": "5"},
        "K6_PIFLOW_CACHE_STEPS",
    ),
    "generate-device": ([*GEN, "--model", "{tiny}", "--device", "tpu"], {}, "--device tpu: not a device name"),
    "generate-device-meta": ([*GEN, "--model", "{tiny}", "--device", "meta"], {}, "meta devices are not supported"),
    "generate-cuda-without-gpu": (
        [*GEN, "--model", "{tiny}", "--device", "cuda"],
        {},
        "--device cuda: no CUDA GPU is available on this machine",
    ),
    "switches-arm": (["switches", "--arm", "nope"], {}, "Unknown arm 'nope'"),
    "serve-switch": (["serve", "--model", "{tiny}"], {"K6_GEMM": "bogus"}, "Unable to use K6_GEMM='bogus'"),
    "serve-model": (["serve", "--model", "{here}"], {}, "missing file {here}/model_index.json"),
    "serve-device": (["serve", "--model", "{tiny}", "--device", "tpu"], {}, "--device tpu: not a device name"),
    "gate-nothing": (["gate", "--model", "x"], {}, "nothing to do: expected at least one --arm, --exact or --floor"),
    "gate-size": (["gate", "--model", "x", "--arm", "final", "--size", "65x64"], {}, "width 65 is not a positive"),
    "gate-arm": (["gate", "--model", "{tiny}", "--arm", "nope"], {}, "Unknown arm 'nope'"),
    "gate-model": (["gate", "--model", "{here}", "--arm", "final"], {}, "missing file {here}/model_index.json"),
    "make-tiny-seed": (["make-tiny", "tiny", "--seed", "-1"], {}, "seed must be an int in [0, 2**32), got -1"),
    "make-synthetic-blocks": (
        ["make-synthetic", "s", "--blocks", "99"],
        {},
        "--blocks must be in 1..60 for pro-distill",
    ),
}


@pytest.fixture(scope="module")
def paths(tiny_distill: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cli-errors")
    broken = shutil.copytree(tiny_distill, root / "broken")
    shutil.rmtree(broken / "vocoder")
    (root / "text.png").write_text("not an image\n")
    return {"tiny": str(tiny_distill), "broken": str(broken), "text": str(root / "text.png")}


@pytest.mark.parametrize("case", CASES)
def test_every_cli_error_is_one_line_before_any_heavy_import(paths: dict[str, str], tmp_path, case: str) -> None:
    args, env, words = CASES[case]
    # Only a machine without GPU device files can refuse `--device cuda` unseen; where there are some, PyTorch counts
    # the GPUs, so the case asks for one past the last and may import it (only it).
    counts_gpus = case == "generate-cuda-without-gpu" and not no_gpu_device_files()
    if counts_gpus:
        args = [*args[:-1], "cuda:4096"]
        words = "--device cuda:4096: this machine has"
    here = tmp_path / "cwd"
    here.mkdir()
    names = paths | {"here": str(here)}
    done, stderr, heavy = _run([a.format(**names) for a in args], here, env)
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(stderr) == 1 and stderr[0].startswith("error: ") and words.format(**names) in stderr[0], stderr
    allowed = {"torch"} if counts_gpus else set()
    assert [m for m in heavy if m.split(".")[0] not in allowed] == [], f"{case} imported {heavy[:5]} before refusing"
    assert list(here.iterdir()) == []  # refused before writing anything


def test_unknown_switch_is_one_warning_line_in_the_server_entry_point(tmp_path) -> None:
    done, stderr, heavy = _run(
        ["--model", str(tmp_path), "--device", "tpu"], tmp_path, {"K6_GEM": "fp8"}, "k6fast.server"
    )
    assert done.returncode == 2
    assert stderr[0] == "warning: Unknown switch K6_GEM is ignored; did you mean K6_GEMM?"
    assert len(stderr) == 2 and stderr[1].startswith("error: --device tpu: not a device name"), stderr
    assert heavy == []


def test_importing_k6fast_changes_no_warning_filter_format_or_logger(tmp_path) -> None:
    """`quiet_warnings` is for entry points only: a program that imports k6fast keeps its own warning settings.
    (FutureWarning is the category Python shows by default; third-party imports add filters of their own.)"""
    code = (
        "import logging, warnings\n"
        "import k6fast.pipeline, k6fast.cli, k6fast.server.cli, k6fast.entry\n"
        "hidden = lambda: [f for f in warnings.filters if f[:3] == ('ignore', None, FutureWarning) and f[3] is None]\n"
        "assert hidden() == [], hidden()\n"
        "assert warnings.formatwarning is warnings._formatwarning_orig\n"
        "assert [logging.getLogger(n).level for n in k6fast.entry.QUIET_LOGGERS] == [logging.NOTSET] * 2\n"
        "k6fast.entry.quiet_warnings()  # what the check above would see from an entry point\n"
        "assert hidden() and warnings.formatwarning is not warnings._formatwarning_orig\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
