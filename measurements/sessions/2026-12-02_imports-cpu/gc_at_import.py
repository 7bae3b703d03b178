"""What Python's cyclic garbage collector costs while the generate path imports: the imports' processor time with the
collector running (its collections counted and timed through gc.callbacks) and with it paused, then one full
collection, as `k6fast generate` now does (`k6fast.cli.collector_paused`). One fresh process per run, alternated.

    cd /tmp && PYTHONPATH=<k6fast> python gc_at_import.py --runs 3 --out gc_at_import.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = """
import gc, json, resource, sys, time
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
paused, events = sys.argv[1] == "paused", []
if paused:
    gc.disable()
else:
    gc.callbacks.append(lambda phase, info: events.append((phase, info["generation"], time.perf_counter())))
start = cpu()
import k6fast.cli, k6fast.output, k6fast.pipeline, tqdm
imports = cpu() - start
alive = len(gc.get_objects())
start = cpu()
freed = gc.collect() if paused else 0
collect = cpu() - start
in_gc = sum(t - s for (_, _, s), (_, _, t) in zip(events[::2], events[1::2]))
full = sum(1 for phase, generation, _ in events if phase == "start" and generation == 2)
row = {"collector": sys.argv[1], "imports_cpu_s": round(imports, 3), "collect_after_cpu_s": round(collect, 3)}
row |= {"collections": len(events) // 2, "full_collections": full, "in_collections_s": round(in_gc, 3)}
print(json.dumps(row | {"objects_after_imports": alive, "unreachable_found_after": freed}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = []
    for _ in range(args.runs):
        for collector in ("running", "paused"):
            done = subprocess.run([sys.executable, "-c", CHILD, collector], capture_output=True, text=True, check=True)
            rows.append(json.loads(done.stdout.splitlines()[-1]))
            print(rows[-1], flush=True)
    with open(args.out, "w") as f:
        json.dump({"runs": rows}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
