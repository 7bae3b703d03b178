"""The golden set: the tiny pipeline's frames and waveform, bit for bit, against a committed reference.

Two fixed requests on the `make_tiny` checkpoints (seed 0): a distilled text-to-video request (PiFlow) and a base
image-to-video request with CFG (flow-matching Euler), float32 on the CPU. `tests/data/golden_tiny.json` holds, per
output, its shape, the sha256 of its float32 bytes and every 97th value (for the message when a hash differs). Any
refactor that changes a single bit of either output fails here; a change meant to alter outputs regenerates the file
(`python tests/test_golden.py --write`) and says why in its commit.

Run on one thread: PyTorch's CPU kernels split reductions by thread count (four threads give other bits than one or
two on the machine the reference was made on), and the reference must not depend on the machine's core count. The
file names the PyTorch version and machine it was made with; another version's CPU kernels may round differently,
so there every output is held to its shape and dtype and its stored sample to within float rounding of a short
float32 chain instead of bit for bit (the CI machine runs the version the file was made with: bit for bit there).
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from pipeline_testing import PROMPT, gradient_image, one_thread

GOLDEN = Path(__file__).parent / "data" / "golden_tiny.json"
SAMPLE_EVERY = 97


def _requests():
    from k6fast.pipeline import Request

    return {
        "distill-text": ("distill", Request(prompt=PROMPT, width=64, height=48, frames=9, steps=4, seed=7)),
        "base-image": (
            "base",
            Request(
                prompt=PROMPT, width=64, height=48, frames=9, steps=3, guidance=5.0, seed=11, image=gradient_image()
            ),
        ),
    }


def describe(array: np.ndarray) -> dict:
    """Shape, dtype, sha256 of the bytes and every SAMPLE_EVERY-th value of one output."""
    flat = np.ascontiguousarray(array).reshape(-1)
    return {
        "shape": list(array.shape),
        "dtype": str(array.dtype),
        "sha256": hashlib.sha256(flat.tobytes()).hexdigest(),
        "sample": [float(v) for v in flat[::SAMPLE_EVERY]],
    }


def generate_outputs(checkpoints: dict[str, Path]) -> dict[str, dict[str, np.ndarray]]:
    """{case: {"frames": [F, H, W, 3] float32, "audio": [N] float32}} for the golden requests."""
    from k6fast.pipeline import Pipeline
    from k6fast.switches import Options

    out = {}
    with one_thread():
        for case, (variant, request) in _requests().items():
            result = Pipeline(checkpoints[variant], Options(), device="cpu").generate(request)
            assert result.audio is not None
            out[case] = {"frames": result.frames, "audio": result.audio}
    return out


def _difference(expected: dict, array: np.ndarray) -> str:
    """Where a mismatching output differs, judged on the stored sample."""
    if list(array.shape) != expected["shape"] or str(array.dtype) != expected["dtype"]:
        return f"shape/dtype {list(array.shape)} {array.dtype}, expected {expected['shape']} {expected['dtype']}"
    sample = np.ascontiguousarray(array).reshape(-1)[::SAMPLE_EVERY].astype(np.float64)
    diff = np.abs(sample - np.asarray(expected["sample"]))
    return f"{int((diff > 0).sum())} of {diff.size} sampled values differ, largest by {diff.max():.3g}"


@pytest.fixture(scope="module")
def outputs(tiny_checkpoints) -> dict[str, dict[str, np.ndarray]]:
    return generate_outputs(tiny_checkpoints)


def _made_with() -> dict[str, str]:
    import platform

    import torch

    return {"torch": torch.__version__.split("+")[0], "machine": platform.machine()}


# Where the PyTorch version differs from the file's: how far a sampled value may move (outputs lie in [0, 1] for
# frames and about [-1, 1] for the waveform; another version's CPU kernels round a few float32 ulps differently,
# compounded over the sampling steps).
OTHER_VERSION_ATOL = 1e-3


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("case", ["distill-text", "base-image"])
@pytest.mark.parametrize("stream", ["frames", "audio"])
def test_outputs_are_bit_identical_to_the_golden_set(golden, outputs, case: str, stream: str) -> None:
    expected, array = golden[case][stream], outputs[case][stream]
    found = describe(array)
    assert (found["shape"], found["dtype"]) == (expected["shape"], expected["dtype"])
    if golden["made_with"] == _made_with():
        assert found["sha256"] == expected["sha256"], f"{case} {stream}: {_difference(expected, array)}"
    else:  # another PyTorch: the same outputs up to its kernels' rounding
        sample = np.asarray(found["sample"])
        assert np.allclose(sample, expected["sample"], rtol=0, atol=OTHER_VERSION_ATOL), _difference(expected, array)
    # A reference of a flat clip would prove little.
    assert float(np.std(array)) > 1e-5


def _write() -> None:
    from k6fast.testing.tiny import make_tiny

    with tempfile.TemporaryDirectory() as tmp:
        checkpoints = {v: make_tiny(Path(tmp) / v, variant=v, seed=0) for v in ("distill", "base")}
        outputs = generate_outputs(checkpoints)
    golden = {"made_with": _made_with()}
    golden |= {case: {k: describe(v) for k, v in streams.items()} for case, streams in outputs.items()}
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_golden.py --write   (regenerates tests/data/golden_tiny.json)")
    _write()
