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
    too_big = _serve("--model", str(tmp_path), "--default-size", "1920x1080")
    assert too_big.returncode == 2 and "default size 1920x1080 exceeds the maximum 1280x720" in too_big.stderr
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
