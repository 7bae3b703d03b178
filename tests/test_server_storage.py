"""Issue 34, the server's storage: it removes and re-permissions only what it wrote (the data directory's marker,
datadir.py); a full disk is a state with clear answers, not a hang (storage.py); and every start-up failure of
`serve` is one `error:` line with exit status 2.

The full disk is simulated (SimulatedDisk): the data directory gets a capacity in bytes, the server's own file writes
fail with ENOSPC at their fsync (as on a filesystem with delayed allocation) and its SQLite writes with SQLITE_FULL
while SQLite would not find room for its journal. Everything else is the real server on the tiny checkpoint.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import sqlite3
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

pytest.importorskip("fastapi")  # the server's extra (k6fast[serve])
from fastapi.testclient import TestClient  # noqa: E402
from server_testing import GatedPipeline, internals_in, tiny_server_config, until  # noqa: E402

from k6fast.pipeline import Pipeline  # noqa: E402
from k6fast.request import Request  # noqa: E402
from k6fast.server import dispatch, storage, worker  # noqa: E402
from k6fast.server.app import create_app  # noqa: E402
from k6fast.server.cli import main  # noqa: E402
from k6fast.server.datadir import MARKER, DataDirRefused, own_data_dir  # noqa: E402
from k6fast.server.jobs import JobFiles, JobSpec, JobStore, new_job_id  # noqa: E402
from k6fast.server.storage import RESERVE_BYTES, QueueReader, Storage  # noqa: E402
from k6fast.switches import Options  # noqa: E402

KEY = "sk-storage-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
FAST = {"prompt": "a red ball bouncing", "size": "64x64", "num_frames": "5", "num_inference_steps": "2", "seed": "1"}
RECHECK_S = 0.05


# ---------------------------------------------------------------------------------------------------------------------
# 1. The server never deletes or re-permissions what it did not create.


def _issue_folder(root: Path) -> Path:
    """The folder of issue 34: a `jobs/` subfolder holding a user's file and a user's folder, all mode 755."""
    data = root / "data"
    (data / "jobs" / "my-renders").mkdir(parents=True)
    (data / "jobs" / "important.txt").write_text("keep me")
    (data / "jobs" / "my-renders" / "shot1.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 a user's clip")
    for folder in (data, data / "jobs", data / "jobs" / "my-renders"):
        os.chmod(folder, 0o755)
    return data


def _snapshot(root: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every path under `root` (itself included) with its mode and, for a file, its bytes."""
    paths = [root, *sorted(root.rglob("*"))] if root.is_dir() else [root]
    return {
        str(p.relative_to(root)): (stat.S_IMODE(p.stat().st_mode), p.read_bytes() if p.is_file() else None)
        for p in paths
    }


