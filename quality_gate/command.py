"""`k6fast gate`: the command line of the quality gate. Importing this module is cheap (argparse only); the
runtime, LPIPS and matplotlib load when the command runs.

    k6fast gate --model M --arm switches/arms/fast.env [--arm ...] [--exact ARM ...] [--floor] [--relative K]
                [--prompts quality_gate/setA.json] [--seeds 42] [--size 864x480] [--frames 121] [--steps N]
                [--out k6fast-gate] [--lpips-backbone PATH|random]

Exit status: 0 every arm passed, 1 an arm failed, 2 the gate could not run (the message says why), 3 plumbing only:
the LPIPS backbone was random (`--lpips-backbone random`, for tests), so every stage ran and nothing was judged.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..cli_args import seed_list, size_arg
from . import GateError
from .config import SET_A, GateConfig, validate_config
from .thresholds import Thresholds

if TYPE_CHECKING:
    from .scoring import ArmResult

DTYPE_NAMES = ("bf16", "fp16", "fp32")
DEFAULT_OUT = Path("k6fast-gate")
EXIT_PLUMBING = 3  # the run had no verdict: its LPIPS backbone was random


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, found {text!r}")
    return value


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `gate` subcommand to a `k6fast` subparsers object."""
    defaults = Thresholds()
    p = subparsers.add_parser("gate", help="score arms against the reference: LPIPS per frame + audio distances")
    p.add_argument("--model", required=True, help="Hub id or local Diffusers-layout checkpoint directory")
    p.add_argument("--reference", default="reference", help="the reference arm (name or .env path; default reference)")
    p.add_argument("--arm", action="append", default=[], help="an arm to score (name or .env path); repeatable")
    p.add_argument(
        "--exact", action="append", default=[], help="an arm that must reproduce the reference bit for bit; repeatable"
    )
    p.add_argument("--prompts", type=Path, help="prompt set JSON (default: the packaged set A, quality_gate/setA.json)")
    p.add_argument("--seeds", type=seed_list, default=[42], help="comma-separated seeds (default 42)")
    p.add_argument("--size", type=size_arg, default=(864, 480), help="WIDTHxHEIGHT (default 864x480)")
    p.add_argument("--frames", type=int, default=121, help="frame count 4k+1 (default 121)")
    p.add_argument("--steps", type=int, help="denoising steps (default: the checkpoint's)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="report and clip cache directory")
    p.add_argument(
        "--floor", action="store_true", help="re-run the reference (never cached) to measure the noise floor"
    )
    p.add_argument("--relative", type=_positive, metavar="K", help="limits = noise floor x K + eps (needs --floor)")
    p.add_argument("--max-lpips-mean", type=float, default=defaults.lpips_mean)
    p.add_argument("--max-lpips-worst", type=float, default=defaults.lpips_worst)
    p.add_argument("--max-log-mel-db", type=float, default=defaults.log_mel_db)
    p.add_argument("--max-log-mel-worst-db", type=float, default=defaults.log_mel_worst_db)
    p.add_argument("--max-mrstft", type=float, default=defaults.mrstft)
    p.add_argument(
        "--lpips-backbone",
        metavar="PATH|random",
        help="AlexNet weights file (default: <torch hub>/checkpoints/alexnet-owt-7be5be79.pth); "
        "'random' = a seeded random backbone for tests, not a measurement",
    )
    p.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, help="compute dtype (default: bf16 GPU, fp32 CPU)")
    p.add_argument("--regenerate", action="store_true", help="generate every clip again instead of reusing the cache")
    p.set_defaults(func=handler)
    return p


def _backbone_switch() -> str | None:
    """K6_LPIPS_BACKBONE, when --lpips-backbone is not given (the only switch the gate reads from the environment:
    arms are built from their files alone)."""
    from ..switches import load_options

    path = load_options().lpips_backbone
    return str(path) if path else None


def config_from_args(args: argparse.Namespace) -> GateConfig:
    thresholds = Thresholds(
        lpips_mean=args.max_lpips_mean,
        lpips_worst=args.max_lpips_worst,
        log_mel_db=args.max_log_mel_db,
        log_mel_worst_db=args.max_log_mel_worst_db,
        mrstft=args.max_mrstft,
        relative=args.relative,
    )
    return GateConfig(
        model=args.model,
        arms=list(args.arm),
        exact=list(args.exact),
        reference=args.reference,
        prompts=args.prompts or SET_A,
        seeds=list(args.seeds),
        width=args.size[0],
        height=args.size[1],
        frames=args.frames,
        steps=args.steps,
        out=args.out,
        floor=args.floor,
        thresholds=thresholds,
        backbone=args.lpips_backbone or _backbone_switch(),
        device=args.device,
        dtype=args.dtype,
        regenerate=args.regenerate,
    )


def _line_verdict(plumbing_only: bool, result: ArmResult) -> str:
    if result.floor:
        return "FLOOR"
    if plumbing_only:
        return "PLUMB"  # the checks ran; with a random backbone they decide nothing
    return "PASS" if result.passed else "FAIL"


def handler(args: argparse.Namespace) -> int:
    """Run the gate from parsed arguments; print one line per arm; 0 pass, 1 an arm failed, 2 cannot run, 3 plumbing
    only (random LPIPS backbone, no verdict)."""
    from ..checkpoint import CheckpointError
    from ..request import RequestError
    from ..switches import SwitchError

    try:
        config = config_from_args(args)
        validate_config(config)  # before the imports below take their seconds
        from ..entry import prepare_pipeline_process
        from .gate import run_gate

        run = run_gate(config, prepare=prepare_pipeline_process)
    except (GateError, SwitchError, RequestError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if run.banner:
        print(f"*** {run.banner} ***")
    for result in ([run.floor] if run.floor else []) + run.arms:
        agg = result.aggregates
        verdict = _line_verdict(run.plumbing_only, result)
        failed = [c.metric for c in result.checks if not c.passed]
        print(
            f"{verdict:<5} {result.label} [{result.arm_hash}]: LPIPS mean {agg['lpips_mean']:.4f} worst "
            f"{agg['lpips_worst']:.4f}, log-mel {agg['log_mel_db']:.2f} dB (worst {agg['log_mel_worst_db']:.2f}), "
            f"MR-STFT {agg['mrstft']:.3f}" + (f"; failed: {', '.join(failed)}" if failed else "")
        )
    print(f"report: {Path(args.out) / 'report.md'}")
    if run.plumbing_only:
        print(run.verdict)
        return EXIT_PLUMBING
    return 0 if run.passed else 1
