"""`k6fast acceptance`: the command line of the full-size acceptance run (`acceptance.py` runs it)."""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from pathlib import Path

from ..cli_args import comma_list

DEFAULT_ARMS = "reference,step-cache,final,fast"


def list_of(text: str) -> list[str]:
    """Comma-separated names as a list (the plan builder takes lists)."""
    return list(comma_list(text))


def _budgets(text: str) -> list[float]:
    try:
        budgets = [float(v) for v in list_of(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GiB figures such as 32,31, found {text!r}") from None
    if any(b <= 0 for b in budgets):
        raise argparse.ArgumentTypeError(f"budgets must be > 0 GiB, found {text!r}")
    return budgets


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "acceptance",
        help="every arm at full depth, each a fresh `k6fast generate` under a VRAM budget, cold and warm; a table",
        description="The full-size acceptance run: every shipped arm as a user runs it, plus the diffusers peer.",
    )
    p.add_argument("--model", required=True, help="checkpoint directory (with --make-synthetic: where to write one)")
    p.add_argument("--make-synthetic", metavar="PRESET", help="write a full-depth synthetic checkpoint of this "
                   "preset (pro-distill, pro, lite-distill, lite) at --model first, unless one is there")  # fmt: skip
    p.add_argument("--arms", type=list_of, default=list_of(DEFAULT_ARMS), help=f"default {DEFAULT_ARMS}")
    p.add_argument("--budgets", type=_budgets, default=[32.0, 31.0], help="K6_VRAM_BUDGET_GB values (default 32,31)")
    p.add_argument("--ballast-arms", type=list_of, default=["reference", "final"], help="arms also run beside a "
                   "host-memory ballast (default reference,final)")  # fmt: skip
    p.add_argument("--host-ram-gb", type=float, default=60.0, help="host memory the ballast leaves, GB (0 = none)")
    p.add_argument("--peer", default="diffusers-offload", help="peer row (diffusers, diffusers-offload, or none)")
    p.add_argument("--geometry", default="w1", help="w1 (864x480x121) or WIDTHxHEIGHTxFRAMES")
    p.add_argument("--steps", type=int, help="denoising steps (default: the checkpoint's)")
    p.add_argument("--guidance", type=float, help="CFG scale (default: the checkpoint's)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--prompt", help="the request's prompt (default: a fixed rain-and-neon prompt)")
    p.add_argument("--out", help="record folder (default measurements/sessions/<date>_acceptance)")
    p.add_argument("--work", default="/tmp/k6fast-acceptance", help="clips, latents, logs, caches")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds before a run is killed (default 1200)")
    p.add_argument("--only", type=list_of, help="run only these runs of the plan (their slugs, e.g. fast-32-cold)")
    p.set_defaults(func=cmd_acceptance)
    return p


def _header(model: str) -> dict:
    import importlib.metadata

    from .gpu import gpu_inventory

    versions = {}
    for name in ("torch", "triton", "diffusers", "transformers", "k6fast", "flash-attn-4"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    note = model
    marker = Path(model) / "synthetic.json"
    if marker.is_file():
        note = f"{model} (synthetic random weights, real shapes: {marker.read_text().strip()[:300]})"
    return {"gpus": gpu_inventory(), "versions": versions, "checkpoint_note": note, "python": sys.version.split()[0]}


def cmd_acceptance(args: argparse.Namespace) -> int:
    from ..checkpoint import open_checkpoint
    from .acceptance import REFERENCE_ARM, Workload, build_plan, run_acceptance
    from .records import DEFAULT_PROMPT
    from .workload import parse_geometry

    try:
        geometry = parse_geometry(args.geometry)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    model = Path(args.model)
    made = None
    if args.make_synthetic and not (model / "model_index.json").is_file():
        from ..testing.synthetic import make_synthetic

        start = time.perf_counter()
        make_synthetic(model, preset=args.make_synthetic)
        made = time.perf_counter() - start
        print(f"acceptance: wrote the synthetic checkpoint in {made:.1f} s", file=sys.stderr)
    ckpt = open_checkpoint(str(model))
    arms = sorted(args.arms, key=lambda a: a != REFERENCE_ARM)  # the reference first: every arm is held against it
    peer = None if args.peer == "none" else args.peer
    runs = build_plan(arms, args.budgets, ballast_arms=args.ballast_arms, host_ram_gb=args.host_ram_gb or None,
                      peer=peer)  # fmt: skip
    if args.only:
        unknown = set(args.only) - {r.slug for r in runs}
        if unknown:
            print(f"error: --only {sorted(unknown)}: expected run slugs of the plan: "
                  f"{', '.join(r.slug for r in runs)}", file=sys.stderr)  # fmt: skip
            return 2
        runs = [r for r in runs if r.slug in args.only]
    workload = Workload(
        model=str(model), geometry=geometry.label(), prompt=args.prompt or DEFAULT_PROMPT, seed=args.seed,
        steps=args.steps or ckpt.default_steps,
        guidance=args.guidance if args.guidance is not None else ckpt.default_guidance,
    )  # fmt: skip
    out = Path(args.out or f"measurements/sessions/{dt.date.today().isoformat()}_acceptance")
    header = _header(str(model)) | {"synthetic_write_s": made}
    try:
        run_acceptance(runs, workload, out=out, work=Path(args.work), timeout_s=args.timeout, header=header)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"acceptance: the table is {out / 'README.md'}", file=sys.stderr)
    return 0
