"""The server's job store, job files, data-directory lock and metrics text, without a model or HTTP."""

from __future__ import annotations

import os
import sqlite3
import stat
from pathlib import Path

import pytest

from k6fast.request import Request
from k6fast.server.errors import ApiError
from k6fast.server.jobs import (
    RESTART_LIMIT_CODE,
    DataDirBusy,
    DataDirLock,
    JobFiles,
    JobSpec,
    JobStore,
    QueueFull,
    UnknownJob,
    make_private_dir,
    new_job_id,
    write_image,
)
from k6fast.server.metrics import Metrics
from k6fast.server.validation import frames_for_seconds

ARM = {"arm": "env", "arm_hash": "0123456789abcdef", "switches": {"K6_AUDIO_NORM": "peak"}}
TTL = 100.0


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _spec(prompt: str = "a cat", image: bool = False, **changes) -> JobSpec:
    request = Request(prompt=prompt, width=64, height=64, frames=9, steps=2, guidance=1.0, seed=7, **changes)
    return JobSpec(request, "0.333", image=image)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock):
    s = JobStore(tmp_path / "jobs.sqlite3", clock=clock)
    yield s
    s.close()


def _add(store: JobStore, prompt: str = "a cat", max_queue: int = 100) -> str:
    job_id = new_job_id()
    store.create(job_id, _spec(prompt), "tiny", ARM, max_queue)
    return job_id


def test_create_get_round_trip(store: JobStore, clock: Clock) -> None:
    spec = _spec(negative_prompt="blurry", image=True, audio=False)
    job = store.create(new_job_id(), spec, "tiny", ARM, 4)
    again = store.get(job.id)
    assert again == job
    assert (again.status, again.progress, again.attempts, again.created_at) == ("queued", 0, 0, int(clock.now))
    assert again.spec == spec and again.arm == ARM and again.model == "tiny"
    assert again.completed_at is None and again.expires_at is None and again.error_code is None
    assert store.get(new_job_id()) is None


def test_fifo_claim_progress_complete_and_fail(store: JobStore, clock: Clock) -> None:
    first, second, third = (_add(store, p) for p in ("one", "two", "three"))
    assert store.counts() == {"queued": 3, "in_progress": 0, "completed": 0, "failed": 0}
    job = store.claim_next()
    assert (job.id, job.status, job.attempts, job.started_at) == (first, "in_progress", 1, int(clock.now))
    assert store.set_progress(first, 45) and store.get(first).progress == 45
    assert not store.set_progress(second, 10), "only a running job takes progress"
    clock.now += 7
    assert store.complete(first, {"job_s": 7.0}, TTL)
    done = store.get(first)
    assert (done.status, done.progress, done.completed_at) == ("completed", 100, int(clock.now))
    assert done.expires_at == int(clock.now + TTL) and done.telemetry == {"job_s": 7.0}
    assert not store.complete(first, {}, TTL), "a finished job cannot finish twice"
    assert store.claim_next().id == second
    assert store.fail(second, "out_of_memory", "CUDA out of memory", TTL)
    failed = store.get(second)
    assert (failed.status, failed.error_code, failed.error_message) == ("failed", "out_of_memory", "CUDA out of memory")
    assert failed.expires_at == int(clock.now + TTL)
    assert store.claim_next().id == third
    assert store.claim_next() is None


def test_queue_bound_counts_only_waiting_jobs(store: JobStore) -> None:
    _add(store, max_queue=2)
    _add(store, max_queue=2)
    with pytest.raises(QueueFull) as info:
        _add(store, max_queue=2)
    assert info.value.depth == 2
    store.claim_next()  # the running job no longer takes a queue slot
    _add(store, max_queue=2)
    assert store.counts()["queued"] == 2


