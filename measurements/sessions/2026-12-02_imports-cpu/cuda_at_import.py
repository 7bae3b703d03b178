"""Which imports of the generate path ask CUDA about the GPU, on a machine without one: torch.cuda's queries are
replaced by stand-ins that answer as an H200 would (available, one device, capability 9.0), so code that asks only
where a GPU is present runs here too, and each query made while STATEMENT imports is listed with the frames that led
to it. A query that needs the device's properties (`get_device_capability`, `get_device_properties`,
`current_device`) starts CUDA on a real GPU (`torch.cuda._lazy_init`); `is_available` and `device_count` do not.

    cd /tmp && PYTHONPATH=<k6fast> python cuda_at_import.py --out cuda_at_import.json
"""

from __future__ import annotations

import argparse
import collections
import json
import traceback

import torch
import torch.cuda

GENERATE_PATH = "import k6fast.cli, k6fast.output, k6fast.pipeline, tqdm"


class H200Properties:
    name = "NVIDIA H200"
    major, minor = 9, 0
    total_memory = 143771 * 2**20
    multi_processor_count = 132
    gcnArchName = ""
    warp_size = 32
    L2_cache_size = 60 * 2**20


ANSWERS = {
    "is_available": True,
    "device_count": 1,
    "get_device_capability": (9, 0),
    "get_device_properties": H200Properties(),
    "get_device_name": "NVIDIA H200",
    "current_device": 0,
    "is_bf16_supported": True,
    "init": None,
    "_lazy_init": None,
    "mem_get_info": (140 * 2**30, 143771 * 2**20),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--statement", default=GENERATE_PATH)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    calls: collections.Counter[tuple[str, str]] = collections.Counter()
    chains: dict[tuple[str, str], list[str]] = {}

    def stand_in(name: str, answer):
        def query(*_args, **_kwargs):
            frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.startswith("<frozen")]
            where = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in frames]
            key = (name, where[-1])
            calls[key] += 1
            chains.setdefault(key, where[-8:])
            return answer

        return query

    for name, answer in ANSWERS.items():
        setattr(torch.cuda, name, stand_in(name, answer))
    exec(args.statement)  # noqa: S102 - the statement under test
    starts_cuda = {"get_device_capability", "get_device_properties", "current_device", "init", "_lazy_init"}
    rows = [{"query": name, "at": at, "calls": n, "starts_cuda": name in starts_cuda, "chain": chains[(name, at)]}
            for (name, at), n in calls.most_common()]  # fmt: skip
    with open(args.out, "w") as f:
        json.dump({"statement": args.statement, "torch": torch.__version__, "queries": rows}, f, indent=1)
        f.write("\n")
    for row in rows:
        print(f"{row['calls']} x {row['query']} at {row['at']}{' (starts CUDA)' if row['starts_cuda'] else ''}")


if __name__ == "__main__":
    main()
