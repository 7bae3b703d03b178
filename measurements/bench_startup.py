"""Start-up and teardown of k6fast's commands on this machine: what each command's modules cost to import, and a tiny
checkpoint's `k6fast generate` run both ways a process can end.

    python measurements/bench_startup.py --model /tmp/k6-tiny --runs 3 --out startup.json
    # on a GPU machine, a synthetic checkpoint, one request size, the generate runs only:
    python measurements/bench_startup.py --model /tmp/syn --size 864x480 --frames 121 --no-imports --out gpu.json

- imports: `python -X importtime -c "import M"` per module set a command loads before its work (the parse and the
  checks of every command, the generate path, the bench and acceptance parents, quantize's checks), `--runs` times
  each: the imports' wall time (the outermost entries, Python's own start aside), the process's processor time,
  whether PyTorch was imported, and the self time per top-level package of the last run.
- teardown: the tiny generate through `main(argv)`, after which the process either ends as the `k6fast` command does
  (`entry.end_process`) or returns to the interpreter, which exits as Python does; alternated `--runs` times. For
  each: the wall and processor time seen from here, the process's own age and processor time when `main` returned,
  and the differences: what ending the process cost.
Processor time hardly moves with the machine's load, wall time does: on a shared machine read the processor time.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

IMPORTS = {
    "cli (every command's parse and checks)": "import k6fast.cli",
    "generate path (after its checks)": "import k6fast.cli, k6fast.output, k6fast.pipeline, tqdm",
    "bench session parent": "import k6fast.cli, k6fast.bench.session, k6fast.bench.workload",
    "acceptance parent": "import k6fast.cli, k6fast.bench.acceptance, k6fast.bench.workload, k6fast.bench.peers",
    "quantize's checks": "import k6fast.cli, k6fast.quantize_check",
}
PROMPT = "A fox runs through snow"
# `main(argv)`, then the process's age and processor time, then its end: {end}.
ENDING = (
    "import resource, sys; from k6fast.cli import main; from k6fast.entry import end_process\n"
    "from k6fast.telemetry import process_age_s\n"
    "code = main(sys.argv[1:]); r = resource.getrusage(resource.RUSAGE_SELF)\n"
    "print('AGE', process_age_s(), r.ru_utime + r.ru_stime, file=sys.stderr, flush=True); {end}"
)
ENDS = {"end_process": "end_process(code)", "interpreter": "sys.exit(code)"}


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def import_profile(statement: str) -> dict:
    cpu = _children_cpu_s()
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", statement], capture_output=True, text=True)
    cpu = _children_cpu_s() - cpu
    rows, top = [], 0
    for line in done.stderr.splitlines():
        if line.startswith("import time:") and "cumulative" not in line:
            own, cumulative, name = line.split("|")
            rows.append((int(own.split(":")[1]), int(cumulative), name.strip()))
            # Outermost imports only, less those of Python's own start (the standard library, .pth hooks).
            package = name.strip().split(".")[0]
            if name[1:2] != " " and package not in sys.stdlib_module_names and not package.startswith("_"):
                top += int(cumulative)
    by_package = collections.Counter()
    for own, _, name in rows:
        by_package[name.split(".")[0]] += own
    return {
        "import_s": round(top / 1e6, 3),
        "process_cpu_s": round(cpu, 3),
        "torch_imported": any(name == "torch" for _, _, name in rows),
        "modules": len(rows),
        "self_s_by_package": {k: round(v / 1e6, 3) for k, v in by_package.most_common(12)},
    }


def generate_once(model: str, out_dir: Path, ends: str, request: list[str]) -> dict:
    """request: generate's arguments besides --model and --out."""
    out = out_dir / f"{ends}.mp4"
    for path in (out, out.with_name(out.name + ".json")):
        path.unlink(missing_ok=True)
    command = [sys.executable, "-c", ENDING.format(end=ENDS[ends]), "generate", *request, "--model", model]
    command += ["--out", str(out)]
    cpu, start = _children_cpu_s(), time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - start, _children_cpu_s() - cpu
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    age, cpu_at_return = (
        float(v) for v in next(ln for ln in done.stderr.splitlines() if ln.startswith("AGE ")).split()[1:]
    )
    process = json.loads(out.with_name(out.name + ".json").read_text())["process"]
    return {"ends": ends, "wall_s": round(wall, 3), "age_at_return_s": age, "after_s": round(wall - age, 3),
            "cpu_s": round(cpu, 3), "cpu_after_s": round(cpu - cpu_at_return, 3), "process": process}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a checkpoint (k6fast make-tiny DIR on the CPU)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--size", default="32x32", help="the request's WIDTHxHEIGHT (default 32x32)")
    parser.add_argument("--frames", default="9", help="the request's frames (default 9)")
    parser.add_argument("--steps", default="2", help="the request's steps (default 2)")
    parser.add_argument("--no-imports", action="store_true", help="the generate runs only")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    versions = {name: metadata.version(name) for name in ("torch", "diffusers", "transformers", "k6fast")}
    repo = Path(__file__).resolve().parents[1]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=repo).stdout.strip()
    record = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_before": os.getloadavg()},
              "python": platform.python_version(), "versions": versions, "commit": commit,
              "command": " ".join(["python", *sys.argv]), "imports": {}, "generate": []}  # fmt: skip
    request = ["--prompt", PROMPT, "--size", args.size, "--frames", args.frames, "--steps", args.steps]
    record["request"] = request
    for label, statement in {} if args.no_imports else IMPORTS.items():
        runs = [import_profile(statement) for _ in range(args.runs)]
        record["imports"][label] = {"statement": statement, "import_s": [r["import_s"] for r in runs], **runs[-1]}
        print(f"{label}: {[r['import_s'] for r in runs]} s, processor {[r['process_cpu_s'] for r in runs]} s, "
              f"torch {runs[-1]['torch_imported']}", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="k6fast-startup-") as tmp:
        for _ in range(args.runs):
            for ends in ENDS:
                run = generate_once(args.model, Path(tmp), ends, request)
                record["generate"].append(run)
                print(f"generate, ends by {ends}: wall {run['wall_s']} s, after main {run['after_s']} s; processor "
                      f"{run['cpu_s']} s, after main {run['cpu_after_s']} s", flush=True)  # fmt: skip
    record["machine"]["load_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
