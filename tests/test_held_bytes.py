"""`allocator.held_bytes`: what the caching allocator would still hold after `empty_cache`, read from its snapshot
without giving anything back (the video decode reuses the DiT's mapped memory): the pages an allocated block touches
in an expandable segment, a fixed segment whole while any block in it is allocated, None for a snapshot it cannot
read. On a GPU: the count against what `empty_cache` really leaves."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from k6fast import allocator
from k6fast.allocator import EXPANDABLE_PAGE, held_after_release, held_bytes

MiB = 1 << 20
BASE = 7 * 1024 * MiB  # a segment's address; pages count from it


def _block(offset_mib: float, size_mib: float, state: str = "active_allocated") -> dict:
    return {"address": BASE + int(offset_mib * MiB), "size": int(size_mib * MiB), "state": state}


def _segment(blocks: list[dict], total_mib: int, expandable: bool = True, pool: str = "large") -> dict:
    return {"device": 0, "address": BASE, "total_size": total_mib * MiB, "is_expandable": expandable,
            "segment_type": pool, "segment_pool_id": (0, 0), "blocks": blocks}  # fmt: skip


def test_an_expandable_segment_holds_the_pages_its_allocated_blocks_touch() -> None:
    page = EXPANDABLE_PAGE["large"]
    assert page == 20 * MiB
    blocks = [
        _block(0, 1),  # page 0
        _block(1, 40, "inactive"),  # free: given back where whole pages are free
        _block(45, 1),  # page 2
        _block(59, 2, "active_pending_free"),  # pages 2 and 3: freed, its stream's events not yet done
        _block(61, 39, "inactive"),
    ]
    assert held_bytes([_segment(blocks, 100)]) == 3 * page
    assert held_bytes([_segment([_block(0, 100, "inactive")], 100)]) == 0  # all free: all given back
    small = _segment([_block(0, 0.5), _block(3, 0.5)], 4, pool="small")  # the small pool maps 2 MiB pages
    assert held_bytes([small]) == 2 * EXPANDABLE_PAGE["small"] == 4 * MiB


def test_a_fixed_segment_is_held_whole_while_any_block_in_it_is_allocated() -> None:
    used = _segment([_block(0, 1), _block(1, 99, "inactive")], 100, expandable=False)
    free = _segment([_block(0, 100, "inactive")], 100, expandable=False)
    assert held_bytes([used, free]) == 100 * MiB
    assert held_bytes([]) == 0
    graph = {**_segment([_block(0, 100, "inactive")], 100), "segment_pool_id": (1, 0)}  # a CUDA graph's private pool
    assert held_bytes([graph]) == 100 * MiB


def test_pages_of_another_size_give_none() -> None:
    assert held_bytes([_segment([_block(0, 1)], 64)]) is None  # large_segment_size_mb:64 maps 64 MiB pages


@pytest.mark.parametrize("missing", ["is_expandable", "blocks", "segment_type", "segment_pool_id"])
def test_a_snapshot_without_what_it_needs_gives_none(missing: str) -> None:
    segment = _segment([_block(0, 1)], 100)
    del segment[missing]
    assert held_bytes([segment]) is None


def test_only_under_a_cap_and_default_pages(monkeypatch) -> None:
    device = torch.device("cuda", 0)
    other = {**_segment([_block(0, 1)], 20), "device": 1}
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: [_segment([_block(0, 1)], 100), other])
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 0.25, raising=False)
    for name in ("PYTORCH_ALLOC_CONF", allocator.ENV):
        monkeypatch.delenv(name, raising=False)
    assert held_after_release(device) == EXPANDABLE_PAGE["large"]  # this device's segments only
    monkeypatch.setenv(allocator.ENV, "expandable_segments:True,large_segment_size_mb:64")
    assert held_after_release(device) is None
    monkeypatch.delenv(allocator.ENV)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)
    assert held_after_release(device) is None  # no cap: the allocator would not give its pages back at the budget


# Run in a process of its own: the allocator's segment kind is the process's (PYTORCH_CUDA_ALLOC_CONF).
GPU_CHECK = """
import json, torch
from k6fast.allocator import held_bytes
MiB = 1 << 20
device, side = torch.device("cuda", torch.cuda.current_device()), torch.cuda.Stream()
hole = [torch.empty(40 * MiB, dtype=torch.uint8, device=device) for _ in range(3)]
del hole[1]
torch.cuda.empty_cache()  # an unmapped hole: the segment is reported as two mapped ranges
hole.append(torch.empty(5 * MiB, dtype=torch.uint8, device=device))
kept = [torch.empty(n * MiB + 4096, dtype=torch.uint8, device=device) for n in (30, 7, 1)]
freed = [torch.empty(n * MiB, dtype=torch.uint8, device=device) for n in (200, 45, 3)]
with torch.cuda.stream(side):  # a second stream's blocks: segments of their own
    kept.append(torch.empty(64 * MiB, dtype=torch.uint8, device=device))
    freed.append(torch.empty(120 * MiB, dtype=torch.uint8, device=device))
torch.cuda.synchronize()
del freed
segments = [s for s in torch.cuda.memory_snapshot() if s["device"] == device.index]
held = held_bytes(segments)
active = sum(b["state"] != "inactive" for s in segments for b in s["blocks"])
kinds = sorted({s["is_expandable"] for s in segments})
torch.cuda.empty_cache()
print(json.dumps({"held": held, "left": torch.cuda.memory_reserved(device), "active": active, "kinds": kinds}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("expandable", [True, False])
def test_gpu_held_bytes_is_what_empty_cache_leaves(expandable: bool) -> None:
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": f"expandable_segments:{expandable}"}
    out = subprocess.run([sys.executable, "-c", GPU_CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["kinds"] == [expandable]
    # Never less than empty_cache leaves (the decode's plan would overrun the budget); at most the partial pages over.
    assert r["left"] <= r["held"] <= r["left"] + 2 * EXPANDABLE_PAGE["large"] * r["active"]
