"""What every benchmark script here shares: the environment record, the two timing methods, the error measure, and
the W1 GEMM shapes. Scripts run as `python measurements/<script>.py`, so this imports as `bench_common`."""

from __future__ import annotations

import argparse
import datetime
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

W1_M = 50220  # W1 video tokens
W1_SHAPES = [(4096, 4096), (4096, 16384), (16384, 4096)]  # (K, N) of the Pro linear layers
QUANTILES = [0.2, 0.5, 0.8]


def attention_arg_parser() -> argparse.ArgumentParser:
    """The options the W1 attention benchmarks share (1×heads×50,220×head_dim, plus odd shapes unless skipped)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rep-ms", type=int, default=1000)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--skip-odd", action="store_true")
    return ap


def warm_generate_arg_parser(description: str) -> argparse.ArgumentParser:
    """The options of the scripts that run `k6fast generate` warm: a checkpoint, an arm, the compile caches a cold
    run of it left, the VRAM budget and the geometry."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", required=True)
    ap.add_argument("--arm", default="final")
    ap.add_argument("--cache-dir", required=True, help="the compile caches of a cold run of the arm")
    ap.add_argument("--budget-gb", type=float, default=32.0)
    ap.add_argument("--geometry", default="w1", help="w1 or WIDTHxHEIGHTxFRAMES (the cold run's)")
    return ap


def environment(device: torch.device | None = None) -> dict:
    """GPU, versions and date for a record: of CUDA device 0, or of `device` (named first; a CPU one has gpu None)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    env = {} if device is None else {"device": str(device)}
    if device is None or device.type == "cuda":
        props = torch.cuda.get_device_properties(0 if device is None else device)
        env.update(gpu=props.name, capability=f"sm_{props.major}{props.minor}", sms=props.multi_processor_count)
    else:
        env["gpu"] = None
    return {
        **env,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def quantiles_ms(fn: Callable[[], object], rep_ms: int) -> tuple[float, float, float]:
    """p20/p50/p80 in ms of a kernel-sized call (Triton's do_bench: L2 flushed, CUDA-event timed)."""
    from triton.testing import do_bench

    p20, p50, p80 = do_bench(fn, warmup=50, rep=rep_ms, quantiles=QUANTILES)
    return p20, p50, p80


def wall_seconds(fn: Callable[[], object], repeats: int) -> list[float]:
    """Seconds per call of something long (a block, a forward), synchronised around each call, after one warm-up."""
    fn()
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - start)
    return out


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def gemm_shapes_main(
    name: str,
    doc: str,
    bench_shape: Callable[[int, int, int, int], list[dict]],
    print_table: Callable[[dict, list[dict]], None],
) -> None:
    """The command line of the GEMM benchmarks: rows, KxN shapes, measuring time, JSON output; correctness first."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--m", type=int, default=W1_M, help="rows (tokens); default the W1 50220")
    parser.add_argument(
        "--shapes", nargs="*", default=[f"{k}x{n}" for k, n in W1_SHAPES], help="KxN pairs, default the W1 three"
    )
    parser.add_argument("--rep-ms", type=int, default=300, help="do_bench measuring time per variant")
    parser.add_argument("--out", type=Path, help="write results as JSON here (parent folders are created)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit(f"bench_{name}.py needs a CUDA GPU")
    env = environment()
    results = []
    for shape in args.shapes:
        k, n = (int(v) for v in shape.lower().split("x"))
        results += bench_shape(args.m, k, n, args.rep_ms)
        torch.cuda.empty_cache()  # the shape's operands were freed on return; give the next shape the memory
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"bench": name, "env": env, "results": results}, f, indent=1)
    print_table(env, results)
    if not all(r["ok"] for r in results):
        raise SystemExit("some variants failed their correctness check and were not timed")
