"""Where a warm process's first DiT step spends the seconds a steady step does not (issue #35: `final` warm, 8.91 s
against 6.49 s, 1.9 s of it counted as compile time: measurements/sessions/2026-12-02_acceptance-envelope4).

`k6fast generate` in this process (`k6fast.cli.main(argv)`, so the process does not end at its end) under cProfile,
with the compile caches a cold run of the same arm and geometry left (--cache-dir: what `K6_INDUCTOR_CACHE_DIR` names).
cProfile follows the main thread only, where the denoise and its compile run; the prefetch and text threads are not
in it. Written to --out: the profile's top functions by cumulative and by own time, Dynamo's compile-time table, and
the sidecar's step times (step 1 against step 2: cProfile's overhead is in both).

Run:  python measurements/profile_first_step.py --model CKPT --arm final --cache-dir CACHE --out first_step.txt
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
from pathlib import Path

from bench_common import warm_generate_arg_parser


def main() -> int:
    parser = warm_generate_arg_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="steps run, of the request's 10")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    os.environ["K6_INDUCTOR_CACHE_DIR"] = args.cache_dir
    os.environ["K6_VRAM_BUDGET_GB"] = f"{args.budget_gb:g}"
    from k6fast.bench.workload import parse_geometry

    geometry = parse_geometry(args.geometry)
    work = Path(tempfile.mkdtemp(prefix="first-step-"))
    argv = ["generate", "--model", args.model, "--arm", args.arm, "--prompt", "a first-step profile",
            "--steps", "10", "--stop-after-steps", str(args.steps), "--size", f"{geometry.width}x{geometry.height}",
            "--frames", str(geometry.frames),
            "--out", str(work / "clip.mp4"), "--prompt-cache", "none"]  # fmt: skip

    from k6fast.atomic import sidecar_path
    from k6fast.cli import main as k6_main

    profile = cProfile.Profile()
    code = profile.runcall(k6_main, argv)
    text = io.StringIO()
    text.write(f"k6fast generate exit {code}: {' '.join(argv)}\n")
    sidecar = sidecar_path(work / "clip.mp4")
    if sidecar.exists():
        telemetry = json.loads(sidecar.read_text())["telemetry"]
        text.write(f"step_s {telemetry['step_s']}  compile_s {telemetry['compile_s']}\n")
    try:
        from torch._dynamo.utils import compile_times

        text.write("\nDynamo's compile times:\n" + str(compile_times(repr="str")) + "\n")
    except (ImportError, TypeError) as exc:  # the table's API differs between releases: the profile is the record
        text.write(f"\nno compile-time table ({exc})\n")
    for key, count in (("cumulative", 90), ("tottime", 40)):
        text.write(f"\n=== by {key}\n")
        pstats.Stats(profile, stream=text).strip_dirs().sort_stats(key).print_stats(count)
    args.out.write_text(text.getvalue())
    print(text.getvalue()[:4000])
    return code


if __name__ == "__main__":
    sys.exit(main())
