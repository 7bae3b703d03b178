"""measurements/bench_stream_copy.py on the CPU: the staged file copy puts every byte in its place (mmap and pread,
several slots with a short last one), percentiles are right, and without CUDA the benchmark refuses clearly."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "measurements" / "bench_stream_copy.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_stream_copy", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("use_mmap", [True, False], ids=["mmap", "pread"])
def test_staged_copy_moves_every_byte(bench, tmp_path, use_mmap) -> None:
    nbytes = 5 * bench.MIB + 12345  # not a multiple of the slot: the last slot is short
    path = bench.write_test_file(tmp_path, nbytes)
    offset, size = bench.safetensors_payload(path)
    assert size == nbytes and offset > 8
    ring = bench.StagingRing(2 * bench.MIB, torch.device("cpu"))
    dst = torch.zeros(size, dtype=torch.uint8)
    ring.copy_file(path, dst, offset, size, use_mmap)
    expected = np.fromfile(path, dtype=np.uint8, count=size, offset=offset)
    assert np.array_equal(dst.numpy(), expected)
    # The content varies chunk to chunk, so a chunk copied to the wrong offset cannot pass the check above.
    first, second = expected[: bench.MIB], expected[bench.MIB : 2 * bench.MIB]
    assert not np.array_equal(first, second)


def test_file_variant_reports_bandwidth(bench, tmp_path) -> None:
    path = bench.write_test_file(tmp_path, 3 * bench.MIB)
    result = bench.bench_file(path, True, 3, bench.StagingRing(bench.MIB, torch.device("cpu")))
    assert result["variant"] == "mmap_staged" and result["bytes"] == 3 * bench.MIB
    assert 0 < result["p20"] <= result["p50"] <= result["p80"]


def test_percentiles(bench) -> None:
    assert bench.percentiles([1.0, 2.0, 3.0, 4.0, 5.0]) == {"p20": 1.8, "p50": 3.0, "p80": 4.2}
    with pytest.raises(ValueError):
        bench.percentiles([])


def test_without_cuda_it_refuses(bench, monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--sizes", "64"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