def test_the_issue_folder_is_refused_by_serve_and_left_unchanged(tmp_path: Path, tiny_distill: Path, capsys) -> None:
    data = _issue_folder(tmp_path)
    before = _snapshot(data)
    assert main(["--model", str(tiny_distill), "--data-dir", str(data), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "jobs/important.txt" in err and "jobs/my-renders" in err and MARKER in err, err
    assert "choose another --data-dir" in err and "Traceback" not in err, err
    assert _snapshot(data) == before, "a refused folder is left exactly as it was: files, contents and modes"


def test_the_issue_folder_is_refused_by_the_app_too(tmp_path: Path, real_pipeline: Pipeline) -> None:
    # create_app is what the Ray ingress and the tests start: it must refuse the folder as the CLI does.
    data = _issue_folder(tmp_path)
    before = _snapshot(data)
    app = create_app(tiny_server_config(data), Options(), load=lambda: real_pipeline)
    with pytest.raises(DataDirRefused, match="holds files or folders k6fast did not write"), TestClient(app):
        pass
    assert _snapshot(data) == before


def test_new_and_empty_folders_are_adopted_with_the_marker(tmp_path: Path) -> None:
    new, empty = tmp_path / "a" / "new", tmp_path / "empty"
    empty.mkdir(mode=0o755)
    for folder in (new, empty):
        own_data_dir(folder)
        assert (folder / MARKER).is_file() and stat.S_IMODE(folder.stat().st_mode) == 0o700
    (empty / "jobs").mkdir()
    (empty / "jobs" / "mine.txt").write_text("x")
    own_data_dir(empty)  # marked: the server's, whatever it holds now
    assert (empty / "jobs" / "mine.txt").read_text() == "x"
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(DataDirRefused, match="is not a folder"):
        own_data_dir(a_file)


def _older_k6fast_dir(root: Path) -> tuple[Path, str]:
    """A data directory as a k6fast from before the marker left it: store, lock, a job with its files and a
    temporary of an interrupted write."""
    data = root / "old"
    data.mkdir()
    store = JobStore(data / "jobs.sqlite3")
    job_id = new_job_id()
    store.create(job_id, JobSpec(Request("a cat", 64, 64, 9, 2, 1.0, 7), "0.333"), "tiny", {}, 4)
    store.close()
    (data / "server.lock").write_text("123")
    folder = data / "jobs" / job_id
    folder.mkdir(parents=True)
    for name in ("video.mp4", "video.mp4.json", "thumbnail.jpg", ".video.mp4.0123456789ab.tmp"):
        (folder / name).write_bytes(b"x")
    return data, job_id


@pytest.mark.parametrize("extra", [None, "notes.txt", "jobs/important.txt", "jobs/{job}/notes.txt", "jobs/renders/"])
def test_an_older_k6fast_data_dir_is_adopted_only_when_it_holds_nothing_else(tmp_path: Path, extra: str | None) -> None:
    data, job_id = _older_k6fast_dir(tmp_path)
    if extra is not None:
        path = data / extra.format(job=job_id)
        path.mkdir() if extra.endswith("/") else path.write_text("the user's")
    before = _snapshot(data)
    if extra is None:
        own_data_dir(data)
        assert (data / MARKER).is_file()
        assert JobStore(data / "jobs.sqlite3").ids() == {job_id}
        return
    with pytest.raises(DataDirRefused) as info:
        own_data_dir(data)
    assert extra.format(job=job_id).rstrip("/") in str(info.value)
    assert _snapshot(data) == before


def test_the_sweep_and_job_removal_touch_only_what_the_server_wrote(tmp_path: Path, caplog) -> None:
    data = tmp_path / "data"
    own_data_dir(data)
    files = JobFiles(data)
    known, orphan, orphan_with_notes = new_job_id(), new_job_id(), new_job_id()
    for job_id in (known, orphan, orphan_with_notes):
        files.folder(job_id, create=True)
        files.video(job_id).write_bytes(b"mp4")
        files.thumbnail(job_id).write_bytes(b"jpg")
    interrupted = files.folder(known) / ".video.mp4.0123456789ab.tmp"
    interrupted.write_bytes(b"half")
    (files.folder(orphan_with_notes) / "notes.txt").write_text("the user's")
    # The issue's files, put into the (owned) jobs folder after the server made it.
    (files.root / "important.txt").write_text("keep me")
    (files.root / "my-renders").mkdir(mode=0o755)
    (files.root / "my-renders" / "shot1.mp4").write_bytes(b"a user's clip")
    os.chmod(files.root / "my-renders", 0o755)
    user_before = {
        name: _snapshot(files.root / name) for name in ("important.txt", "my-renders", orphan_with_notes + "/notes.txt")
    }

    with caplog.at_level(logging.WARNING, "k6fast.server"):
        removed = files.sweep({known})
    assert sorted(removed) == sorted([orphan, f"{known}/{interrupted.name}"])
    assert not files.folder(orphan).exists() and not interrupted.exists() and files.video(known).read_bytes() == b"mp4"
    assert not files.video(orphan_with_notes).exists(), "a record-less job's own files go"
    assert {name: _snapshot(files.root / name) for name in user_before} == user_before, "the user's things stay"
    assert "important.txt" in caplog.text and "my-renders" in caplog.text, "what was left is logged"

    files.remove(orphan_with_notes)  # as a DELETE would: the folder stays for the file the server did not write
    assert (files.folder(orphan_with_notes) / "notes.txt").read_text() == "the user's"
    files.remove(known)
    assert not files.folder(known).exists()


# ---------------------------------------------------------------------------------------------------------------------
# 2. A full disk is a state, not a hang.


class SimulatedDisk:
    """The data directory on a filesystem of `capacity` bytes (None: unlimited): its files count against it, SQLite's
    own files aside. Installed by the `disk` fixture: the server's file writes fail with ENOSPC at fsync once the
    disk is over capacity; SQLite's writes fail with SQLITE_FULL while less than `sqlite_room` bytes are free."""

    def __init__(self, data_dir: Path, sqlite_room: int = 4096):
        self.data_dir = data_dir
        self.capacity: int | None = None
        self.sqlite_room = sqlite_room

    def used(self) -> int:
        total = 0
        for path in self.data_dir.rglob("*"):
            try:
                if path.is_file() and not path.name.startswith("jobs.sqlite3"):
                    total += path.stat().st_size
            except FileNotFoundError:  # removed while counted
                pass
        return total

    def free(self) -> float:
        return float("inf") if self.capacity is None else self.capacity - self.used()

    def fill(self, room: int = 0) -> None:
        """From now on only `room` more bytes fit (negative: another process took more than there was)."""
        self.capacity = self.used() + room

    def make_room(self) -> None:
        self.capacity = None


class FullDiskConnection:
    """The store's SQLite connection, whose writes fail as SQLite's fail on a full disk."""

    def __init__(self, real: sqlite3.Connection, disk: SimulatedDisk):
        self._real, self._disk = real, disk

    def execute(self, sql: str, *args):
        writes = sql.split(None, 1)[0].upper() in ("INSERT", "UPDATE", "DELETE")
        if writes and self._disk.free() < self._disk.sqlite_room:
            exc = sqlite3.OperationalError("database or disk is full")
            exc.sqlite_errorcode, exc.sqlite_errorname = 13, "SQLITE_FULL"
            raise exc
        return self._real.execute(sql, *args)

    def __getattr__(self, name: str):
        return getattr(self._real, name)


@pytest.fixture(scope="module")
def real_pipeline(tiny_distill: Path) -> Pipeline:
    return Pipeline(tiny_distill, Options(), device="cpu")


class Server:
    def __init__(self, client: TestClient, pipeline: GatedPipeline, disk: SimulatedDisk):
        self.client, self.pipeline, self.disk = client, pipeline, disk
        self.state = client.app.state.k6
        self.reserve = disk.data_dir / storage.RESERVE_NAME

    def post(self, **changes) -> object:
        return self.client.post("/v1/videos", data=FAST | changes, headers=AUTH)

    def create(self, **changes) -> str:
        response = self.post(**changes)
        assert response.status_code == 200, response.text
        return response.json()["id"]

    def get(self, video_id: str) -> dict:
        response = self.client.get(f"/v1/videos/{video_id}", headers=AUTH)
        assert response.status_code == 200, response.text
        return response.json()

    def wait_status(self, video_id: str, *statuses: str) -> dict:
        return until(lambda: (v := self.get(video_id))["status"] in statuses and v, f"{video_id} in {statuses}")

    def health(self, headers: dict | None = None) -> dict:
        response = self.client.get("/health", headers=AUTH if headers is None else headers)
        assert response.status_code == 200, response.text
        return response.json()


@pytest.fixture
def server(tmp_path: Path, real_pipeline: Pipeline, monkeypatch) -> Iterator[Server]:
    data_dir = (tmp_path / "data").resolve()
    disk = SimulatedDisk(data_dir)
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        ours = stat.S_ISREG(os.fstat(fd).st_mode) and os.readlink(f"/proc/self/fd/{fd}").startswith(f"{data_dir}/")
        if ours and disk.free() < 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(storage, "RECHECK_S", RECHECK_S)
    monkeypatch.setattr(dispatch, "RECHECK_S", RECHECK_S)
    gated = GatedPipeline(real_pipeline)
    app = create_app(tiny_server_config(data_dir, poll_after_ms=50), Options(api_key=KEY), load=lambda: gated)
    with TestClient(app) as client:
        until(lambda: client.get("/health").status_code == 200, "the server to become ready")
        state = client.app.state.k6
        monkeypatch.setattr(state.store, "connection", FullDiskConnection(state.store.connection, disk))
        yield Server(client, gated, disk)
        gated.gate.set()


def _png() -> bytes:
    buffer = io.BytesIO()
    PIL.Image.fromarray(np.full((24, 32, 3), 200, np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def _check_507(response) -> None:
    assert response.status_code == 507, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert (error["type"], error["code"]) == ("server_error", "insufficient_storage"), error
    assert "disk is full" in error["message"] and not internals_in(error["message"]), error


def test_a_job_meeting_a_full_disk_fails_with_insufficient_storage_and_the_queue_resumes_with_room(
    server: Server, caplog
) -> None:
    server.pipeline.gate.clear()
    first = server.create()
    until(server.pipeline.waiting.is_set, "the first job to be running")
    second = server.create(prompt="the second job")
    server.disk.fill()
    with caplog.at_level(logging.INFO, "k6fast.server"):
        server.pipeline.gate.set()
        failed = server.wait_status(first, "failed", "completed")
        assert failed["status"] == "failed" and failed["error"]["code"] == "insufficient_storage", failed
        assert "disk was full" in failed["error"]["message"] and not internals_in(failed["error"]["message"])
        health = server.health()
        assert health["status"] == "degraded" and "disk" in health["reason"], health
        assert server.health(headers={}) == {"status": "degraded"}, "without the key: the state, not the reason"
        # Many rechecks later, the second job still waits: started on a full disk it could only fail.
        for _ in range(10):
            assert server.get(second)["status"] == "queued"
            assert server.state.store.counts()["in_progress"] == 0, "no job is in progress without a worker"
            time.sleep(2 * RECHECK_S)
        server.disk.make_room()
        done = server.wait_status(second, "completed", "failed")
        assert done["status"] == "completed", done
        assert server.health()["status"] == "ok"
    assert server.reserve.stat().st_size == RESERVE_BYTES, "the reserve is back once there is room"
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and "is full" in r.getMessage()]
    assert len(warnings) == 1, "the full disk is logged once, when it begins, not on every recheck"
    assert "could not read the job queue" not in caplog.text
    assert caplog.text.count("has room again") == 1


def test_posts_get_an_openai_shaped_507_while_the_disk_is_full(server: Server) -> None:
    server.disk.fill()
    _check_507(server.client.post("/v1/videos", json=FAST | {"num_frames": 5, "seed": 1}, headers=AUTH))
    parts = [(name, (None, value)) for name, value in FAST.items()]
    parts.append(("input_reference", ("ref.png", _png(), "image/png")))
    _check_507(server.client.post("/v1/videos", files=parts, headers=AUTH))
    assert server.state.store.counts() == {"queued": 0, "in_progress": 0, "completed": 0, "failed": 0}
    assert list((server.disk.data_dir / "jobs").iterdir()) == [], "a refused upload leaves no file behind"
    assert server.health()["status"] == "degraded"
    server.disk.make_room()
    until(lambda: server.health()["status"] == "ok", "the disk to have room again")
    assert server.post().status_code == 200


def test_delete_works_on_a_full_disk_files_first_then_the_reserve(server: Server) -> None:
    done = server.create()
    assert server.wait_status(done, "completed", "failed")["status"] == "completed"
    server.pipeline.gate.clear()
    running = server.create(prompt="held")
    until(server.pipeline.waiting.is_set, "the second job to be running")
    queued = server.create(prompt="queued, no files")
    server.disk.fill()
    # The completed job's files make the room its record's deletion needs: the reserve is not touched.
    response = server.client.delete(f"/v1/videos/{done}", headers=AUTH)
    assert response.status_code == 200 and response.json()["deleted"] is True, response.text
    assert server.client.get(f"/v1/videos/{done}", headers=AUTH).status_code == 404
    assert not server.state.files.folder(done).exists() and server.reserve.exists()
    # A queued job has no files to free: the reserve makes the room.
    server.disk.fill()
    response = server.client.delete(f"/v1/videos/{queued}", headers=AUTH)
    assert response.status_code == 200, response.text
    assert not server.reserve.exists() and server.health()["status"] == "degraded"
    # And the running job, which is cancelled as usual.
    assert server.client.delete(f"/v1/videos/{running}", headers=AUTH).status_code == 200
    until(lambda: server.state.worker.current_job_id is None, "the deleted job to stop")
    assert server.state.store.counts() == {"queued": 0, "in_progress": 0, "completed": 0, "failed": 0}
    server.disk.make_room()
    until(lambda: server.health()["status"] == "ok" and server.reserve.exists(), "room and the reserve again")


def test_an_outcome_that_cannot_be_recorded_stays_with_the_worker_until_there_is_room(server: Server) -> None:
    server.pipeline.gate.clear()
    first = server.create()
    until(server.pipeline.waiting.is_set, "the first job to be running")
    second = server.create(prompt="the second job")
    server.disk.fill(room=-4 * RESERVE_BYTES)  # more than the job's files and the reserve could free
    server.pipeline.gate.set()
    until(lambda: not server.reserve.exists(), "the reserve to be released for the failure's record")
    for _ in range(10):
        assert server.get(first)["status"] == "in_progress"
        assert server.state.worker.current_job_id == first, "in progress, and held by the worker retrying"
        assert server.get(second)["status"] == "queued"
        assert server.health()["status"] == "degraded"
        time.sleep(2 * RECHECK_S)
    server.disk.make_room()
    failed = server.wait_status(first, "failed")
    assert failed["error"]["code"] == "insufficient_storage", failed
    assert server.wait_status(second, "completed", "failed")["status"] == "completed"
    assert server.state.store.counts()["in_progress"] == 0


def test_the_queue_reader_logs_a_failing_store_once_per_change(tmp_path: Path, monkeypatch, caplog) -> None:
    locked, broken = sqlite3.OperationalError("database is locked"), sqlite3.OperationalError("disk I/O error")
    outcomes: list[object] = [locked] * 5 + [broken] * 3 + [sqlite3.OperationalError("database or disk is full")]
    outcomes.append("job")

    def claim() -> object:
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def no_room(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    room = Storage(tmp_path)
    reader = QueueReader(claim, room)
    with caplog.at_level(logging.INFO, "k6fast.server"):
        for _ in range(9):
            assert reader.claim() is None and reader.blocked
        assert room.problem is not None and outcomes == ["job"]
        with monkeypatch.context() as patch:
            patch.setattr(os, "fsync", no_room)
            for _ in range(5):
                assert reader.claim() is None and reader.blocked
            assert outcomes == ["job"], "nothing is claimed while a probe write does not fit"
        assert reader.claim() == "job" and not reader.blocked and room.problem is None
    tracebacks = [str(r.exc_info[1]) for r in caplog.records if r.exc_info]
    assert tracebacks == ["database is locked", "disk I/O error"], "one traceback per error, not one per poll"
    messages = [r.getMessage() for r in caplog.records]
    assert sum("is full" in m for m in messages) == 1 and sum("has room again" in m for m in messages) == 1
    assert sum("can be read again" in m for m in messages) == 1


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), "insufficient_storage"),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), "insufficient_storage"),
        (sqlite3.OperationalError("database or disk is full"), "insufficient_storage"),
        (OSError(errno.EACCES, "Permission denied"), "generation_failed"),
    ],
)
def test_a_full_disk_is_its_own_failure_code(exc: BaseException, code: str) -> None:
    assert worker.classify_failure(exc, "write")[0] == code
    try:  # as a writer that wraps the OS error (a muxer's own exception) raises it
        raise RuntimeError("the muxer failed") from exc
    except RuntimeError as wrapped:
        assert worker.classify_failure(wrapped, "write") == worker.classify_failure(exc, "write")


