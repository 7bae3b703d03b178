"""Host→device copy bandwidth: what the weight stream can get out of the PCIe link.

Variants, each checked for correctness (the device bytes equal the source bytes) before it is timed:
  pinned          a pinned host buffer → device, one `copy_` per chunk (the ceiling)
  pageable        an ordinary host buffer → device (the driver bounces it through its own pinned memory)
  mmap_staged     a safetensors file mapped read-only → a two-slot pinned staging ring (memcpy on the CPU) →
                  device on a copy stream; the CPU fill of one slot overlaps the DMA of the other
  pread_staged    the same file read with os.preadv straight into the pinned slots (no mapping at all)
Chunk sizes 64 MiB to 1 GiB. The file variants read the file once untimed (correctness), so the timed passes come
from the page cache: they measure the copy path, not the disk. Figures are GB/s (10^9 bytes/s) at p20/p50/p80;
the pinned copy rate the streaming records saw on the H200: measurements/sessions/2026-11-29_streaming.

Run:  python measurements/bench_stream_copy.py --out stream_copy.json
      (--sizes 64,256,1024 in MiB, --repeats N, --file some.safetensors to read a real checkpoint shard)
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import mmap
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

MIB = 2**20
SIZES_MIB = (64, 128, 256, 512, 1024)
SLOT_BYTES = 64 * MIB  # staging slot: large enough to keep the DMA engine busy, small enough to allocate once
REFERENCE_GBPS = {"pinned": 54.0, "pageable": 19.0}


def percentiles(samples: list[float]) -> dict[str, float]:
    """p20/p50/p80 (linear interpolation) of a list of GB/s figures."""
    if not samples:
        raise ValueError("expected at least one sample")
    p20, p50, p80 = np.percentile(np.asarray(samples, dtype=np.float64), [20, 50, 80])
    return {"p20": float(p20), "p50": float(p50), "p80": float(p80)}


def environment() -> dict:
    props = torch.cuda.get_device_properties(0)
    versions = {}
    for name in ("torch", "numpy", "safetensors", "k6fast"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "gpu": props.name,
        "capability": f"sm_{props.major}{props.minor}",
        "cuda": torch.version.cuda,
        "versions": versions,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def random_bytes(nbytes: int, seed: int = 0) -> torch.Tensor:
    """uint8 [nbytes] of random content (a 1 MiB random block tiled with a varying offset: fast to make, and no
    two chunks are equal, so a chunk written to the wrong place fails the check)."""
    g = np.random.default_rng(seed)
    block = g.integers(0, 256, size=MIB, dtype=np.uint8)
    out = np.empty(nbytes, dtype=np.uint8)
    for i, start in enumerate(range(0, nbytes, MIB)):
        n = min(MIB, nbytes - start)
        out[start : start + n] = np.roll(block, i)[:n]
    return torch.from_numpy(out)


def host_to_device(src: torch.Tensor, dst: torch.Tensor) -> float:
    """Seconds for one synchronised copy of `src` (host) into `dst` (device)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    dst.copy_(src, non_blocking=src.is_pinned())
    torch.cuda.synchronize()
    return time.perf_counter() - start


def bench_host(size: int, pinned: bool, repeats: int) -> dict:
    src = random_bytes(size, seed=size)
    if pinned:
        src = src.pin_memory()
    dst = torch.empty(size, dtype=torch.uint8, device="cuda")
    host_to_device(src, dst)
    if not torch.equal(dst.cpu(), src):
        raise AssertionError(f"{'pinned' if pinned else 'pageable'} copy of {size} bytes: device bytes differ")
    gbps = [size / host_to_device(src, dst) / 1e9 for _ in range(repeats)]
    return {"variant": "pinned" if pinned else "pageable", "bytes": size, **percentiles(gbps)}


