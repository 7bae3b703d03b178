"""`k6fast tune`: the fastest arm that passes your own gate on your own prompts. Importing this module is cheap
(argparse only); the bench, the gate and the model load when the command runs.

    k6fast tune --model M --prompts P --lpips-max X [--audio-max Y] [--budget N] [--knobs ...] [--geometry WxHxF]
                [--steps N] [--base-arm reference] [--out k6fast-tune] [--lpips-backbone PATH | random --test]

Exit status: 0 a winner was found (its .env written), 1 no candidate passed within the budget, 2 tune could not run
(the message says why), 3 plumbing only: a winner by the random LPIPS backbone (--test), which judges nothing.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from ..cli_args import comma_list, seed_list
from .search import TuneError
from .space import KNOBS

DEFAULT_OUT = Path("k6fast-tune")
EXIT_NONE_PASSED = 1
EXIT_PLUMBING = 3


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, found {text!r}") from None


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `tune` subcommand to a `k6fast` subparsers object."""
    p = subparsers.add_parser(
        "tune",
        help="search the lossy switches for the fastest arm whose gate passes on your prompts",
        description="Search GEMM format, quantized and sparse attention (blocks, steps) and cached steps for the "
        "fastest arm that passes the quality gate against the BF16 reference, within a budget of gate runs.",
    )
    p.add_argument("--model", required=True, help="Hub id or local Diffusers-layout checkpoint directory")
    p.add_argument("--prompts", required=True, type=Path, help="prompt set JSON (the gate's format, e.g. setA.json)")
    p.add_argument(
        "--lpips-max",
        required=True,
        type=_number,
        help="LPIPS set-mean limit; the worst-frame limit keeps the gate's proportion (0.25 : 0.15)",
    )
    p.add_argument(
        "--audio-max", type=_number, help="log-mel limit in dB (the other audio limits in the gate's proportion)"
    )
    p.add_argument("--budget", type=int, default=6, help="most gate runs to spend (default 6)")
    p.add_argument(
        "--knobs",
        type=lambda t: comma_list(t, example="sparse,cache"),
        default=KNOBS,
        help=f"what to search (default all that apply): {','.join(KNOBS)}",
    )
    p.add_argument("--geometry", default="w1", help="w1 (864x480x121, default) or WIDTHxHEIGHTxFRAMES")
    p.add_argument("--steps", type=int, help="denoising steps (default: the checkpoint's)")
    p.add_argument("--seeds", type=seed_list, default=(42,), help="comma-separated seeds (default 42)")
    p.add_argument(
        "--base-arm", default="reference", help="lossless settings every candidate keeps (default reference)"
    )
    p.add_argument("--reference", default="reference", help="the arm candidates are judged against (default reference)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where arms, sessions, reports and clips go")
    p.add_argument("--name", default="tuned", help="the winner is written to OUT/NAME.env (default tuned)")
    p.add_argument(
        "--lpips-backbone",
        metavar="PATH|random",
        help="AlexNet weights file (default: the torch hub cache); 'random' only with --test",
    )
    p.add_argument(
        "--test",
        action="store_true",
        help="allow the random LPIPS backbone: a plumbing run whose verdicts mean nothing",
    )
    p.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="compute dtype (default: bf16 GPU, fp32 CPU)")
    p.set_defaults(func=handler)
    return p


def _backbone(args: argparse.Namespace) -> str | None:
    """--lpips-backbone, else K6_LPIPS_BACKBONE (as the gate reads it), else None (the torch hub cache)."""
    if args.lpips_backbone:
        return args.lpips_backbone
    from ..switches import load_options

    path = load_options().lpips_backbone
    return str(path) if path else None


def _command(args: argparse.Namespace) -> str:
    """The `k6fast tune` line that repeats this run, every option spelled out (the record's `command`). Only the
    command's own options: `k6fast.cli` puts more on the namespace (its start-up clock), which no flag sets."""
    parser = argparse.ArgumentParser(add_help=False)
    actions = register(parser.add_subparsers())._actions
    flags = {action.dest: action.option_strings[-1] for action in actions if action.option_strings}
    argv = ["k6fast", "tune"]
    for name, value in vars(args).items():
        flag = flags.get(name)
        if flag is None or value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, tuple):
            argv += [flag, ",".join(map(str, value))]
        else:
            argv += [flag, str(value)]
    return shlex.join(argv)


def config_from_args(args: argparse.Namespace):
    from .config import TuneConfig, parse_geometry

    return TuneConfig(
        model=args.model,
        prompts=args.prompts,
        lpips_max=args.lpips_max,
        audio_max=args.audio_max,
        out=args.out,
        budget=args.budget,
        knobs=tuple(args.knobs),
        base_arm=args.base_arm,
        reference=args.reference,
        geometry=parse_geometry(args.geometry),
        steps=args.steps,
        seeds=tuple(args.seeds),
        backbone=_backbone(args),
        test=args.test,
        device=args.device,
        dtype=args.dtype,
        name=args.name,
        command=_command(args),
    )


def handler(args: argparse.Namespace) -> int:
    """Validate, search, report: one line per gated candidate on stderr, the winner and the record on stdout."""
    from ..checkpoint import CheckpointError
    from ..quality_gate import GateError
    from ..request import RequestError
    from ..switches import SwitchError

    try:
        from .config import validate

        config = config_from_args(args)
        validate(config)  # before the imports below take their seconds
        from ..entry import prepare_pipeline_process
        from .run import RECORD, run_tune

        result, space, _ = run_tune(config, prepare=prepare_pipeline_process)
    except (TuneError, GateError, SwitchError, RequestError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    record = config.out / RECORD
    if result.best is None:
        print(f"no candidate passed ({result.gate_runs} gate runs, {result.stopped}); every candidate: {record}")
        return EXIT_NONE_PASSED
    best = result.best
    print(f"winner {space.label(best.candidate)}: {space.describe(best.candidate)}, {best.seconds:.3f} s a request")
    print(f"arm: {config.out / (config.name + '.env')}; every candidate: {record}")
    if config.plumbing_only:
        print("PLUMBING ONLY (random LPIPS backbone, --test): no quality verdict")
        return EXIT_PLUMBING
    return 0