# ---------------------------------------------------------------------------------------------------------------------
# 4. Start-up failures of `serve`: one `error:` line, exit status 2, the recovery step.


def _serve(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("K6_")}
    return subprocess.run(
        [sys.executable, "-m", "k6fast.server", *args], capture_output=True, text=True, timeout=120, env=env
    )


def _damaged(path: Path) -> None:
    """A real store whose third page is overwritten: 'database disk image is malformed' territory."""
    store = JobStore(path)
    for i in range(100):
        store.create(new_job_id(), JobSpec(Request("x" * 200, 64, 64, 9, 2, 1.0, i), "0.333"), "tiny", {}, 1000)
    store.close()
    data = bytearray(path.read_bytes())
    data[2 * 4096 : 3 * 4096] = b"\xa5" * 4096
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["not a database", "damaged page"])
def test_a_corrupt_store_is_one_error_line_with_the_recovery_step(tmp_path: Path, tiny_distill: Path, damage) -> None:
    data = tmp_path / "data"
    own_data_dir(data)
    store = data / "jobs.sqlite3"
    if damage == "not a database":
        store.write_bytes(b"these are not the records you are looking for\n" * 100)
    else:
        _damaged(store)
    before = store.read_bytes()
    result = _serve("--model", str(tiny_distill), "--data-dir", str(data), "--port", "0", "--device", "cpu")
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {store} is not a readable job store"), result.stderr
    assert "move it aside" in lines[0] and "Traceback" not in result.stderr
    assert store.read_bytes() == before, "the damaged store is left for the user to inspect"


def test_a_full_disk_at_start_is_one_error_line(tmp_path: Path, tiny_distill: Path, monkeypatch, capsys) -> None:
    def no_room(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", no_room)
    data = tmp_path / "data"
    assert main(["--model", str(tiny_distill), "--data-dir", str(data), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: the disk holding the data directory {data} is full; free space there (or choose another --data-dir) "
        "and start again\n"
    )
