"""The command line answers `--help` and refuses every bad argument, switch, arm, checkpoint and image before it
imports anything heavy (PyTorch, diffusers, transformers): importing those alone takes seconds, the checks a fraction
of one.

Each case runs `python -X importtime -m k6fast.cli ...` (or `-m k6fast.server`) in a fresh process and checks its exit
status, that its stderr is the one `error: ...` line, that no heavy package appears in the import log, and its
processor and wall time (tests/cli_testing.py: the rules every refusal is held to, and why those bounds).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from cli_testing import CPU_BOUND_S, WALL_BOUND_S, assert_refused, run_cli

from k6fast.cli import build_parser
from k6fast.cli_args import no_gpu_device_files


def _subcommands() -> list[str]:
    (sub,) = [a for a in build_parser()._actions if a.dest == "command"]
    return sorted(sub.choices)


def test_every_subcommand_is_registered_without_heavy_imports() -> None:
    assert {"generate", "serve", "gate", "bench", "doctor", "quantize", "make-tiny"} <= set(_subcommands())


@pytest.mark.parametrize("command", [[], *([name] for name in _subcommands())], ids=lambda c: " ".join(c) or "k6fast")
def test_help_answers_without_heavy_imports(tmp_path, command: list[str]) -> None:
    done, _, heavy = run_cli([*command, "--help"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: k6fast")
    assert heavy == [], f"k6fast {' '.join(command)} --help imported {heavy[:5]}"


GEN = ["generate", "--prompt", "p", "--size", "32x32", "--frames", "9", "--out", "a.mp4"]
TUNE = ["tune", "--model", "{tiny}", "--prompts", str(Path(__file__).parents[1] / "quality_gate" / "setA.json"),
        "--lpips-max", "0.1"]  # fmt: skip
# (arguments, environment, the error line's words); {tiny} is a tiny distilled checkpoint, {broken} a copy of it
# without its vocoder, {text} a text file, {here} the (empty) folder the command runs in.
CASES = {
    "generate-size": ([*GEN, "--model", "x", "--size", "65x64"], {}, "width 65 is not a positive multiple of 16"),
    "generate-frames": ([*GEN, "--model", "x", "--frames", "10"], {}, "frame count 10 is not of the form 4k+1"),
    "generate-out": ([*GEN, "--model", "x", "--out", "a.mkv"], {}, "expected a path ending in .mp4"),
    "generate-seed": ([*GEN, "--model", "x", "--seed", "-1"], {}, "--seed: expected an integer in [0, "),
    "generate-steps": ([*GEN, "--model", "x", "--steps", "0"], {}, "--steps: expected an integer >= 1, found 0"),
    "generate-stop-after": ([*GEN, "--model", "x", "--stop-after-steps", "0"], {}, "--stop-after-steps: expected an"),
    "generate-stop-after-long": (
        [*GEN, "--model", "{tiny}", "--stop-after-steps", "11"],
        {},
        "--stop-after-steps 11: expected at most the request's 10 steps",
    ),
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
    "generate-model-truncated": ([*GEN, "--model", "{truncated}"], {}, "truncated safetensors file"),
    "serve-port": (["serve", "--model", "{tiny}", "--port", "99999"], {}, "port must be in [0, 65535]"),
    "serve-queue": (["serve", "--model", "{tiny}", "--max-queue", "0"], {}, "max_queue must be an integer >= 1"),
    "serve-upload": (["serve", "--model", "{tiny}", "--max-upload-mb", "0"], {}, "--max-upload-mb must be a number"),
    "serve-arm": (["serve", "--model", "{tiny}", "--arm", "nope"], {}, "Unknown arm 'nope'"),
    "serve-replicas": (["serve", "--model", "{tiny}", "--ray", "--replicas", "0"], {}, "--replicas must be an integer"),
    "serve-data-dir-foreign": (
        ["serve", "--model", "{tiny}", "--device", "cpu", "--data-dir", "{foreign}"],
        {},
        "holds files or folders k6fast did not write (mine.txt)",
    ),
    "serve-store-corrupt": (
        ["serve", "--model", "{tiny}", "--device", "cpu", "--data-dir", "{corrupt}"],
        {},
        "jobs.sqlite3 is not a readable job store",
    ),
    "bench-needs-model": (["bench", "--arms", "reference"], {}, "k6fast bench needs --model and --arms"),
    "bench-geometry": (
        ["bench", "--model", "{tiny}", "--arms", "final", "--geometry", "big"],
        {},
        "expected one of w1",
    ),
    "bench-size": (["bench", "--model", "{tiny}", "--arms", "final", "--geometry", "65x64x9"], {}, "width 65 is not"),
    "bench-model": (["bench", "--model", "{here}/nowhere", "--arms", "final"], {}, "no such directory"),
    "bench-model-not-a-checkpoint": (["bench", "--model", "{here}", "--arms", "final"], {}, "missing file {here}/"),
    "bench-model-truncated": (["bench", "--model", "{truncated}", "--arms", "final"], {}, "truncated safetensors"),
    "bench-arm": (["bench", "--model", "{tiny}", "--arms", "final,nope"], {}, "Unknown arm 'nope'"),
    "bench-arms-twice": (["bench", "--model", "{tiny}", "--arms", "final,final"], {}, "arms must be distinct"),
    "bench-switch": (
        ["bench", "--model", "{tiny}", "--arms", "final", "--set", "K6_GEMM=bogus"],
        {},
        "Unable to use K6_GEMM='bogus'",
    ),
    "bench-switch-unknown": (
        ["bench", "--model", "{tiny}", "--arms", "final", "--set", "K6_GEM=fp8"],
        {},
        "unknown switch 'K6_GEM'; did you mean K6_GEMM?",
    ),
    "bench-device": (["bench", "--model", "{tiny}", "--arms", "final", "--device", "tpu"], {}, "not a device name"),
    "bench-repeats": (["bench", "--model", "{tiny}", "--arms", "final", "--repeats", "0"], {}, "repeats must be >= 1"),
    "bench-report-sessions": (["bench", "report", "--sessions", "{here}/nowhere"], {}, "no such folder"),
    "acceptance-geometry": (["acceptance", "--model", "{tiny}", "--geometry", "big"], {}, "expected one of w1"),
    "acceptance-model": (["acceptance", "--model", "{here}/nowhere"], {}, "no such directory"),
    "acceptance-model-not-a-checkpoint": (["acceptance", "--model", "{here}"], {}, "missing file {here}/model_index"),
    "acceptance-model-component": (["acceptance", "--model", "{broken}"], {}, "missing component folder"),
    "acceptance-arm": (["acceptance", "--model", "{tiny}", "--arms", "final,nope"], {}, "--arms: Unknown arm 'nope'"),
    "acceptance-peer": (["acceptance", "--model", "{tiny}", "--peer", "torch"], {}, "--peer 'torch': expected one of"),
    "acceptance-steps": (["acceptance", "--model", "{tiny}", "--steps", "0"], {}, "--steps: expected an integer >= 1"),
    "acceptance-guidance": (["acceptance", "--model", "{tiny}", "--guidance", "inf"], {}, "--guidance: expected a"),
    "acceptance-seed": (["acceptance", "--model", "{tiny}", "--seed", "-1"], {}, "--seed: expected an integer in"),
    "acceptance-preset": (
        ["acceptance", "--model", "{here}/new", "--make-synthetic", "huge"],
        {},
        "--make-synthetic 'huge': expected one of pro-distill",
    ),
    "acceptance-text-encoder-dir": (
        ["acceptance", "--model", "{here}/new", "--make-synthetic", "pro", "--text-encoder-dir", "{here}/te"],
        {},
        "add --text-encoders full",
    ),
    "acceptance-only": (["acceptance", "--model", "{tiny}", "--only", "nope"], {}, "--only ['nope']: expected run"),
    "acceptance-peer-stop": (
        ["acceptance", "--model", "{tiny}", "--peer-stop-after-steps", "1"],
        {},
        "--peer-stop-after-steps: expected an integer >= 2, found 1",
    ),
    "acceptance-peer-stop-long": (
        ["acceptance", "--model", "{tiny}", "--peer-stop-after-steps", "11"],
        {},
        "--peer-stop-after-steps 11: expected at most the 10 steps the runs take",
    ),
    "doctor-model": (["doctor", "--model", "{here}/nowhere"], {}, "fetch a Hub id first, `hf download ID"),
    "doctor-model-not-a-checkpoint": (["doctor", "--model", "{here}"], {}, "missing file {here}/model_index.json"),
    "doctor-budget": (["doctor", "--budget-gb", "nan"], {}, "--budget-gb: expected a number of GiB >= 0"),
    "doctor-switch": (["doctor"], {"K6_HOST_CACHE_GB": "lots"}, "K6_HOST_CACHE_GB"),
    "quantize-src": (["quantize", "--format", "fp8", "{here}/nowhere", "{out}"], {}, "is not a checkpoint directory"),
    "quantize-src-broken": (["quantize", "--format", "fp8", "{broken}", "{out}"], {}, "missing component folder"),
    "quantize-src-truncated": (["quantize", "--format", "fp8", "{truncated}", "{out}"], {}, "truncated safetensors"),
    "quantize-dst-inside": (["quantize", "--format", "fp8", "{tiny}", "{tiny}/q"], {}, "lies inside SRC"),
    "quantize-dst-busy": (["quantize", "--format", "fp8", "{tiny}", "{foreign}"], {}, "found a non-empty directory"),
    "quantize-df11-src": (["quantize", "--format", "df11", "{here}/nowhere", "{out}"], {}, "is not a checkpoint"),
    "tune-prompts": ([*TUNE, "--prompts", "{here}/no.json"], {}, "--prompts {here}/no.json: no such file"),
    "tune-lpips": ([*TUNE, "--lpips-max", "-1"], {}, "--lpips-max: expected a number > 0"),
    "tune-geometry": (
        [*TUNE, "--geometry", "big"],
        {},
        "--geometry 'big': expected one of w1, smoke or WIDTHxHEIGHTxFRAMES",
    ),
    "tune-arm": ([*TUNE, "--base-arm", "nope"], {}, "Unknown arm 'nope'"),
    "tune-model": ([*TUNE, "--model", "{here}/nowhere"], {}, "no such directory"),
    "tune-model-not-a-checkpoint": ([*TUNE, "--model", "{here}"], {}, "missing file {here}/model_index.json"),
}
# Refused by argparse: its usage lines, then `k6fast COMMAND: error: argument ...`.
USAGE_CASES = {
    "generate-dtype": ([*GEN, "--model", "x", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    "generate-size-text": ([*GEN, "--model", "x", "--size", "big"], "expected WIDTHxHEIGHT such as 864x480"),
    "generate-no-prompt": (["generate", "--model", "x", "--out", "a.mp4"], "the following arguments are required"),
    "serve-no-model": (["serve"], "the following arguments are required: --model"),
    "gate-seeds": (["gate", "--model", "x", "--seeds", "4,4"], "argument --seeds: expected distinct seeds"),
    "bench-order": (["bench", "--model", "x", "--arms", "final", "--order", "AAB"], "argument --order: invalid choice"),
    "acceptance-budgets": (["acceptance", "--model", "x", "--budgets", "0"], "budgets must be > 0 GiB"),
    "quantize-format": (["quantize", "--format", "int4", "a", "b"], "argument --format: invalid choice: 'int4'"),
    "make-synthetic-preset": (["make-synthetic", "s", "--preset", "huge"], "argument --preset: invalid choice"),
    "make-tiny-variant": (["make-tiny", "t", "--variant", "huge"], "argument --variant: invalid choice"),
}


@pytest.fixture(scope="module")
def paths(tiny_distill: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """{tiny}: a tiny checkpoint; {broken}: a copy without its vocoder; {truncated}: a copy with a DiT shard 100 bytes
    short; {text}: a text file named .png; {foreign}: a folder holding a user's file; {corrupt}: a server data
    directory whose job store is not SQLite; {out}: a path outside the tests' working folder that nothing creates."""
    from k6fast.server.datadir import MARKER, MARKER_TEXT

    root = tmp_path_factory.mktemp("cli-errors")
    broken = shutil.copytree(tiny_distill, root / "broken")
    shutil.rmtree(broken / "vocoder")
    truncated = shutil.copytree(tiny_distill, root / "truncated")
    shard = sorted((truncated / "transformer").glob("*.safetensors"))[0]
    os.truncate(shard, shard.stat().st_size - 100)
    (root / "text.png").write_text("not an image\n")
    (root / "foreign").mkdir()
    (root / "foreign" / "mine.txt").write_text("a user's file\n")
    (root / "corrupt").mkdir()
    (root / "corrupt" / MARKER).write_text(MARKER_TEXT)
    (root / "corrupt" / "jobs.sqlite3").write_bytes(b"not a database" * 100)
    folders = {"broken": broken, "truncated": truncated, "foreign": root / "foreign", "corrupt": root / "corrupt"}
    return {"tiny": str(tiny_distill), "text": str(root / "text.png"), "out": str(root / "never-written")} | {
        name: str(path) for name, path in folders.items()
    }


