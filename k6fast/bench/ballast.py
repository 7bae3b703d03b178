"""A host-memory ballast: `python -m k6fast.bench.ballast --leave-gb 60` holds all but 60 GB (10^9 bytes) of the
host's memory in resident, locked anonymous pages until it is killed, so a run beside it sees what a consumer
machine leaves (the page cache included: held pages evict cached checkpoint pages).

Pages are locked with mlock where the process may (root, or a large enough RLIMIT_MEMLOCK); otherwise every page is
written once, which makes it resident but swappable (the machines measured here have no swap). It prints one line,
`held N bytes of M (locked|touched)`, once every page is in place, then sleeps.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import signal
import sys

from ..memory import meminfo

CHUNK = 1 << 30


def bytes_to_hold(total: int, leave_gb: float) -> int:
    """What to hold so that `leave_gb` (10^9 bytes) remain, in whole chunks; 0 when the host has no more than that."""
    want = total - int(leave_gb * 1e9)
    return max(0, want // CHUNK * CHUNK)


def hold(nbytes: int) -> tuple[list[mmap.mmap], str]:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    maps, how = [], "locked"
    for _ in range(nbytes // CHUNK):
        m = mmap.mmap(-1, CHUNK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        address = ctypes.addressof(ctypes.c_char.from_buffer(m))
        if how == "locked" and libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(CHUNK)) != 0:
            how = "touched"
        if how == "touched":
            page = mmap.PAGESIZE
            for offset in range(0, CHUNK, page):
                m[offset] = 1
        maps.append(m)
    return maps, how


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k6fast.bench.ballast", description=__doc__.splitlines()[0])
    parser.add_argument("--leave-gb", type=float, required=True, help="host memory to leave, in GB (10^9 bytes)")
    args = parser.parse_args(argv)
    total, _ = meminfo()
    nbytes = bytes_to_hold(total, args.leave_gb)
    maps, how = hold(nbytes)
    print(f"held {nbytes} bytes of {total} ({how}) in {len(maps)} chunks, leaving {args.leave_gb:g} GB", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main())
