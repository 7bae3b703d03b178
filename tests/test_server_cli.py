"""`k6fast serve` start-up checks: every user error fails at once with exit status 2, before any model loads."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from k6fast.server.cli import cmd_serve, config_from_args, register
from k6fast.server.jobs import DataDirLock

TIMEOUT_S = 60  # a check that failed to fail would start a server; the timeout ends it


def _serve(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("K6_")}
    return subprocess.run(
        [sys.executable, "-m", "k6fast.server", *args], capture_output=True, text=True, timeout=TIMEOUT_S, env=env
    )


def test_register_adds_serve_with_its_defaults(tiny_distill: Path, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--model", str(tiny_distill), "--ttl-hours", "0.5", "--max-size", "864x480"])
    assert args.func is cmd_serve
    config = config_from_args(args, data_dir_default=tmp_path / "from-switch")
    assert (config.host, config.port, config.served_model_name) == ("127.0.0.1", 8094, tiny_distill.name)
    assert config.data_dir == tmp_path / "from-switch" and config.ttl_seconds == 1800.0
    assert config.max_size == (864, 480) and config.max_upload_bytes == 20 * 2**20
    explicit = parser.parse_args(["serve", "--model", "org/name", "--data-dir", str(tmp_path / "d")])
    assert config_from_args(explicit, tmp_path).data_dir == tmp_path / "d"
    assert config_from_args(explicit, tmp_path).served_model_name == "org/name"


def test_bad_model_and_settings_fail_before_anything_starts(tmp_path: Path) -> None:
    missing = _serve("--model", str(tmp_path / "nowhere"), "--data-dir", str(tmp_path / "d"))
    assert missing.returncode == 2 and "no such directory" in missing.stderr
    assert not (tmp_path / "d").exists()
    not_a_checkpoint = _serve("--model", str(tmp_path), "--data-dir", str(tmp_path / "d"))
    assert not_a_checkpoint.returncode == 2 and "model_index.json" in not_a_checkpoint.stderr
    too_big = _serve("--model", str(tmp_path), "--default-size", "1920x1088", "--max-size", "1280x720")
    assert too_big.returncode == 2 and "default size 1920x1088 exceeds the maximum 1280x720" in too_big.stderr
    bad_seconds = _serve("--model", str(tmp_path), "--default-seconds", "0.3")
    assert bad_seconds.returncode == 2 and "4k+1" in bad_seconds.stderr


def test_busy_data_dir_and_taken_port_fail_with_status_2(tiny_distill: Path, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    lock = DataDirLock(data_dir)
    lock.acquire()
    try:
        busy = _serve("--model", str(tiny_distill), "--data-dir", str(data_dir), "--port", "0")
    finally:
        lock.release()
    assert busy.returncode == 2 and "in use by another k6fast server" in busy.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = _serve("--model", str(tiny_distill), "--data-dir", str(data_dir), "--port", port)
    assert result.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in result.stderr


@pytest.mark.parametrize("size", ["64", "64x", "axb"])
def test_size_arguments_say_what_they_expect(size: str, tmp_path: Path) -> None:
    result = _serve("--model", str(tmp_path), "--max-size", size)
    assert result.returncode == 2 and "expected WIDTHxHEIGHT" in result.stderr


def test_geometry_rules_agree_with_the_pipeline() -> None:
    from k6fast import request
    from k6fast.server import config

    for size in ((64, 64), (65, 64), (0, 16), (16, -16), (1280, 720), (1920, 1080)):
        try:
            request.validate_geometry(*size, 1)
            valid = True
        except request.RequestError:
            valid = False
        assert (config.size_problem(size) is None) == valid, size


GOOD = dict(model="m", served_model_name="m", data_dir=Path("d"))


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"default_size": (65, 64)}, "default_size 65x64: width 65 is not a positive multiple of 16"),
        ({"max_size": (1280, 700)}, "max_size 1280x700: height 700 is not a positive multiple of 16"),
        ({"default_size": (1280, 1280)}, "the default size 1280x1280 exceeds the maximum 1280x720"),
        ({"default_seconds": "0.3"}, "default_seconds: seconds '0.3' does not map to a valid frame count"),
        ({"default_seconds": "abc"}, "default_seconds: seconds must be a positive number"),
        ({"default_seconds": "20"}, "default_seconds 20 gives 481 frames, over max_frames 241"),
        (
            {"max_frames": 100},
            "max_frames must be a frame count of the form 4k+1, found 100 (nearest valid: 97 or 101)",
        ),
        ({"max_queue": 0}, "max_queue must be an integer >= 1, found 0"),
        ({"max_steps": True}, "max_steps must be an integer >= 1, found True"),
        ({"max_upload_bytes": -1}, "max_upload_bytes must be an integer >= 1"),
        ({"poll_after_ms": 0}, "poll_after_ms must be an integer >= 1"),
        ({"max_attempts": 0}, "max_attempts must be an integer >= 1"),
        ({"ttl_seconds": float("inf")}, "ttl_seconds must be a number of seconds in (0,"),
        ({"ttl_seconds": float("nan")}, "ttl_seconds must be a number of seconds in (0,"),
        ({"reap_interval_s": 0.0}, "reap_interval_s must be a number of seconds in (0,"),
        ({"body_timeout_s": -1.0}, "body_timeout_s must be a number of seconds in (0,"),
        ({"port": 70000}, "port must be in [0, 65535], found 70000"),
        ({"host": ""}, "host must be a non-empty printable string"),
        ({"served_model_name": "a\nb"}, "served_model_name must be a non-empty printable string"),
        ({"dtype": "int8"}, "dtype must be bf16, fp16 or fp32, found 'int8'"),
    ],
)
def test_every_setting_is_checked(changes: dict, words: str) -> None:
    from k6fast.server.config import ServerConfig

    with pytest.raises(ValueError, match="invalid server settings") as info:
        ServerConfig(**{**GOOD, **changes})
    assert words in str(info.value)


def _main(*args: str) -> int:
    from k6fast.server.cli import main

    return main(list(args))


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--default-size", "65x64"], "default_size 65x64: width 65 is not a positive multiple of 16"),
        (["--max-upload-mb", "inf"], "--max-upload-mb must be a number in (0, 1024], found inf"),
        (["--max-upload-mb", "nan"], "--max-upload-mb must be a number in (0, 1024], found nan"),
        (["--ttl-hours", "nan"], "--ttl-hours must be a positive number, found nan"),
        (["--body-timeout-s", "0"], "body_timeout_s must be a number of seconds in (0,"),
        (["--served-model-name", " "], "--served-model-name must not be empty"),
        (["--device", "tpu"], "--device tpu: not a device name; expected cpu, cuda or cuda:N"),
        (["--device", "meta"], "--device meta: meta devices are not supported"),
    ],
)
def test_bad_options_give_one_line_and_status_2(args, words, tmp_path: Path, capsys) -> None:
    assert _main("--model", str(tmp_path), "--data-dir", str(tmp_path / "d"), *args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "d").exists(), "nothing is created for a refused start"


def test_cuda_without_a_gpu_is_refused_at_start(tmp_path: Path, capsys, monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on a GPU machine
    assert _main("--model", str(tmp_path), "--device", "cuda") == 2
    assert "--device cuda: no CUDA GPU is available on this machine" in capsys.readouterr().err


def test_a_data_dir_that_cannot_be_made_is_refused(tiny_distill: Path, tmp_path: Path, capsys) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert _main("--model", str(tiny_distill), "--data-dir", str(blocker / "data"), "--port", "0") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot use the data directory {blocker / 'data'}") and "Traceback" not in err
