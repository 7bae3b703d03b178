"""`k6fast bench` (run an A/B session) and `k6fast bench report` (render measurements/README.md, the plots, and the
results block of the project README from the records: `readme_results.py`).

Wired into `k6fast/cli.py` by `register(subparsers)`; every handler returns an exit status.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..cli_args import comma_list, device_problem

DEFAULT_SESSIONS = "measurements/sessions"


def register(subparsers) -> argparse.ArgumentParser:
    """Add `bench` (with its `report` sub-action) to the k6fast command line."""
    p = subparsers.add_parser(
        "bench",
        help="A/B timing session: arms visited mirrored, each visit a fresh process; `bench report` renders results",
        description="Time arms against each other (k6fast arms and the diffusers peer rows), recording every visit.",
    )
    p.add_argument("--model", help="checkpoint directory or Hub id (required unless running `bench report`)")
    p.add_argument(
        "--arms",
        type=comma_list,
        help="comma-separated arms: names or .env paths of k6fast arms, or the peers diffusers / diffusers-offload; "
        "the first is the control",
    )
    p.add_argument("--order", choices=["ABBA", "ABAB"], default="ABBA", help="ABBA = mirrored (default)")
    p.add_argument("--repeats", type=int, default=1, help="how many times the visit pattern repeats (default 1)")
    p.add_argument("--requests", type=int, default=1, help="timed requests per visit after the warm-up (default 1)")
    p.add_argument("--geometry", default="w1", help="w1 (864x480x121), smoke (64x64x9) or WIDTHxHEIGHTxFRAMES")
    p.add_argument("--steps", type=int, help="denoising steps (default: the checkpoint's, 10 distilled / 50 base)")
    p.add_argument("--guidance", type=float, help="CFG scale (default: the checkpoint's, 1.0 distilled / 5.0 base)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--prompt", help="prompt for --component pipeline (default: a fixed set-A style prompt)")
    p.add_argument("--component", choices=["pipeline", "dit", "block"], default="pipeline", help="what is timed")
    p.add_argument("--topic", default="ab", help="names the session folder <date>_<topic> (default ab)")
    p.add_argument("--out", default=DEFAULT_SESSIONS, help=f"sessions folder (default {DEFAULT_SESSIONS})")
    p.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument(
        "--set",
        dest="switches",
        action="append",
        default=[],
        metavar="K6_NAME=VALUE",
        help="a switch for every k6fast arm of the session, over the arm file (repeatable), e.g. "
        "K6_VRAM_BUDGET_GB=32; the budget also caps the peers' allocator",
    )
    p.add_argument("--no-mux", action="store_true", help="pipeline: do not write the MP4 (no mux phase)")
    p.add_argument("--idle-timeout", type=float, default=300.0, help="seconds to wait for an idle GPU per visit")
    p.add_argument("--visit-timeout", type=float, default=3600.0, help="seconds before a visit is killed")
    p.set_defaults(func=cmd_bench)

    actions = p.add_subparsers(dest="bench_action", metavar="{report}")
    r = actions.add_parser("report", help="render measurements/README.md, a PNG per session and README.md's results")
    r.add_argument("--sessions", default=DEFAULT_SESSIONS, help=f"sessions folder (default {DEFAULT_SESSIONS})")
    r.add_argument("--readme", help="README to render (default: README.md beside the sessions folder)")
    r.add_argument("--no-plot", action="store_true", help="skip the PNGs (e.g. where matplotlib is missing)")
    r.add_argument(
        "--project-readme",
        help="README whose results block (between <!-- results:start/end --> markers) is rendered from the records "
        "(default: README.md two levels above the sessions folder, when it has the markers)",
    )
    r.set_defaults(func=cmd_report)
    return p


def cmd_bench(args: argparse.Namespace) -> int:
    from ..checkpoint import open_checkpoint
    from .session import BenchError, SessionPlan, check_arm, parse_session_switch, run_session, with_command
    from .workload import parse_geometry

    if not args.model or not args.arms:
        print("error: k6fast bench needs --model and --arms (or the `report` action)", file=sys.stderr)
        return 2
    try:
        geometry = parse_geometry(args.geometry)
        problem = device_problem(args.device)
        if problem:  # the visits would each fail on it, after the session folder is made
            raise ValueError(f"--device {args.device}: {problem}")
        arms = tuple(check_arm(arm) for arm in args.arms)
        switches = tuple(parse_session_switch(text) for text in args.switches)
        ckpt = open_checkpoint(args.model)  # validated once here, before any visit starts
        steps = args.steps if args.steps is not None else ckpt.default_steps
        guidance = args.guidance if args.guidance is not None else ckpt.default_guidance
        plan = SessionPlan(
            arms=arms,
            model=str(ckpt.root),
            component=args.component,
            geometry=geometry,
            steps=steps,
            guidance=guidance,
            topic=args.topic,
            order=args.order,
            repeats=args.repeats,
            requests=args.requests,
            seed=args.seed,
            device=args.device,
            dtype=args.dtype,
            mux=not args.no_mux,
            idle_timeout_s=args.idle_timeout,
            visit_timeout_s=args.visit_timeout,
            switches=switches,
            **({"prompt": args.prompt} if args.prompt else {}),
        )
        plan = with_command(plan, args.out)
        folder = run_session(plan, Path(args.out))
    except (ValueError, BenchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from .records import load_session
    from .report import session_table

    print(session_table(load_session(folder), link_prefix=str(Path(args.out))))
    print(f"recorded {folder}; render measurements/README.md with: k6fast bench report --sessions {args.out}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from .readme_results import RESULTS_MARKERS, update_readme
    from .report import render

    sessions = Path(args.sessions)
    readme = Path(args.readme) if args.readme else sessions.resolve().parent / "README.md"
    project = Path(args.project_readme) if args.project_readme else sessions.resolve().parent.parent / "README.md"
    try:
        written = render(sessions, readme, plots=not args.no_plot)
        if args.project_readme or (project.is_file() and RESULTS_MARKERS[0] in project.read_text(encoding="utf-8")):
            if update_readme(project, sessions):
                written.append(project)
            else:
                print(f"{project}: results block already current")
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m k6fast.bench.cli ...`: the same commands without the top-level CLI (until it is wired in)."""
    parser = argparse.ArgumentParser(prog="k6fast")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
