"""The DiT's load on a thread of its own (`k6fast.dit_load.DiTAhead`), as `k6fast generate` starts it beside the
library imports, against the build a pipeline makes itself: the same arguments (the text phase's footprint from the
files equal to the text phase's own), the same runtime and outputs, the same fallback to the smallest request's
residency, the same errors raised in the caller's thread, and no thread left running when the command fails; with
K6_DIT_AHEAD=off the command builds the DiT in the pipeline's load instead, to the same clip.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback

import numpy as np
import pytest
import torch
from pipeline_testing import rounding_bound, rounding_depth
from safetensors.numpy import load_file, save_file

import k6fast.dit_load
from k6fast.checkpoint import open_checkpoint
from k6fast.cli import CliError, main
from k6fast.dit_load import DiTAhead, text_device_bytes
from k6fast.media import read_mp4
from k6fast.output import generate_to_mp4
from k6fast.pipeline import Pipeline, Request
from k6fast.request import SPATIAL_MULTIPLE, dit_tokens
from k6fast.stream.plan import ResidencyError
from k6fast.switches import SWITCHES, Options, load_options
from k6fast.text_phase import TextPhase
from k6fast.vae_geometry import audio_rate

CPU = torch.device("cpu")
GEOMETRY = (32, 32, 9)
GEN = ["generate", "--prompt", "A fox runs through snow", "--size", "32x32", "--frames", "9", "--steps", "2",
       "--prompt-cache", "none"]  # fmt: skip
REQUEST = Request(prompt="A fox runs through snow", width=32, height=32, frames=9, steps=2, seed=42)


def threads_left() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name in ("k6-dit-load", "k6-text-ahead")]


@pytest.fixture
def no_switches(monkeypatch) -> None:
    for switch in SWITCHES:
        monkeypatch.delenv(switch.name, raising=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("variant", ["distill", "base"])
def test_the_text_footprint_from_the_files_is_the_text_phases_own(tiny_checkpoints, variant, dtype) -> None:
    root = tiny_checkpoints[variant]
    phase = TextPhase(root, CPU, dtype)
    try:
        assert text_device_bytes(root, dtype) == phase.device_bytes() > 0
    finally:
        phase.close()


def test_a_dtype_the_text_phase_refuses_is_refused_with_its_message(tiny_distill) -> None:
    with pytest.raises(ValueError) as from_files:
        text_device_bytes(tiny_distill, torch.float64)
    with pytest.raises(ValueError) as from_phase:
        TextPhase(tiny_distill, CPU, torch.float64)
    assert str(from_files.value) == str(from_phase.value)


def test_the_dit_load_imports_neither_library_and_its_thread_imports_nothing(tiny_distill) -> None:
    # Two threads importing one package's modules in different orders deadlock: the thread beside the library
    # imports must import nothing (with K6_COMPILE too: Dynamo's import is left to the caller's thread).
    code = (
        "import sys; import k6fast.dit_load as d; from k6fast.checkpoint import open_checkpoint; "
        "from k6fast.switches import Options\n"
        "libraries = [m for m in sys.modules if m.split('.')[0] in ('diffusers', 'transformers')]\n"
        "ckpt = open_checkpoint(sys.argv[1]); imported = []\n"
        "for options in (Options(), Options(compile=True)):\n"
        "    before = set(sys.modules); d.DiTAhead(ckpt, options, 'cpu', None, (32, 32, 9)).close()\n"
        "    imported += sorted(set(sys.modules) - before)\n"
        "print(libraries, imported)"
    )  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code, str(tiny_distill)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[-2] == "[] []", done.stdout


def test_a_pipeline_given_the_dit_ahead_builds_what_it_would_have_built(tiny_distill, no_switches) -> None:
    options = load_options()
    ckpt = open_checkpoint(tiny_distill)
    itself = Pipeline(ckpt, options, device="cpu", plan_geometry=GEOMETRY)
    ahead = DiTAhead(ckpt, options, "cpu", None, GEOMETRY)
    given = Pipeline(ckpt, options, device="cpu", plan_geometry=GEOMETRY, dit_ahead=ahead)
    try:
        assert given.runtime.plan == itself.runtime.plan and given.budget_bytes == itself.budget_bytes
        assert given.runtime.plan.text_bytes == itself.text.device_bytes()
        mine, theirs = given.dit, itself.dit
        assert mine.weights.keys() == theirs.weights.keys()
        assert all(torch.equal(mine.weights[k], theirs.weights[k]) for k in mine.weights)
        assert mine.blocks.resident.keys() == theirs.blocks.resident.keys()
        for b, block in mine.blocks.resident.items():
            assert all(torch.equal(t, theirs.blocks.resident[b][k]) for k, t in block.items())
        assert {"plan", "resident_upload", "staging", "dit_build"} <= given.load_parts.keys()
        dit_s = sum(given.runtime.load_s.values())
        assert 0.0 <= given.load_overlapped_s <= dit_s and itself.load_overlapped_s == 0.0
        # The load's own seconds: the DiT's build included, however much of it ran before the pipeline.
        assert given.load_seconds >= dit_s + given.load_parts["decoders"]
        assert threads_left() == []
    finally:
        given.close()
        itself.close()


def test_a_dit_ahead_for_other_arguments_is_refused_and_closed(tiny_distill) -> None:
    ckpt = open_checkpoint(tiny_distill)
    ahead = DiTAhead(ckpt, Options(), "cpu", None, GEOMETRY)
    with pytest.raises(ValueError, match="dit_ahead was started for another"):
        Pipeline(ckpt, Options(), device="cpu", plan_geometry=(64, 64, 9), dit_ahead=ahead)
    assert threads_left() == []


def test_the_command_makes_the_clip_a_pipeline_building_its_own_dit_makes(tiny_distill, tmp_path, no_switches) -> None:
    """The command (its DiT built beside its imports) against the sequential load, as `generate` loaded before: the
    same latents to within float rounding (bit for bit on one thread) and, from equal latents, the same MP4."""
    ahead_out, own_out = tmp_path / "ahead.mp4", tmp_path / "own.mp4"
    latents = tmp_path / "ahead.safetensors"
    assert main([*GEN, "--model", str(tiny_distill), "--out", str(ahead_out), "--save-latents", str(latents)]) == 0
    pipe = Pipeline(tiny_distill, load_options(), device="cpu", plan_geometry=GEOMETRY)
    try:
        result, depth = rounding_depth(lambda: generate_to_mp4(pipe, REQUEST, own_out, str(tiny_distill)))
    finally:
        pipe.close()
    save_file({k: v.contiguous().numpy() for k, v in result.latents.items()}, str(tmp_path / "own.safetensors"))
    ahead, own = load_file(latents), load_file(tmp_path / "own.safetensors")
    assert ahead.keys() == own.keys() == {"video", "audio"}
    moved = {k: float(np.abs(ahead[k].astype(np.float64) - own[k]).max()) for k in own}
    for name, latent in own.items():
        assert moved[name] <= rounding_bound(depth, float(np.abs(latent).max())), (name, moved[name])
    if not any(moved.values()):
        assert ahead_out.read_bytes() == own_out.read_bytes()
    sidecar = json.loads(ahead_out.with_name("ahead.mp4.json").read_text())
    assert sidecar["process"]["load_overlapped_s"] >= 0.0 and "dit_start" in sidecar["process"]["startup_s"]


def test_k6_dit_ahead_off_builds_the_dit_after_the_imports_and_makes_the_same_clip(
    tiny_distill, tmp_path, monkeypatch, capsys, no_switches
) -> None:
    """K6_DIT_AHEAD=off, the A/B of the overlap: the DiT is built in the pipeline's load, none of it beside the imports,
    the profile has the same parts, and the clip is the default's: the same latents and, decoded, the same frames and
    sound bit for bit (the MP4s differ only in the switch snapshot they carry)."""

    def run(name: str) -> tuple[dict, dict, tuple]:
        out, latents = tmp_path / f"{name}.mp4", tmp_path / f"{name}.safetensors"
        assert main([*GEN, "--model", str(tiny_distill), "--out", str(out), "--save-latents", str(latents)]) == 0
        return json.loads(out.with_name(f"{name}.mp4.json").read_text()), load_file(latents), read_mp4(out)

    on, on_latents, on_media = run("on")
    monkeypatch.setenv("K6_DIT_AHEAD", "off")
    off, off_latents, off_media = run("off")
    assert on["process"]["load_overlapped_s"] > 0.0 and off["process"]["load_overlapped_s"] == 0.0
    assert list(on["process"]["startup_s"]) == list(off["process"]["startup_s"])
    assert [side["provenance"]["switches"]["K6_DIT_AHEAD"] for side in (on, off)] == ["on", "off"]
    assert on["provenance"]["arm_hash"] == off["provenance"]["arm_hash"]  # it cannot change the output
    assert on_latents.keys() == off_latents.keys() == {"video", "audio"}
    assert all(np.array_equal(on_latents[k], off_latents[k]) for k in on_latents)
    assert np.array_equal(on_media[0], off_media[0]) and np.array_equal(on_media[1], off_media[1])
    assert threads_left() == []
    capsys.readouterr()
    monkeypatch.setenv("K6_DIT_AHEAD", "maybe")
    assert main([*GEN, "--model", str(tiny_distill), "--out", str(tmp_path / "x.mp4")]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == "error: Unable to use K6_DIT_AHEAD='maybe': expected one of on, off"


def refuse_build(*args, **kwargs):
    raise ValueError("tensor x: expected a shape the build can take")


def test_a_failed_build_is_raised_in_the_callers_thread_as_the_pipelines_own_build_raises_it(
    tiny_distill, monkeypatch
) -> None:
    monkeypatch.setattr(k6fast.dit_load, "build_dit", refuse_build)
    ckpt = open_checkpoint(tiny_distill)
    with pytest.raises(ValueError) as itself:
        Pipeline(ckpt, Options(), device="cpu", plan_geometry=GEOMETRY)
    ahead = DiTAhead(ckpt, Options(), "cpu", None, GEOMETRY)
    with pytest.raises(ValueError) as given:
        Pipeline(ckpt, Options(), device="cpu", plan_geometry=GEOMETRY, dit_ahead=ahead, first_request=REQUEST)
    assert str(given.value) == str(itself.value)
    frames = [frame.name for frame in traceback.extract_tb(given.value.__traceback__)]
    assert "refuse_build" in frames and "take" in frames  # the thread's own frames, then where it was taken
    assert threads_left() == []  # neither the build's thread nor the prompt's encode runs on


def test_the_fallback_to_the_smallest_request_is_the_same_and_holds_for_reloads(
    tiny_distill, monkeypatch, caplog
) -> None:
    real = k6fast.dit_load.build_dit
    ckpt = open_checkpoint(tiny_distill)
    smallest = dit_tokens(SPATIAL_MULTIPLE, SPATIAL_MULTIPLE, 1, audio_rate(ckpt.root))

    def run(ahead: bool) -> list[tuple[int, int]]:
        asked = []

        def build(*args, tokens, **kwargs):
            asked.append(tokens)
            if len(asked) == 1:
                raise ResidencyError("the geometry does not fit")
            return real(*args, tokens=tokens, **kwargs)

        monkeypatch.setattr(k6fast.dit_load, "build_dit", build)
        start = DiTAhead(ckpt, Options(), "cpu", None, GEOMETRY) if ahead else None
        pipe = Pipeline(ckpt, Options(), device="cpu", plan_geometry=GEOMETRY, dit_ahead=start)
        try:
            pipe.drop_dit()
            pipe.generate(REQUEST)  # reloads the DiT, planned as the fallback left it
        finally:
            pipe.close()
        return asked

    with caplog.at_level(logging.WARNING, logger="k6fast.dit_load"):
        own, ahead = run(False), run(True)
    assert own == ahead == [dit_tokens(*GEOMETRY, audio_rate(ckpt.root)), smallest, smallest]
    warned = [r.getMessage() for r in caplog.records if "smallest request" in r.getMessage()]
    assert warned == ["the geometry does not fit; planning residency for the smallest request instead"] * 2


def test_a_build_that_fits_nowhere_is_the_commands_one_error_line(tiny_distill, tmp_path, monkeypatch, capsys) -> None:
    def never(*args, **kwargs):
        raise ResidencyError("not even one block fits")

    monkeypatch.setattr(k6fast.dit_load, "build_dit", never)
    assert main([*GEN, "--model", str(tiny_distill), "--out", str(tmp_path / "x.mp4")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: not even one block fits"
    assert threads_left() == [] and not (tmp_path / "x.mp4").exists()


def test_an_error_while_the_dit_loads_waits_for_it_and_frees_it(tiny_distill, tmp_path, monkeypatch, capsys) -> None:
    real, seen = k6fast.dit_load.build_dit, {}

    def slow(*args, **kwargs):
        time.sleep(0.5)  # still loading when the command fails
        runtime = real(*args, **kwargs)
        close = runtime.close
        runtime.close = lambda: (seen.setdefault("closed", True), close())
        seen["built"] = True
        return runtime

    def refuse(args, options):
        raise CliError("--prompt-cache: refused")

    monkeypatch.setattr(k6fast.dit_load, "build_dit", slow)
    monkeypatch.setattr(k6fast.cli, "prompt_cache_dir", refuse)
    assert main([*GEN, "--model", str(tiny_distill), "--out", str(tmp_path / "x.mp4")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: --prompt-cache: refused"
    assert seen == {"built": True, "closed": True} and threads_left() == []


def test_the_process_ends_on_an_error_raised_while_its_dit_loads(tiny_distill, tmp_path) -> None:
    """A checkpoint whose text encoder does not match its config fails in the text phase's set-up, after the DiT's
    build started: one error line, status 2, and the process ends."""
    root = tmp_path / "ckpt"
    shutil.copytree(tiny_distill, root)
    config_path = root / "text_encoder" / "config.json"
    config = json.loads(config_path.read_text())
    config["text_config"]["intermediate_size"] += 8
    config_path.write_text(json.dumps(config))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("K6_")}
    done = subprocess.run([sys.executable, "-m", "k6fast.cli", *GEN, "--model", str(root), "--out",
                           str(tmp_path / "x.mp4")], capture_output=True, text=True, env=environ,
                          timeout=300)  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "the config implies" in lines[-1], lines
    assert "Traceback" not in done.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_the_thread_imports_nothing_while_a_df11_decode_kernel_compiles(tiny_bf16, tmp_path) -> None:
    # On a GPU a DF11 checkpoint's blobs are decoded by a Triton kernel inside the build: with an empty Triton cache
    # its first compile runs in the thread, and whatever Triton imports for it must have been imported before.
    from k6fast.df11_checkpoint import compress_checkpoint

    compressed = tmp_path / "df11"
    compress_checkpoint(tiny_bf16, compressed, min_elements=1, log=lambda line: None)
    code = (
        "import sys; import k6fast.dit_load as d; from k6fast.checkpoint import open_checkpoint; "
        "from k6fast.switches import Options\n"
        "ckpt = open_checkpoint(sys.argv[1]); assert ckpt.compression == 'df11'\n"
        "ahead = d.DiTAhead(ckpt, Options(), 'cuda', None, (32, 32, 9))\n"
        "started = set(sys.modules); runtime, _ = ahead.take(); runtime.close()\n"
        "for name in sorted(set(sys.modules) - started): print(name, getattr(sys.modules[name], '__file__', None))\n"
        "print('end')"
    )  # fmt: skip
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    # cwd: the installed k6fast, not the source tree's.
    done = subprocess.run([sys.executable, "-c", code, str(compressed)], capture_output=True, text=True, timeout=300,
                          env=env, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-1] == "end", done.stdout
    # Triton loads each compiled launcher (and its driver's utilities) from its cache by path, not through `import`:
    # those are the kernel's own artefacts. Any other new module is a library import the thread made.
    cache = str(tmp_path / "triton")
    imported = [line for line in lines[:-1] if not line.split(" ", 1)[1].startswith(cache)]
    assert imported == [], done.stdout
    assert any(p.suffix == ".json" for p in (tmp_path / "triton").rglob("*")), "no kernel was compiled"
