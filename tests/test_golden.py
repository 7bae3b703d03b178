"""The golden set: the tiny pipeline's frames and waveform against a committed reference.

Two fixed requests on the `make_tiny` checkpoints (seed 0): a distilled text-to-video request (PiFlow) and a base
image-to-video request with CFG (flow-matching Euler), float32 on the CPU. `tests/data/golden_tiny.json` holds, per
output, its shape, the sha256 of its float32 bytes, its peak magnitude and every 97th value, and per request its
rounding depth (`pipeline_testing.rounding_depth`). A change meant to alter outputs regenerates the file
(`python tests/test_golden.py --write`) and says why in its commit.

- On the machine the file was made on (the same PyTorch, CPU model and instruction set, the set PyTorch chose itself),
  the outputs must be bit for bit the file's: any refactor that changes a single bit fails there. A set forced with
  ATEN_CPU_CAPABILITY (CI's reruns) is not that machine: it picks ATen's own kernels only, and the libraries under
  them (oneDNN, the BLAS) still choose by the CPU, so an AVX-512 CPU forced to AVX2 rounds unlike an AVX2 CPU.
- On any other x86-64 CPU PyTorch's kernels round differently (AVX2 against AVX-512, say), so there every sampled value
  is held within the rounding bound of `pipeline_testing` (2 * 4 * sqrt(depth) * 2**-24 * peak), which a real change
  to the computation exceeds (`test_the_rounding_bound_catches_changes_to_the_computation`). Another PyTorch version
  may change its kernels' algorithms, not only their rounding: there the sample is held to OTHER_VERSION_ATOL.
- Anywhere, two runs in one process are bit for bit the same.

Run on one thread: PyTorch's CPU kernels split reductions by thread count (four threads give other bits than one or
two), and the reference must not depend on the machine's core count.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from pipeline_testing import PROMPT, gradient_image, one_thread, rounding_bound, rounding_depth

GOLDEN = Path(__file__).parent / "data" / "golden_tiny.json"
SAMPLE_EVERY = 97
# Where the PyTorch version differs from the file's: how far a sampled value may move (outputs lie in [0, 1] for
# frames and about [-1, 1] for the waveform; another version may change a kernel's algorithm, not only its rounding).
OTHER_VERSION_ATOL = 1e-3


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
    """Shape, dtype, sha256 of the bytes, peak magnitude and every SAMPLE_EVERY-th value of one output."""
    flat = np.ascontiguousarray(array).reshape(-1)
    return {
        "shape": list(array.shape),
        "dtype": str(array.dtype),
        "sha256": hashlib.sha256(flat.tobytes()).hexdigest(),
        "peak": float(np.abs(flat).max()),
        "sample": [float(v) for v in flat[::SAMPLE_EVERY]],
    }


def generate_outputs(checkpoints: dict[str, Path], cases=None) -> dict[str, dict[str, np.ndarray]]:
    """{case: {"frames": [F, H, W, 3] float32, "audio": [N] float32}} for the golden requests (or those in `cases`)."""
    from k6fast.pipeline import Pipeline
    from k6fast.switches import Options

    out = {}
    with one_thread():
        for case, (variant, request) in _requests().items():
            if cases is None or case in cases:
                result = Pipeline(checkpoints[variant], Options(), device="cpu").generate(request)
                assert result.audio is not None
                out[case] = {"frames": result.frames, "audio": result.audio}
    return out


def measure_depths(checkpoints: dict[str, Path]) -> dict[str, int]:
    """The rounding depth of each golden request (a traced run: slower, so only when the file is written)."""
    from k6fast.pipeline import Pipeline
    from k6fast.switches import Options

    depths = {}
    with one_thread():
        for case, (variant, request) in _requests().items():
            pipe = Pipeline(checkpoints[variant], Options(), device="cpu")
            _, depths[case] = rounding_depth(lambda: pipe.generate(request))  # noqa: B023 (called at once)
    return depths


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def _made_with() -> dict[str, str]:
    """What decides the outputs' bits besides k6fast: PyTorch, the CPU and the kernels PyTorch picked for it."""
    import platform

    import torch

    return {
        "torch": torch.__version__.split("+")[0],
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def _largest_difference(expected: dict, array: np.ndarray) -> float:
    sample = np.ascontiguousarray(array).reshape(-1)[::SAMPLE_EVERY].astype(np.float64)
    return float(np.abs(sample - np.asarray(expected["sample"])).max())


def _tolerance(golden: dict, case: str, stream: str) -> float:
    if golden["made_with"]["torch"] != _made_with()["torch"]:
        return OTHER_VERSION_ATOL
    return rounding_bound(golden[case]["rounding_depth"], golden[case][stream]["peak"])


@pytest.fixture(scope="module")
def outputs(tiny_checkpoints) -> dict[str, dict[str, np.ndarray]]:
    return generate_outputs(tiny_checkpoints)


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("case", ["distill-text", "base-image"])
@pytest.mark.parametrize("stream", ["frames", "audio"])
def test_outputs_match_the_golden_set(golden, outputs, case: str, stream: str) -> None:
    expected, array = golden[case][stream], outputs[case][stream]
    found = describe(array)
    assert (found["shape"], found["dtype"]) == (expected["shape"], expected["dtype"])
    largest = _largest_difference(expected, array)
    if golden["made_with"] == _made_with() and not os.environ.get("ATEN_CPU_CAPABILITY"):
        assert found["sha256"] == expected["sha256"], f"{case} {stream}: a sampled value moved by {largest:.3g}"
    else:
        tolerance = _tolerance(golden, case, stream)
        assert largest <= tolerance, (
            f"{case} {stream}: a sampled value moved by {largest:.3g}, {largest / tolerance:.1f} times what "
            f"rounding explains ({tolerance:.3g}); made with {golden['made_with']}, here {_made_with()}"
        )
    # A reference of a flat clip would prove little.
    assert float(np.std(array)) > 1e-5


def test_two_runs_in_one_process_are_bit_identical(tiny_checkpoints, outputs) -> None:
    again = generate_outputs(tiny_checkpoints)
    for case, streams in outputs.items():
        for stream, array in streams.items():
            assert describe(again[case][stream])["sha256"] == describe(array)["sha256"], f"{case} {stream}"


def _scale_tensor(folder: Path, name: str, factor: float) -> None:
    """Multiply one tensor of a component folder's safetensors files by `factor`, in place."""
    from safetensors.torch import load_file, save_file

    for file in folder.glob("*.safetensors"):
        tensors = load_file(file)
        if name in tensors:
            tensors[name] = tensors[name] * factor
            save_file(tensors, file, metadata={"format": "pt"})
            return
    raise AssertionError(f"no tensor {name} in {folder}")


def _assert_outside_the_bound(golden: dict, changed: dict, unchanged: dict, streams: tuple[str, ...]) -> None:
    for case, outs in changed.items():
        for stream in streams:
            moved = float(np.abs(outs[stream].astype(np.float64) - unchanged[case][stream]).max())
            bound = rounding_bound(golden[case]["rounding_depth"], golden[case][stream]["peak"])
            assert moved > bound, f"{case} {stream}: moved {moved:.3g}, within the rounding bound {bound:.3g}"


def test_the_rounding_bound_catches_changes_to_the_computation(
    golden, outputs, tiny_checkpoints, tmp_path, monkeypatch
) -> None:
    """The bound is not vacuous: changes far smaller than a bf16 rounding move the outputs well past it. Judged
    against this machine's own outputs, so that only the change differs."""
    # One feed-forward weight of the first fused block and the vocoder's last convolution, each scaled by 1 + 2**-10
    # (a quarter of bf16's rounding step).
    changed = {}
    for variant, source in tiny_checkpoints.items():
        changed[variant] = shutil.copytree(source, tmp_path / variant)
        ff = "visual_transformer_blocks.0.video_dec_block.feed_forward.net.2.weight"
        _scale_tensor(changed[variant] / "transformer", ff, 1 + 2**-10)
        _scale_tensor(changed[variant] / "vocoder", "conv_post.weight", 1 + 2**-10)
    _assert_outside_the_bound(golden, generate_outputs(changed), outputs, ("frames", "audio"))

    # A refactor that swaps the exact GELU for its tanh approximation (they differ by at most 5e-4).
    import torch.nn.functional as F

    exact_gelu = F.gelu
    monkeypatch.setattr(F, "gelu", lambda x, approximate="none": exact_gelu(x, approximate="tanh"))
    _assert_outside_the_bound(golden, generate_outputs(tiny_checkpoints), outputs, ("frames",))


def _write() -> None:
    from k6fast.testing.tiny import make_tiny

    with tempfile.TemporaryDirectory() as tmp:
        checkpoints = {v: make_tiny(Path(tmp) / v, variant=v, seed=0) for v in ("distill", "base")}
        outputs = generate_outputs(checkpoints)
        depths = measure_depths(checkpoints)
    golden = {"made_with": _made_with()}
    for case, streams in outputs.items():
        golden[case] = {"rounding_depth": depths[case]} | {k: describe(v) for k, v in streams.items()}
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_golden.py --write   (regenerates tests/data/golden_tiny.json)")
    _write()
