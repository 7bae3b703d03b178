"""`k6fast acceptance`: the command line of the full-size acceptance run (`acceptance.py` runs it)."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
import time
from pathlib import Path

from ..cli_args import comma_list

DEFAULT_ARMS = "reference,step-cache,final,fast"
DEFAULT_DF11_ARMS = ("reference", "final")


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
    p.add_argument("--text-encoders", choices=("one-layer", "full"), default="one-layer", help="with --make-synthetic: "
                   "one-layer text encoders (default) or Qwen2.5-VL-7B and CLIP-L at their real sizes")  # fmt: skip
    p.add_argument("--text-encoder-dir", help="with --make-synthetic --text-encoders full: write the text encoders "
                   "into this missing or empty folder (e.g. one in /dev/shm), linked from the checkpoint")  # fmt: skip
    p.add_argument("--arms", type=list_of, default=list_of(DEFAULT_ARMS), help=f"default {DEFAULT_ARMS}")
    p.add_argument("--budgets", type=_budgets, default=[32.0, 31.0], help="K6_VRAM_BUDGET_GB values (default 32,31)")
    p.add_argument("--ballast-arms", type=list_of, default=["reference", "final"], help="arms also run beside a "
                   "host-memory ballast (default reference,final)")  # fmt: skip
    p.add_argument("--host-ram-gb", type=float, default=60.0, help="host memory the ballast leaves, GB (0 = none)")
    p.add_argument("--peer", default="diffusers-offload", help="peer row (diffusers, diffusers-offload, or none)")
    p.add_argument(
        "--peer-model",
        help="the peer's checkpoint, where it cannot read --model (e.g. the same DiT linked "
        "with one-layer text encoders: the peer holds the DiT and its text encoders in host memory)",
    )
    p.add_argument("--df11-model", help="the lossless compressed copy of --model (`k6fast quantize --format df11`): "
                   "--df11-arms run on it too, each held to bit-identical latents with its BF16 run")  # fmt: skip
    p.add_argument("--df11-arms", type=list_of, help="arms also run on --df11-model, warm, and beside the ballast "
                   "where they have a ballast run (default: reference and final, where --arms has them)")  # fmt: skip
    p.add_argument("--geometry", default="w1", help="w1 (864x480x121) or WIDTHxHEIGHTxFRAMES")
    p.add_argument("--steps", type=int, help="denoising steps (default: the checkpoint's)")
    p.add_argument("--guidance", type=float, help="CFG scale (default: the checkpoint's)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--stop-after-steps", type=int, help="every run (the peer's too) denoises only the schedule's "
                   "first N steps: a long schedule's per-step cost, e.g. the 50-step base checkpoints'")  # fmt: skip
    p.add_argument("--peer-stop-after-steps", type=int, help="the peer's own N where it differs from "
                   "--stop-after-steps (at least 2: its projection needs a step after its first)")  # fmt: skip
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
    return {"gpus": gpu_inventory(), "versions": versions, "checkpoint_note": note, "python": sys.version.split()[0],
            "text_encoders": text_encoder_note(Path(model))}  # fmt: skip


def filesystem_type(path: Path, mounts: str = "/proc/mounts") -> str | None:
    """The type of the filesystem holding `path` (tmpfs: RAM-backed), from the longest mount point above it."""
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        return None
    best, kind = "", None
    for line in lines:
        fields = line.split()
        if len(fields) >= 3:
            point = fields[1].replace("\\040", " ")
            inside = str(path) == point or str(path).startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best):
                best, kind = point, fields[2]
    return kind


def text_encoder_note(model: Path) -> dict | None:
    """Which text encoders a run reads: the synthetic kind (`synthetic.json`), their bytes, the folder they are read
    from (through links), its filesystem (a RAM-backed tmpfs reads nothing from disk) and whether it is linked."""
    folders = [model / name for name in ("text_encoder", "text_encoder_2") if (model / name).is_dir()]
    if not folders:
        return None
    resolved = [f.resolve() for f in folders]
    marker = model / "synthetic.json"
    synthetic = json.loads(marker.read_text()).get("text_encoders") if marker.is_file() else None
    return {
        "synthetic": synthetic,
        "bytes": sum(f.stat().st_size for folder in resolved for f in folder.glob("*.safetensors")),
        "folder": str(resolved[0].parent),
        "filesystem": filesystem_type(resolved[0]),
        "linked": any(f.is_symlink() for f in folders),
    }


def check_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments on their own (no checkpoint read, nothing imported but the switch registry),
    or None: a bad arm, peer or number fails now, not in the run that reaches it minutes later."""
    from ..cli_args import seed_problem
    from ..switches import SwitchError, read_arm, resolve_arm
    from .peers import PEER_ARMS

    if args.make_synthetic:
        from ..testing.synthetic import PRESETS

        if args.make_synthetic not in PRESETS:
            return f"--make-synthetic {args.make_synthetic!r}: expected one of {', '.join(PRESETS)}"
    if args.text_encoder_dir and args.text_encoders != "full":
        return "--text-encoder-dir holds full-size text encoders; add --text-encoders full"
    if args.peer not in (*PEER_ARMS, "none"):
        return f"--peer {args.peer!r}: expected one of {', '.join(PEER_ARMS)} or none"
    for arm in args.arms:
        try:
            read_arm(resolve_arm(arm))
        except SwitchError as exc:
            return f"--arms: {exc}"
    if args.steps is not None and args.steps < 1:
        return f"--steps: expected an integer >= 1, found {args.steps}"
    if args.stop_after_steps is not None and args.stop_after_steps < 1:
        return f"--stop-after-steps: expected an integer >= 1, found {args.stop_after_steps}"
    if args.peer_stop_after_steps is not None and args.peer_stop_after_steps < 2:
        return f"--peer-stop-after-steps: expected an integer >= 2, found {args.peer_stop_after_steps}"
    if args.guidance is not None and not (math.isfinite(args.guidance) and args.guidance >= 1.0):
        return f"--guidance: expected a finite number >= 1.0 (1.0 = no CFG), found {args.guidance}"
    problem = seed_problem(args.seed)
    return f"--seed: {problem}" if problem else None


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
    problem = check_arguments(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    model = Path(args.model)
    made = None
    if args.make_synthetic and not (model / "model_index.json").is_file():
        from ..testing.synthetic import make_synthetic

        start = time.perf_counter()
        make_synthetic(model, preset=args.make_synthetic, text_encoders=args.text_encoders,
                       text_encoder_dir=args.text_encoder_dir)  # fmt: skip
        made = time.perf_counter() - start
        print(f"acceptance: wrote the synthetic checkpoint in {made:.1f} s", file=sys.stderr)
    if args.peer_model and not (Path(args.peer_model) / "model_index.json").is_file():
        print(f"error: --peer-model {args.peer_model}: expected a checkpoint folder with model_index.json",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.df11_model:
        try:
            compression = open_checkpoint(args.df11_model).compression
        except (OSError, ValueError) as exc:
            compression = f"unreadable ({exc})"
        if compression != "df11":
            print(f"error: --df11-model {args.df11_model}: expected a checkpoint written by `k6fast quantize --format "
                  f"df11`, found {compression or 'a BF16 one'}", file=sys.stderr)  # fmt: skip
            return 2
    arms = sorted(args.arms, key=lambda a: a != REFERENCE_ARM)  # the reference first: every arm is held against it
    peer = None if args.peer == "none" else args.peer
    missing = sorted(set(args.df11_arms or ()) - set(arms))
    if args.df11_model and missing:
        print(f"error: --df11-arms {','.join(missing)}: expected arms of --arms ({','.join(arms)}): a compressed run "
              "is held to the same run on the BF16 checkpoint", file=sys.stderr)  # fmt: skip
        return 2
    chosen = args.df11_arms or DEFAULT_DF11_ARMS
    df11_arms = [arm for arm in arms if arm in chosen] if args.df11_model else []
    runs = build_plan(arms, args.budgets, ballast_arms=args.ballast_arms, host_ram_gb=args.host_ram_gb or None,
                      peer=peer, df11_arms=df11_arms)  # fmt: skip
    if args.only:
        unknown = set(args.only) - {r.slug for r in runs}
        if unknown:
            print(f"error: --only {sorted(unknown)}: expected run slugs of the plan: "
                  f"{', '.join(r.slug for r in runs)}", file=sys.stderr)  # fmt: skip
            return 2
        runs = [r for r in runs if r.slug in args.only]
    # Only the peer runs: the checkpoint's defaults come from the copy it reads, so that the main checkpoint's large
    # text encoders may already be gone (a lease frees their RAM-backed folder before the peer, which needs the room).
    # Only compressed runs: from the compressed copy, so that the BF16 DiT may be gone (a lease makes room for it).
    defaults_from = model
    if args.peer_model and all(r.peer for r in runs):
        defaults_from = args.peer_model
    elif args.df11_model and all(r.checkpoint == "df11" for r in runs):
        defaults_from = args.df11_model
    ckpt = open_checkpoint(str(defaults_from))
    workload = Workload(
        model=str(model), geometry=geometry.label(), prompt=args.prompt or DEFAULT_PROMPT, seed=args.seed,
        steps=args.steps or ckpt.default_steps,
        guidance=args.guidance if args.guidance is not None else ckpt.default_guidance,
        peer_model=args.peer_model or "", df11_model=args.df11_model or "", stop_after_steps=args.stop_after_steps,
        peer_stop_after_steps=args.peer_stop_after_steps,
    )  # fmt: skip
    for option, value in (("--stop-after-steps", workload.stop_after_steps),
                          ("--peer-stop-after-steps", workload.peer_stop_after_steps)):  # fmt: skip
        if value and value > workload.steps:
            print(f"error: {option} {value}: expected at most the {workload.steps} steps the runs take",
                  file=sys.stderr)  # fmt: skip
            return 2
    out = Path(args.out or f"measurements/sessions/{dt.date.today().isoformat()}_acceptance")
    # The variant is what README's results group records by (a path is per machine; the copies share the DiT's).
    header = _header(str(model)) | {"synthetic_write_s": made, "variant": ckpt.variant}
    if args.peer_model:
        header["peer_text_encoders"] = text_encoder_note(Path(args.peer_model))
    try:
        run_acceptance(runs, workload, out=out, work=Path(args.work), timeout_s=args.timeout, header=header)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"acceptance: the table is {out / 'README.md'}", file=sys.stderr)
    return 0