def test_page_orders_and_cursors(store: JobStore) -> None:
    ids = [_add(store, f"p{i}") for i in range(5)]
    jobs, more = store.page(None, 2, "desc")
    assert [j.id for j in jobs] == ids[:-3:-1] and more
    jobs, more = store.page(jobs[-1].id, 2, "desc")
    assert [j.id for j in jobs] == [ids[2], ids[1]] and more
    jobs, more = store.page(jobs[-1].id, 2, "desc")
    assert [j.id for j in jobs] == [ids[0]] and not more
    jobs, more = store.page(ids[1], 10, "asc")
    assert [j.id for j in jobs] == ids[2:] and not more
    with pytest.raises(UnknownJob):
        store.page(new_job_id(), 2, "asc")


def test_recover_requeues_running_jobs_until_the_restart_limit(store: JobStore, tmp_path: Path, clock: Clock) -> None:
    a, b = _add(store, "a"), _add(store, "b")
    store.claim_next()  # a: attempt 1, then the server "dies"
    assert store.recover(max_attempts=2, ttl_seconds=TTL) == ([a], [])
    assert store.get(a).status == "queued" and store.get(a).progress == 0
    assert store.claim_next().id == a, "a re-queued job keeps its place at the head of the queue"
    requeued, failed = store.recover(max_attempts=2, ttl_seconds=TTL)  # died again on attempt 2
    assert (requeued, failed) == ([], [a])
    job = store.get(a)
    assert job.status == "failed" and job.error_code == RESTART_LIMIT_CODE and "2 times" in job.error_message
    assert store.get(b).status == "queued"


def test_requeue_on_shutdown_does_not_count_as_an_attempt(store: JobStore) -> None:
    a = _add(store)
    store.claim_next()
    assert store.requeue(a)
    job = store.get(a)
    assert (job.status, job.attempts, job.started_at) == ("queued", 0, None)


def test_delete_returns_the_record_and_expire_removes_only_due_jobs(store: JobStore, clock: Clock) -> None:
    a, b, c = _add(store), _add(store), _add(store)
    assert store.delete(c).status == "queued" and store.get(c) is None and store.delete(c) is None
    store.claim_next()
    store.complete(a, {}, TTL)
    clock.now += TTL / 2
    store.claim_next()
    store.fail(b, "generation_failed", "boom", TTL)
    assert store.expire() == []
    clock.now += TTL / 2
    assert store.expire() == [a]
    clock.now += TTL
    assert store.expire() == [b]
    assert store.ids() == set()


def test_records_survive_an_unclosed_connection(tmp_path: Path, clock: Clock) -> None:
    # A SIGKILLed server never closes its connection: what was acknowledged must be readable by the next one.
    first = JobStore(tmp_path / "jobs.sqlite3", clock=clock)
    a = _add(first)
    first.claim_next()
    first.set_progress(a, 30)
    second = JobStore(tmp_path / "jobs.sqlite3", clock=clock)
    job = second.get(a)
    assert (job.status, job.progress) == ("in_progress", 30)
    second.close()
    first.close()


def test_foreign_schema_version_is_refused(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "jobs.sqlite3")
    db.execute("PRAGMA user_version = 99")
    db.close()
    with pytest.raises(RuntimeError, match="schema version 99, expected 1"):
        JobStore(tmp_path / "jobs.sqlite3")


