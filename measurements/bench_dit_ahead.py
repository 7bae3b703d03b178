"""What building the DiT beside the library imports saves (`K6_DIT_AHEAD`, issue #35's process wall): fresh `k6fast
generate --arm ARM` processes with the switch on and off in mirrored order (on, off, off, on, ...), after one not
counted (--warmup: it fills the compile caches where the cold run left none, and the page cache), each with the
arm's compile caches (--cache-dir, what a cold run of the arm leaves), the acceptance's prompt, no prompt cache,
and the schedule's first --stop-after-steps steps only (what differs is before the request). Each process's sidecar
gives its wall clock (`process.ended_at_s`), its load (`load_s`, and `load_overlapped_s`: the load's seconds beside
the imports), its request, and the rest: the process outside its request (`outside_request_s`), beside the wall time
of the whole process (`wall_s`, the interpreter's start and exit included); --out gets every process's figures and
the median per side. One session, one machine: the acceptance's rows come from different machines,
whose imports alone differed by 2 s (measurements/sessions/2026-12-03_acceptance-df11-levers).

Run:  python measurements/bench_dit_ahead.py --model CKPT --arm final --cache-dir CACHE --pairs 2 --out dit_ahead.json
      (a CPU dry run: --model TINY --geometry 64x64x5 --device cpu)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import warm_generate_arg_parser

SIDES = ("on", "off")
FIGURES = ("wall_s", "ended_at_s", "outside_request_s", "load_s", "load_overlapped_s", "request_s")


def figures(sidecar: dict) -> dict[str, float]:
    process = sidecar["process"]
    outside = round(process["ended_at_s"] - process["request_s"], 4)
    return {"ended_at_s": process["ended_at_s"], "outside_request_s": outside, "load_s": sidecar["load_s"],
            "load_overlapped_s": process["load_overlapped_s"], "request_s": process["request_s"]}  # fmt: skip


def main() -> int:
    parser = warm_generate_arg_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2, help="processes per side")
    parser.add_argument("--warmup", type=int, default=1, help="processes run first and not counted")
    parser.add_argument("--stop-after-steps", type=int, default=2, help="denoising steps each process runs")
    parser.add_argument("--device", help="generate's --device (default: its own)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.pairs < 1 or args.warmup < 0:
        parser.error(f"expected --pairs >= 1 and --warmup >= 0, found {args.pairs} and {args.warmup}")
    from k6fast.atomic import sidecar_path
    from k6fast.bench.records import DEFAULT_PROMPT
    from k6fast.bench.session import visit_order
    from k6fast.bench.stats import median
    from k6fast.bench.workload import parse_geometry

    geometry = parse_geometry(args.geometry)
    work = Path(tempfile.mkdtemp(prefix="dit-ahead-"))
    base = {k: v for k, v in os.environ.items() if not k.startswith("K6_")}
    base |= {"K6_INDUCTOR_CACHE_DIR": args.cache_dir, "K6_VRAM_BUDGET_GB": f"{args.budget_gb:g}"}
    # The bench's mirrored order (on, off, off, on, ...), cut to --pairs a side: a drift over the session cancels.
    mirrored = [side for side, _, _ in visit_order(SIDES, "ABBA", repeats=(args.pairs + 1) // 2)][: 2 * args.pairs]
    runs = []
    for i, side in enumerate(["on"] * args.warmup + mirrored):
        out = work / f"{i}-{side}.mp4"
        argv = [sys.executable, "-m", "k6fast.cli", "generate", "--model", args.model, "--arm", args.arm,
                "--prompt", DEFAULT_PROMPT, "--size", f"{geometry.width}x{geometry.height}",
                "--frames", str(geometry.frames), "--out", str(out), "--prompt-cache", "none",
                "--stop-after-steps", str(args.stop_after_steps),
                *(["--device", args.device] if args.device else [])]  # fmt: skip
        start = time.perf_counter()
        done = subprocess.run(argv, env=base | {"K6_DIT_AHEAD": side}, capture_output=True, text=True, cwd=work)
        wall_s = time.perf_counter() - start  # the interpreter's start and exit too
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            print(f"error: process {i} ({side}) exited {done.returncode}", file=sys.stderr)
            return 1
        run = {"process": i, "side": side, "wall_s": wall_s, **figures(json.loads(sidecar_path(out).read_text()))}
        print(json.dumps(run), flush=True)
        if i >= args.warmup:
            runs.append(run)
    medians = {side: {k: median([r[k] for r in runs if r["side"] == side]) for k in FIGURES} for side in SIDES}
    result = {"argv": sys.argv, "model": args.model, "arm": args.arm, "geometry": args.geometry,
              "budget_gb": args.budget_gb, "runs": runs, "median": medians,
              "stop_after_steps": args.stop_after_steps,
              "saved_s": medians["off"]["outside_request_s"] - medians["on"]["outside_request_s"]}  # fmt: skip
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    on, off = medians["on"]["outside_request_s"], medians["off"]["outside_request_s"]
    print(f"median process outside its request: on {on:.2f} s, off {off:.2f} s (saved {result['saved_s']:.2f} s); "
          f"written to {args.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