class StagingRing:
    """Two pinned slots of `slot_bytes` (allocated once: the pinned allocator rounds every allocation up to a power
    of two) and a copy stream; on a CPU device, plain buffers and synchronous copies."""

    def __init__(self, slot_bytes: int, device: torch.device):
        self.device = device
        cuda = device.type == "cuda"
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
        self.views = [slot.numpy() for slot in self.slots]
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.done: list[torch.cuda.Event | None] = [None, None]

    def copy_file(self, path: Path, dst: torch.Tensor, offset: int, nbytes: int, use_mmap: bool) -> None:
        """Copy bytes [offset, offset + nbytes) of the file into `dst` (uint8 [nbytes] on the device)."""
        slot_bytes = self.slots[0].numel()
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if use_mmap else None
            try:
                for i, start in enumerate(range(0, nbytes, slot_bytes)):
                    k, n = i % 2, min(slot_bytes, nbytes - start)
                    if self.done[k] is not None:
                        self.done[k].synchronize()  # the DMA that last read this slot has finished
                    view = self.views[k][:n]
                    if mapped is not None:
                        view[:] = np.frombuffer(mapped, dtype=np.uint8, count=n, offset=offset + start)
                    elif os.preadv(f.fileno(), [memoryview(view)], offset + start) != n:
                        raise OSError(f"{path}: short read at byte {offset + start}")
                    self._upload(k, dst[start : start + n], n)
                if self.stream is not None:
                    self.stream.synchronize()
            finally:
                if mapped is not None:
                    mapped.close()

    def _upload(self, k: int, target: torch.Tensor, n: int) -> None:
        if self.stream is None:
            target.copy_(self.slots[k][:n])
            return
        with torch.cuda.stream(self.stream):
            target.copy_(self.slots[k][:n], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.done[k] = event


def safetensors_payload(path: Path) -> tuple[int, int]:
    """(offset, nbytes) of the tensor data of a safetensors file: everything after its header."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
    start = 8 + header_len
    return start, path.stat().st_size - start


def write_test_file(folder: Path, nbytes: int) -> Path:
    from safetensors.torch import save_file

    path = folder / "stream_copy.safetensors"
    save_file({"payload": random_bytes(nbytes, seed=7)}, str(path))
    return path


def bench_file(path: Path, use_mmap: bool, repeats: int, ring: StagingRing) -> dict:
    offset, nbytes = safetensors_payload(path)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=ring.device)
    ring.copy_file(path, dst, offset, nbytes, use_mmap)
    expected = torch.from_numpy(np.fromfile(path, dtype=np.uint8, count=nbytes, offset=offset))
    if not torch.equal(dst.cpu(), expected):
        raise AssertionError(f"{'mmap' if use_mmap else 'pread'} staged copy of {path}: device bytes differ")
    gbps = []
    for _ in range(repeats):
        start = time.perf_counter()
        ring.copy_file(path, dst, offset, nbytes, use_mmap)
        gbps.append(nbytes / (time.perf_counter() - start) / 1e9)
    return {"variant": "mmap_staged" if use_mmap else "pread_staged", "bytes": nbytes, **percentiles(gbps)}


def print_table(env: dict, results: list[dict]) -> None:
    print(f"{env['gpu']} ({env['capability']}), torch {env['versions']['torch']}, CUDA {env['cuda']}")
    print(f"{'variant':<14}{'MiB':>8}{'p20 GB/s':>11}{'p50 GB/s':>11}{'p80 GB/s':>11}{'H200 ref':>10}")
    for r in results:
        ref = REFERENCE_GBPS.get(r["variant"])
        ref_text = f"{ref:.0f}" if ref else ""
        mib = r["bytes"] / MIB
        print(f"{r['variant']:<14}{mib:>8.0f}{r['p20']:>11.1f}{r['p50']:>11.1f}{r['p80']:>11.1f}{ref_text:>10}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(map(str, SIZES_MIB)), help="chunk sizes in MiB")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--file", help="a safetensors file to stream (default: a temporary 1 GiB one)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: this benchmark measures host→device copies and needs a CUDA device; none found", file=sys.stderr)
        return 2
    sizes = [int(s) * MIB for s in args.sizes.split(",")]
    env = environment()
    results = [bench_host(size, pinned, args.repeats) for pinned in (True, False) for size in sizes]
    ring = StagingRing(SLOT_BYTES, torch.device("cuda"))
    with tempfile.TemporaryDirectory(prefix="k6fast-stream-copy-") as tmp:
        path = Path(args.file) if args.file else write_test_file(Path(tmp), max(sizes))
        results += [bench_file(path, use_mmap, args.repeats, ring) for use_mmap in (True, False)]
    print_table(env, results)
    if args.out:
        out = Path(args.out)
        tmp_out = out.with_name(f".{out.name}.tmp")
        tmp_out.write_text(json.dumps({"environment": env, "results": results}, indent=2) + "\n")
        os.replace(tmp_out, out)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