def test_files_sweep_removes_orphans_and_temporaries(tmp_path: Path) -> None:
    files = JobFiles(tmp_path)
    kept, orphan = new_job_id(), new_job_id()
    for job_id in (kept, orphan):
        files.folder(job_id, create=True)
        files.video(job_id).write_bytes(b"mp4")
    tmp = files.folder(kept) / ".video.mp4.1234.tmp"
    tmp.write_bytes(b"half")
    (files.root / "stray.txt").write_text("x")
    removed = files.sweep({kept})
    assert sorted(removed) == sorted([orphan, f"{kept}/.video.mp4.1234.tmp"])
    assert files.video(kept).read_bytes() == b"mp4" and not files.folder(orphan).exists() and not tmp.exists()
    assert (files.root / "stray.txt").read_text() == "x", "what the server did not write stays (issue 34)"
    with pytest.raises(ValueError, match="expected a job id"):
        files.folder("../etc")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_data_is_private_whatever_the_umask(tmp_path: Path) -> None:
    import PIL.Image

    old = os.umask(0o022)  # the usual umask, under which new files are world-readable
    try:
        data = tmp_path / "data"
        make_private_dir(data)
        store = JobStore(data / "jobs.sqlite3")
        _add(store)  # a write creates the WAL and its shared-memory index
        lock = DataDirLock(data)
        lock.acquire()
        files = JobFiles(data)
        job_id = new_job_id()
        files.folder(job_id, create=True)
        write_image(PIL.Image.new("RGB", (4, 4)), files.input_image(job_id), "PNG")
        files.video(job_id).write_bytes(b"mp4")  # as the MP4 writer leaves it: the umask's 0644
        files.make_private(job_id)
        assert (_mode(data), _mode(files.root), _mode(files.folder(job_id))) == (0o700, 0o700, 0o700)
        written = ["jobs.sqlite3", "jobs.sqlite3-wal", "jobs.sqlite3-shm", "server.lock"]
        assert {name: _mode(data / name) for name in written} == dict.fromkeys(written, 0o600)
        assert _mode(files.input_image(job_id)) == 0o600 and _mode(files.video(job_id)) == 0o600
        lock.release()
        store.close()
        os.chmod(data, 0o755)  # a data directory left readable by an older version is made private again
        os.chmod(data / "jobs.sqlite3", 0o644)
        make_private_dir(data)
        JobStore(data / "jobs.sqlite3").close()
        assert (_mode(data), _mode(data / "jobs.sqlite3")) == (0o700, 0o600)
    finally:
        os.umask(old)


def test_queue_depth_counts_waiting_jobs(store: JobStore) -> None:
    assert store.queue_depth() == 0
    _add(store)
    _add(store)
    store.claim_next()
    assert store.queue_depth() == 1


def test_data_dir_lock_is_exclusive(tmp_path: Path) -> None:
    first, second = DataDirLock(tmp_path), DataDirLock(tmp_path)
    first.acquire()
    with pytest.raises(DataDirBusy, match="in use by another k6fast server"):
        second.acquire()
    first.release()
    second.acquire()
    second.release()


@pytest.mark.parametrize(
    ("seconds", "frames"), [("5", 121), ("4", 97), ("0.5", 13), ("0.333", 9), ("0.667", 17), ("1", 25)]
)
def test_seconds_map_to_4k_plus_1_frames(seconds: str, frames: int) -> None:
    assert frames_for_seconds(seconds) == frames


@pytest.mark.parametrize(("seconds", "nearest"), [("0.3", "'0.167' (5 frames) or '0.333' (9 frames)"), ("1.1", "'1'")])
def test_seconds_without_a_valid_frame_count_name_the_nearest(seconds: str, nearest: str) -> None:
    with pytest.raises(ApiError) as info:
        frames_for_seconds(seconds)
    assert info.value.param == "seconds" and "4k+1" in info.value.message and nearest in info.value.message


def test_metrics_text_has_queue_status_steps_and_vram() -> None:
    metrics = Metrics()
    metrics.observe_step(0.03)
    metrics.observe_step(2.0)
    metrics.observe_job("completed", 12.0, 3 * 2**30)
    metrics.observe_job("cancelled")
    text = metrics.render({"queued": 2, "in_progress": 1, "completed": 5, "failed": 0}, ready=True, busy=True)
    lines = set(text.splitlines())
    for line in (
        "k6fast_queue_depth 2",
        'k6fast_jobs{status="completed"} 5',
        'k6fast_jobs_finished_total{outcome="cancelled"} 1',
        'k6fast_step_seconds_bucket{le="0.05"} 1',
        'k6fast_step_seconds_bucket{le="+Inf"} 2',
        "k6fast_step_seconds_count 2",
        "k6fast_step_seconds_sum 2.03",
        f"k6fast_peak_vram_bytes {3 * 2**30}",
        "k6fast_worker_busy 1",
    ):
        assert line in lines, line
    assert metrics.mean_job_seconds() == 12.0
    with pytest.raises(ValueError, match="outcome must be one of"):
        metrics.observe_job("exploded")
