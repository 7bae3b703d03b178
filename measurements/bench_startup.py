"""Start-up and teardown of k6fast's commands on this machine: what each command's modules cost to import, and a tiny
checkpoint's `k6fast generate` run both ways a process can end.

    python measurements/bench_startup.py --model /tmp/k6-tiny --runs 3 --out startup.json
    # on a GPU machine, a synthetic checkpoint, one request size, the generate runs only:
    python measurements/bench_startup.py --model /tmp/syn --size 864x480 --frames 121 --no-imports --out gpu.json
    # the generate path's imports only, with and without bytecode to read, and the modules that cost the most:
    cd /tmp && python /path/to/measurements/bench_startup.py --generate-imports --without-bytecode --out imports.json

- imports: `python -X importtime -c "import M"` per module set a command loads before its work (the parse and the
  checks of every command, the generate path, the bench and acceptance parents, quantize's checks; only the generate
  path with `--generate-imports`), `--runs` times each: the imports' wall time (the outermost entries, Python's own
  start aside), the process's processor time, whether PyTorch was imported, and of the last run the self time per
  top-level package, the modules with the largest self times and how many modules the process compiled from source
  (`k6fast.telemetry.bytecode_compiled`: no .pyc to read). `--without-bytecode` runs each set again with an empty
  bytecode folder that nothing is written to (PYTHONPYCACHEPREFIX, PYTHONDONTWRITEBYTECODE): every module compiled,
  as in a process whose packages were installed without bytecode and cannot write it. Run it from a folder without a
  `k6fast` checkout in it (`cd /tmp`), so that the children import the installed k6fast.
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

GENERATE_PATH = "generate path (after its checks)"
IMPORTS = {
    "cli (every command's parse and checks)": "import k6fast.cli",
    GENERATE_PATH: "import k6fast.cli, k6fast.output, k6fast.pipeline, tqdm",
    "bench session parent": "import k6fast.cli, k6fast.bench.session, k6fast.bench.workload",
    "acceptance parent": "import k6fast.cli, k6fast.bench.acceptance, k6fast.bench.workload, k6fast.bench.peers",
    "quantize's checks": "import k6fast.cli, k6fast.quantize_check",
}
PROMPT = "A fox runs through snow"
TOP = 15  # modules listed by their own import time
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


# After the imports, the child prints which modules it compiled from source (no bytecode to read).
BYTECODE = (
    "; import json; from k6fast.telemetry import StartupClock, bytecode_compiled"
    "; print(json.dumps(bytecode_compiled(StartupClock().started)))"
)


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def import_profile(statement: str, bytecode: bool = True) -> dict:
    """bytecode: False = with an empty bytecode folder nothing is written to, every module compiled from source."""
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="k6fast-no-pyc-") as empty:
        if not bytecode:
            env |= {"PYTHONPYCACHEPREFIX": empty, "PYTHONDONTWRITEBYTECODE": "1"}
        cpu = _children_cpu_s()
        done = subprocess.run([sys.executable, "-X", "importtime", "-c", statement + BYTECODE], capture_output=True,
                              text=True, env=env)  # fmt: skip
        cpu = _children_cpu_s() - cpu
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
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
        "bytecode": bytecode,
        "import_s": round(top / 1e6, 3),
        "process_cpu_s": round(cpu, 3),
        "torch_imported": any(name == "torch" for _, _, name in rows),
        "modules": len(rows),
        "self_s_by_package": {k: round(v / 1e6, 3) for k, v in by_package.most_common(12)},
        "top_self_s": {name: round(own / 1e6, 3) for own, _, name in sorted(rows, reverse=True)[:TOP]},
        "compiled": json.loads(done.stdout.splitlines()[-1]),
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
    parser.add_argument("--model", help="a checkpoint (k6fast make-tiny DIR on the CPU); none: imports only")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--size", default="32x32", help="the request's WIDTHxHEIGHT (default 32x32)")
    parser.add_argument("--frames", default="9", help="the request's frames (default 9)")
    parser.add_argument("--steps", default="2", help="the request's steps (default 2)")
    parser.add_argument("--no-imports", action="store_true", help="the generate runs only")
    parser.add_argument("--generate-imports", action="store_true", help="of the import sets, the generate path's only")
    parser.add_argument("--without-bytecode", action="store_true", help="each import set again, compiled from source")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.model is None and args.no_imports:
        parser.error("--no-imports needs --model: nothing would run")
    versions = {name: _version(name) for name in ("torch", "diffusers", "transformers", "torchao", "triton", "k6fast")}
    repo = Path(__file__).resolve().parents[1]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=repo).stdout.strip()
    record = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_before": os.getloadavg()},
              "python": platform.python_version(), "versions": versions, "commit": commit,
              "writes_bytecode": not sys.flags.dont_write_bytecode,
              "command": " ".join(["python", *sys.argv]), "imports": {}, "generate": []}  # fmt: skip
    request = ["--prompt", PROMPT, "--size", args.size, "--frames", args.frames, "--steps", args.steps]
    record["request"] = request
    sets = {} if args.no_imports else {GENERATE_PATH: IMPORTS[GENERATE_PATH]} if args.generate_imports else IMPORTS
    for label, statement in sets.items():
        for bytecode in (True, False) if args.without_bytecode else (True,):
            runs = [import_profile(statement, bytecode) for _ in range(args.runs)]
            key = label if bytecode else f"{label}, without bytecode"
            record["imports"][key] = {**runs[-1], "statement": statement, "import_s": [r["import_s"] for r in runs],
                                      "process_cpu_s": [r["process_cpu_s"] for r in runs]}  # fmt: skip
            compiled = runs[-1]["compiled"]
            print(f"{key}: {[r['import_s'] for r in runs]} s, processor {[r['process_cpu_s'] for r in runs]} s, "
                  f"torch {runs[-1]['torch_imported']}, compiled from source {compiled['compiled']} of "
                  f"{compiled['source_modules']} modules {compiled['compiled_by_package']}", flush=True)  # fmt: skip
            if args.generate_imports:
                print(f"  self s by package: {runs[-1]['self_s_by_package']}\n  modules: {runs[-1]['top_self_s']}")
    with tempfile.TemporaryDirectory(prefix="k6fast-startup-") as tmp:
        for _ in range(args.runs if args.model else 0):
            for ends in ENDS:
                run = generate_once(args.model, Path(tmp), ends, request)
                record["generate"].append(run)
                print(f"generate, ends by {ends}: wall {run['wall_s']} s, after main {run['after_s']} s; processor "
                      f"{run['cpu_s']} s, after main {run['cpu_after_s']} s", flush=True)  # fmt: skip
    record["machine"]["load_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
