"""Shared by the tests that run the command line in a fresh process (`python -X importtime -m k6fast.cli ...`):
`run_cli` runs it and reads what it imported from the import log; `assert_refused` holds a refused command to what
every error of the command line must be.

A refusal exits with status 2, its stderr is the one `error: ...` line, no heavy package (PyTorch, diffusers,
transformers) appears in its import log, and it writes nothing. The import log, not the wall time, is what is
asserted: a busy machine makes a tight time bound flaky, while one heavy import is already most of the time the
command is allowed. Each refusal is also held to CPU_BOUND_S of the processor time its process used, which catches
a heavy path the import log cannot name: `import torch` alone uses 2.3-3.4 s of it on a 2-core machine, idle or at a
load of 15-22. The bound is not the issue's 1 s: processor time moves less than wall time with the load, but it moves
with the host (and where PYTHONDONTWRITEBYTECODE is set, as on these machines, every process compiles k6fast's
modules again): the slowest error cases used 0.4-0.6 s of it with only these tests running and 1.04-1.22 s beside
the rest of the suite in a CI run of 2026-12-03 (which took 1.6 times the eighth session's). What the errors cost is
a record's (measurements/sessions/2026-12-03_ci-session10); a loose wall bound, WALL_BOUND_S, catches a hang.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from collections.abc import Collection, Mapping
from pathlib import Path

HEAVY = ("torch", "diffusers", "transformers")
IMPORT_LOG = "import time:"
CPU_BOUND_S = 2.0  # processor time (user + system) of a refusing process: below one `import torch`
WALL_BOUND_S = 60.0  # a command that waits on something, whatever the machine's load


def run_cli(
    args: list[str], cwd, env: Mapping[str, str] | None = None, module: str = "k6fast.cli"
) -> tuple[subprocess.CompletedProcess, list[str], list[str]]:
    """(the finished process, its stderr without the import log, the heavy packages it imported). The process runs
    without the caller's K6_* switches, with `env` added; its wall time is `done.wall_s`, its processor time
    `done.cpu_s` (both appended to the file CLI_TIMES_LOG names, where it is set)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("K6_")} | dict(env or {})
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", module, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=environ,
        timeout=120,
    )
    done.wall_s = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the one child reaped since `before`
    done.cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if os.environ.get("CLI_TIMES_LOG"):  # a record of what each command cost (the bounds are only guards)
        with open(os.environ["CLI_TIMES_LOG"], "a", encoding="utf-8") as log_file:
            log_file.write(f"{done.cpu_s:.3f}\t{done.wall_s:.3f}\t{' '.join(args[:2])}\n")
    log = done.stderr.splitlines()
    imported = [line.rsplit("|", 1)[1].strip() for line in log if line.startswith(IMPORT_LOG)]
    heavy = sorted({name for name in imported if name.split(".")[0] in HEAVY})
    return done, [line for line in log if not line.startswith(IMPORT_LOG)], heavy


def assert_refused(
    args: list[str],
    env: Mapping[str, str],
    words: str,
    tmp_path: Path,
    names: Mapping[str, str] | None = None,
    *,
    may_import: Collection[str] = (),
) -> None:
    """Run `k6fast ARGS` (with the switches `env`) in a new empty folder, {here} (`tmp_path`/cwd), and hold its refusal
    to the rules above: status 2, one `error: ` line holding `words`, no heavy import, {here} still empty, and the
    time bounds. `args` and `words` may name {placeholders} from `names`, and {here}. `may_import`: heavy packages the
    refusal must import to decide (PyTorch, to count the GPUs), which also lifts the processor-time bound (importing
    one is seconds of it)."""
    here = tmp_path / "cwd"
    here.mkdir()
    names = dict(names or {}) | {"here": str(here)}
    args, words = [a.format(**names) for a in args], words.format(**names)
    done, stderr, heavy = run_cli(args, here, env)
    command = "k6fast " + " ".join(args)
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(stderr) == 1 and stderr[0].startswith("error: ") and words in stderr[0], stderr
    imported = [m for m in heavy if m.split(".")[0] not in may_import]
    assert imported == [], f"{command} imported {imported[:5]} before refusing"
    assert list(here.iterdir()) == [], f"{command} wrote into its folder before refusing"
    if not may_import:
        assert done.cpu_s < CPU_BOUND_S, f"{command} used {done.cpu_s:.2f} s of processor time to refuse"
    assert done.wall_s < WALL_BOUND_S, f"{command} took {done.wall_s:.1f} s to refuse"
