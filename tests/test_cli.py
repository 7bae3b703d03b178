"""The command line end to end on the tiny checkpoint: make-tiny, generate (MP4 + sidecar), switches, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from pipeline_testing import rounding_bound, rounding_depth

from k6fast.cli import main
from k6fast.media import probe_mp4
from k6fast.switches import SWITCHES, check_readme

ROOT = Path(__file__).resolve().parents[1]
GEN = ["generate", "--prompt", "A cat purrs on a windowsill", "--size", "32x32", "--frames", "9", "--steps", "3"]


def test_readme_switch_table_is_current() -> None:
    problem = check_readme((ROOT / "README.md").read_text())
    assert problem is None, f"{problem}\nregenerate it with: k6fast switches --markdown"


def test_generate_writes_a_playable_clip_with_provenance(tiny_distill, tmp_path, capsys) -> None:
    out = tmp_path / "clip.mp4"
    assert main([*GEN, "--model", str(tiny_distill), "--out", str(out)]) == 0
    info = probe_mp4(out)
    assert (info.video_codec, info.pix_fmt, info.frame_count) == ("h264", "yuv420p", 9)
    assert info.audio_codec == "aac" and info.audio_channels == 1 and info.audio_sample_rate == 44100
    sidecar = json.loads((tmp_path / "clip.mp4.json").read_text())
    assert sidecar["provenance"]["arm_hash"] == info.metadata["k6fast_arm_hash"]
    assert json.loads(info.metadata["k6fast_switches"]) == sidecar["provenance"]["switches"]
    assert sidecar["request"]["steps"] == 3 and sidecar["telemetry"]["dit_calls"] == 3
    err = capsys.readouterr().err
    for phase in ("text_encode", "denoise", "video_decode", "audio_decode", "mux"):
        assert phase in err
    # On the CPU there is no GPU memory budget to plan against: no residency plan, no decode peak estimate.
    gib_lines = [line for line in err.splitlines() if "GiB" in line]
    assert "budget" not in err and "estimated peak" not in err and gib_lines == [gib_lines[-1]], gib_lines
    assert gib_lines[-1].startswith("peak host RSS: ")


def test_reference_arm_equals_every_switch_explicitly_off(tiny_distill, tmp_path, monkeypatch) -> None:
    """`--arm reference` and every output-affecting switch set to its default in the environment are one
    configuration, so they make one clip: latents equal to within float rounding (`pipeline_testing`; bit for bit
    where the runs are deterministic, as they are on one thread) and, from equal latents, the same file byte for
    byte."""
    a, b = tmp_path / "arm.mp4", tmp_path / "env.mp4"

    def argv(out: Path) -> list[str]:
        latents = out.with_suffix(".safetensors")
        return [*GEN, "--model", str(tiny_distill), "--out", str(out), "--save-latents", str(latents)]

    for switch in SWITCHES:
        monkeypatch.delenv(switch.name, raising=False)
    status, depth = rounding_depth(lambda: main([*argv(a), "--arm", "reference"]))
    assert status == 0
    for switch in SWITCHES:
        if switch.affects_output:
            monkeypatch.setenv(switch.name, switch.format(switch.default))
    assert main(argv(b)) == 0
    arm_side, env_side = (json.loads(p.with_name(p.name + ".json").read_text()) for p in (a, b))
    assert arm_side["provenance"]["arm"] == "reference"
    assert arm_side["provenance"]["arm_hash"] == env_side["provenance"]["arm_hash"]
    assert arm_side["provenance"]["switches"] == env_side["provenance"]["switches"]
    assert probe_mp4(a).metadata == probe_mp4(b).metadata
    from safetensors.numpy import load_file

    arm_latents, env_latents = load_file(a.with_suffix(".safetensors")), load_file(b.with_suffix(".safetensors"))
    assert arm_latents.keys() == env_latents.keys() == {"video", "audio"}
    moved = {k: float(np.abs(arm_latents[k].astype(np.float64) - env_latents[k]).max()) for k in arm_latents}
    for name, latent in arm_latents.items():
        bound = rounding_bound(depth, float(np.abs(latent).max()))
        assert moved[name] <= bound, f"{name} latents moved by {moved[name]:.3g}, more than rounding ({bound:.3g})"
    if not any(moved.values()):  # the decode and the mux are deterministic: equal latents, equal files
        assert a.read_bytes() == b.read_bytes()


def test_a_model_command_is_quiet_but_for_one_line_per_unknown_switch(tiny_distill, tmp_path) -> None:
    """No third-party deprecation or import warnings from a real run (torchao's "Unable to import `torchao` Tensor
    objects", torch's pytree deprecation), and a mistyped switch is one line naming the switch it resembles."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("K6_") and k != "TRANSFORMERS_VERBOSITY"}
    env["K6_GEM"] = "fp8"
    out = tmp_path / "clip.mp4"
    done = subprocess.run(
        [sys.executable, "-m", "k6fast.cli", *GEN, "--model", str(tiny_distill), "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert [line for line in lines if "K6_GEM" in line] == [
        "warning: Unknown switch K6_GEM is ignored; did you mean K6_GEMM?"
    ]
    noise = [line for line in lines if "torchao" in line or "deprecat" in line.lower() or "Warning" in line]
    assert noise == [], noise
    assert out.is_file()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--size", "100x64"], "width 100 is not a positive multiple of 16 (nearest valid: 96 or 112)"),
        (["--frames", "10"], "frame count 10 is not of the form 4k+1 (nearest valid: 9 or 13)"),
        (["--guidance", "3.0"], "guidance must be exactly 1.0"),
        (["--out", "clip.avi"], "expected a path ending in .mp4"),
    ],
)
def test_bad_input_is_refused_clearly(tiny_distill, tmp_path, capsys, args, message) -> None:
    argv = [*GEN, "--model", str(tiny_distill), "--out", str(tmp_path / "x.mp4"), *args]
    if args[0] == "--out":
        argv = [*GEN, "--model", str(tiny_distill), "--out", str(tmp_path / args[1])]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.glob("*.mp4"))


