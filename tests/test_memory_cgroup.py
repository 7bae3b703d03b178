"""Host memory under a cgroup limit (a container, a Kubernetes pod, a systemd slice): the room for the page cache and
the host tier is the smaller of the host's and the cgroup's, read from fake cgroup folders (cgroup v2 and v1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from k6fast.doctor import Report, predict_disk_per_step, render
from k6fast.memory import HOST_OS_BYTES, PROCESS_HOST_BYTES, CgroupLimit, HostMemory, cgroup_limit, host_memory
from k6fast.stream.plan import GiB, HostCacheError, plan_host_cache

HOST_AVAILABLE = 200 * GiB
RESERVES = PROCESS_HOST_BYTES + HOST_OS_BYTES


def _proc(tmp_path: Path, cgroup_lines: str) -> tuple[str, str, str]:
    """Fake /proc/meminfo (HOST_AVAILABLE), /proc/self/status (no anonymous memory yet) and /proc/self/cgroup."""
    (tmp_path / "meminfo").write_text(f"MemTotal: {256 * 2**20} kB\nMemAvailable: {HOST_AVAILABLE // 1024} kB\n")
    (tmp_path / "status").write_text("RssAnon:\t0 kB\n")
    (tmp_path / "cgroup").write_text(cgroup_lines)
    return str(tmp_path / "meminfo"), str(tmp_path / "status"), str(tmp_path / "cgroup")


def _cgroup(folder: Path, limit: str | None, current: int, files: tuple[str, str] = ("memory.max", "memory.current"),
            stat: str = "") -> None:  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    if limit is not None:
        (folder / files[0]).write_text(limit + "\n")
    (folder / files[1]).write_text(f"{current}\n")
    if stat:
        (folder / "memory.stat").write_text(stat)


def _host(tmp_path: Path, cgroup_lines: str) -> HostMemory:
    meminfo, status, cgroup = _proc(tmp_path, cgroup_lines)
    return host_memory(meminfo, status, cgroup, str(tmp_path / "sys"))


def test_a_v2_limit_tighter_than_memavailable_sets_the_room(tmp_path: Path) -> None:
    _cgroup(tmp_path / "sys/kubepods/pod1", str(64 * GiB), 20 * GiB)
    host = _host(tmp_path, "0::/kubepods/pod1\n")
    assert host.available_bytes == HOST_AVAILABLE
    assert host.cgroup == CgroupLimit("/kubepods/pod1", 64 * GiB, 20 * GiB)
    assert host.cache_room_bytes == 44 * GiB - RESERVES
    # A size the host could spare but the cgroup cannot is refused, naming the cgroup.
    streamed = [(b, GiB) for b in range(60)]
    with pytest.raises(HostCacheError, match=r"=50 is more.*memory limit 64\.0 GiB of cgroup /kubepods/pod1"):
        plan_host_cache(50.0, streamed, host)
    assert len(plan_host_cache("auto", streamed, host)) == 44 - RESERVES // GiB


def test_max_or_no_cgroup_files_leave_the_hosts_room(tmp_path: Path) -> None:
    unlimited = HostMemory(0, HOST_AVAILABLE).cache_room_bytes
    assert unlimited == HOST_AVAILABLE - RESERVES
    _cgroup(tmp_path / "sys/user.slice", "max", 20 * GiB)
    host = _host(tmp_path, "0::/user.slice\n")
    assert host.cgroup is None and host.cache_room_bytes == unlimited
    # No such folder (no cgroup file system), no /proc/self/cgroup at all: the host's room.
    assert _host(tmp_path, "0::/system.slice/k6.service\n").cache_room_bytes == unlimited
    assert cgroup_limit(str(tmp_path / "no-such-file"), str(tmp_path / "sys")) is None
    assert cgroup_limit(str(tmp_path / "cgroup"), str(tmp_path / "no-such-root")) is None


def test_nested_cgroups_the_one_with_least_room_counts(tmp_path: Path) -> None:
    # The pod's own limit is loose, its parent's tight and nearly spent by other pods, the grandparent's "max".
    _cgroup(tmp_path / "sys/kubepods", "max", 90 * GiB)
    _cgroup(tmp_path / "sys/kubepods/burstable", str(100 * GiB), 90 * GiB)
    _cgroup(tmp_path / "sys/kubepods/burstable/pod1", str(80 * GiB), 30 * GiB)
    host = _host(tmp_path, "0::/kubepods/burstable/pod1\n")
    assert host.cgroup == CgroupLimit("/kubepods/burstable", 100 * GiB, 90 * GiB)
    assert host.cache_room_bytes == 10 * GiB - RESERVES
    # The root's limit (a container's own cgroup mounted at the root of its namespace) counts too.
    _cgroup(tmp_path / "sys", str(50 * GiB), 45 * GiB)
    assert _host(tmp_path, "0::/kubepods/burstable/pod1\n").cgroup == CgroupLimit("/", 50 * GiB, 45 * GiB)


def test_a_cgroups_page_cache_counts_as_room(tmp_path: Path) -> None:
    # A container that has just read the checkpoint: most of what is charged to it is page cache the kernel drops.
    stat = f"anon {6 * GiB}\nactive_file {30 * GiB}\ninactive_file {20 * GiB}\nsock 0\n"
    _cgroup(tmp_path / "sys/docker/c1", str(64 * GiB), 58 * GiB, stat=stat)
    host = _host(tmp_path, "0::/docker/c1\n")
    assert host.cgroup.available_bytes == (64 - 58 + 50) * GiB
    assert host.cache_room_bytes == 56 * GiB - RESERVES


def test_a_v1_memory_controller_limit(tmp_path: Path) -> None:
    v1 = ("memory.limit_in_bytes", "memory.usage_in_bytes")
    stat = f"inactive_file {GiB}\ntotal_active_file {2 * GiB}\ntotal_inactive_file {3 * GiB}\n"
    _cgroup(tmp_path / "sys/memory/docker/c1", str(32 * GiB), 12 * GiB, v1, stat)
    _cgroup(tmp_path / "sys/memory", str(9223372036854771712), 100 * GiB, v1)  # v1's "no limit"
    lines = "12:cpu,cpuacct:/docker/c1\n4:memory:/docker/c1\n0::/\n"
    host = _host(tmp_path, lines)
    assert host.cgroup == CgroupLimit("/docker/c1", 32 * GiB, 12 * GiB, 5 * GiB)
    assert host.cache_room_bytes == (32 - 12 + 5) * GiB - RESERVES


def test_doctor_reports_the_limit_and_plans_within_it(tmp_path: Path) -> None:
    limit = CgroupLimit("/kubepods/pod1", 40 * GiB, 10 * GiB)
    report = Report([], 256 * GiB, HOST_AVAILABLE, 10**12, str(tmp_path), cgroup=limit)
    assert "cgroup memory limit: 42.9 GB at /kubepods/pod1 (32.2 GB available in it)" in render(report)
    assert "cgroup" not in render(Report([], 256 * GiB, HOST_AVAILABLE, 10**12, str(tmp_path)))
    plan = {"streamed_stored_bytes": [GiB] * 60}
    assert predict_disk_per_step(plan, HOST_AVAILABLE, None)["without_tier_bytes"] == 0  # the host holds them all
    within = predict_disk_per_step(plan, HOST_AVAILABLE, None, limit)
    assert within["cache_room_bytes"] == 30 * GiB - RESERVES
    assert within["host_blocks"] == (30 * GiB - RESERVES) // GiB
    assert within["with_tier_bytes"] == (60 - within["host_blocks"]) * GiB  # the rest overflows the cgroup's cache
