"""Expiry on a full disk: the expired jobs' files go first, making the room their records' deletion needs, and a
round that finds no room at all removes nothing and raises nothing (the next round tries again)."""

from __future__ import annotations

from test_server_storage import AUTH, Server, real_pipeline, server  # noqa: F401  (fixtures)

FAR_FUTURE = 2**40


def test_expired_jobs_are_removed_on_a_full_disk_files_first(server: Server, monkeypatch) -> None:  # noqa: F811
    done = server.create()
    assert server.wait_status(done, "completed", "failed")["status"] == "completed"
    assert server.state.files.video(done).exists()
    server.disk.fill()
    monkeypatch.setattr(server.state.store, "now", lambda: FAR_FUTURE)
    assert server.state.reap() == [done]
    assert server.client.get(f"/v1/videos/{done}", headers=AUTH).status_code == 404
    assert not server.state.files.folder(done).exists() and server.reserve.exists()  # the files made the room


def test_a_round_without_any_room_raises_nothing_and_the_next_one_finishes(server: Server, monkeypatch) -> None:  # noqa: F811
    done = server.create()
    assert server.wait_status(done, "completed", "failed")["status"] == "completed"
    server.disk.fill(room=-(10**9))  # far less than nothing: freeing the files and the reserve cannot help
    monkeypatch.setattr(server.state.store, "now", lambda: FAR_FUTURE)
    assert server.state.reap() == []  # no exception: the reap loop logs no traceback per round
    assert server.state.store.get(done) is not None  # its record waits for room
    server.disk.make_room()
    assert server.state.reap() == [done] and server.state.store.get(done) is None