def test_missing_checkpoint_component_names_the_folder(tiny_distill, tmp_path, capsys) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_distill, broken)
    shutil.rmtree(broken / "vocoder")
    assert main([*GEN, "--model", str(broken), "--out", str(tmp_path / "x.mp4")]) == 2
    assert "vocoder" in capsys.readouterr().err


def test_invalid_switch_value_stops_start_up(tiny_distill, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("K6_PIFLOW_CACHE_STEPS", "abc")
    assert main([*GEN, "--model", str(tiny_distill), "--out", str(tmp_path / "x.mp4")]) == 2
    assert "K6_PIFLOW_CACHE_STEPS" in capsys.readouterr().err


def test_switches_command_lists_every_switch(capsys) -> None:
    assert main(["switches"]) == 0
    out = capsys.readouterr().out
    assert all(s.name in out for s in SWITCHES)


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if a model starts loading: these checks must all come first."""
    import k6fast.pipeline

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(k6fast.pipeline.Pipeline, "__init__", refuse)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--seed", "99999999999999999999999"], "--seed: expected an integer in [0, 9223372036854775807], found 9999"),
        (["--seed", "-1"], "--seed: expected an integer in [0, 9223372036854775807], found -1"),
        (["--steps", "0"], "--steps: expected an integer >= 1, found 0"),
        (["--guidance", "nan"], "--guidance: expected a finite number >= 1.0 (1.0 = no CFG), found nan"),
        (["--guidance", "0.5"], "--guidance: expected a finite number >= 1.0"),
        (["--device", "tpu"], "--device tpu: not a device name; expected cpu, cuda or cuda:N"),
        (["--prompt", "  "], "--prompt is empty"),
        (["--image", "/nonexistent/ref.png"], "--image /nonexistent/ref.png: No such file or directory"),
    ],
)
def test_arguments_are_checked_before_the_model_loads(
    no_model_load, tiny_distill, tmp_path, capsys, args, message
) -> None:
    argv = [*GEN, "--model", str(tiny_distill), "--out", str(tmp_path / "x.mp4"), *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_out_must_be_a_writable_file_path(no_model_load, tmp_path, capsys) -> None:
    folder = tmp_path / "clip.mp4"
    folder.mkdir()
    assert main([*GEN, "--model", str(tmp_path), "--out", str(folder)]) == 2
    assert f"--out {folder}: is a directory; expected a file path ending in .mp4" in capsys.readouterr().err
    missing = tmp_path / "nowhere" / "clip.mp4"
    assert main([*GEN, "--model", str(tmp_path), "--out", str(missing)]) == 2
    assert f"the directory {missing.parent} does not exist" in capsys.readouterr().err


def test_out_in_a_read_only_directory_is_refused(no_model_load, tmp_path, capsys, monkeypatch) -> None:
    import os

    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    # Root may write anywhere (CI runs as root): the directory's permission bits are what os.access reports for any
    # other user, so the check is asked as that user would be answered.
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if Path(path) == locked else access(path, mode))
    assert main([*GEN, "--model", str(tmp_path), "--out", str(locked / "clip.mp4")]) == 2
    assert f"the directory {locked} is not writable by this user" in capsys.readouterr().err


def test_cuda_without_a_gpu_is_refused_before_loading(
    no_model_load, tiny_distill, tmp_path, capsys, monkeypatch
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on a GPU machine
    assert main([*GEN, "--model", str(tiny_distill), "--out", str(tmp_path / "x.mp4"), "--device", "cuda"]) == 2
    assert "--device cuda: no CUDA GPU is available on this machine" in capsys.readouterr().err


def test_a_repeated_prompt_comes_from_the_prompt_cache_in_a_later_run(tiny_distill, tmp_path) -> None:
    def run(name: str, *extra: str) -> dict:
        out = tmp_path / f"{name}.mp4"
        assert main([*GEN, "--model", str(tiny_distill), "--out", str(out), *extra]) == 0
        return json.loads((tmp_path / f"{name}.mp4.json").read_text())["telemetry"]

    cache = tmp_path / "prompts"
    first, second = run("a", "--prompt-cache", str(cache)), run("b", "--prompt-cache", str(cache))
    assert first["text_source"] == "encoded" and first["text_bytes_streamed"] > 0
    assert first["text_ahead_s"] > 0  # generate encodes its prompt beside the load
    assert second["text_source"] == "disk" and second["text_bytes_streamed"] == 0
    assert run("c", "--prompt-cache", "none")["text_source"] == "encoded"
    assert (tmp_path / "a.mp4").read_bytes() == (tmp_path / "b.mp4").read_bytes()


def test_generate_replaces_an_existing_clip_only_when_told(tiny_distill, tmp_path, capsys) -> None:
    out = tmp_path / "p.mp4"
    out.write_text("precious")
    sidecar = tmp_path / "p.mp4.json"
    argv = ["generate", "--model", str(tiny_distill), "--prompt", "a fox", "--size", "32x32", "--frames", "5",
            "--steps", "2", "--no-audio", "--out", str(out)]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "already exist" in err and "--overwrite" in err
    assert out.read_text() == "precious" and not sidecar.exists()  # nothing written, nothing replaced
    out.unlink()
    sidecar.write_text("{}")  # a sidecar alone is the user's file too
    assert main(argv) == 2 and sidecar.read_text() == "{}"
    assert main([*argv, "--overwrite"]) == 0
    assert probe_mp4(out).frame_count == 5 and json.loads(sidecar.read_text())["request"]["prompt"] == "a fox"