@pytest.mark.parametrize("case", CASES)
def test_every_cli_error_is_one_line_before_any_heavy_import(paths: dict[str, str], tmp_path, case: str) -> None:
    args, env, words = CASES[case]
    # Only a machine without GPU device files can refuse `--device cuda` unseen; where there are some, PyTorch counts
    # the GPUs, so the case asks for one past the last and may import it (only it).
    counts_gpus = case == "generate-cuda-without-gpu" and not no_gpu_device_files()
    if counts_gpus:
        args = [*args[:-1], "cuda:4096"]
        words = "--device cuda:4096: this machine has"
    assert_refused(args, env, words, tmp_path, paths, may_import={"torch"} if counts_gpus else ())
    assert not Path(paths["out"]).exists()


@pytest.mark.parametrize("case", USAGE_CASES)
def test_every_usage_error_is_refused_by_argparse_before_any_heavy_import(tmp_path, case: str) -> None:
    args, words = USAGE_CASES[case]
    done, stderr, heavy = run_cli(args, tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert stderr[0].startswith("usage: k6fast") and stderr[-1].startswith(f"k6fast {args[0]}: error: "), stderr
    assert words in stderr[-1], stderr
    assert heavy == [], f"{case} imported {heavy[:5]} before refusing"
    assert list(tmp_path.iterdir()) == []
    assert done.cpu_s < CPU_BOUND_S, f"{case} used {done.cpu_s:.2f} s of processor time to refuse"
    assert done.wall_s < WALL_BOUND_S, f"{case} took {done.wall_s:.1f} s to refuse"


def test_serve_on_a_taken_port_is_one_line_before_any_heavy_import(tiny_distill: Path, tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["serve", "--model", str(tiny_distill), "--device", "cpu", "--port", str(port)]
        done, stderr, heavy = run_cli([*args, "--data-dir", str(tmp_path / "data")], tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert stderr == [f"error: cannot listen on 127.0.0.1:{port} (Address already in use); expected a free port"]
    assert heavy == []
    assert done.cpu_s < CPU_BOUND_S and done.wall_s < WALL_BOUND_S


def test_unknown_switch_is_one_warning_line_in_the_server_entry_point(tmp_path) -> None:
    done, stderr, heavy = run_cli(
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
