"""A server that runs for weeks keeps its memory flat: 200 tiny jobs through the in-process API (queue, pipeline,
mux, job store, downloads) grow the process's resident memory by at most 50 MiB after a warm-up."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402
from server_testing import rss_bytes, tiny_server_config, until  # noqa: E402

from k6fast.pipeline import Pipeline  # noqa: E402
from k6fast.server.app import create_app  # noqa: E402
from k6fast.switches import Options  # noqa: E402

JOBS, WARMUP = 200, 10
GROWTH_LIMIT = 50 * 2**20


def test_200_jobs_leave_the_servers_memory_flat(tiny_distill: Path, tmp_path: Path) -> None:
    pipeline = Pipeline(tiny_distill, Options(), device="cpu")
    config = tiny_server_config(tmp_path / "data", max_queue=4)
    app = create_app(config, Options(), load=lambda: pipeline)
    # Audio off and twenty prompts in turn keep a job short on a CPU; the prompts still fill and cycle the
    # prompt-embedding cache.
    fields = {"size": "16x16", "num_frames": "1", "num_inference_steps": "1", "sample_audio": "false"}

    def one_job(i: int) -> None:
        parts = [(k, (None, v)) for k, v in (fields | {"seed": str(i), "prompt": f"a fox, take {i % 20}"}).items()]
        created = client.post("/v1/videos", files=parts)
        assert created.status_code == 200, created.text
        video_id = created.json()["id"]
        until(lambda: client.get(f"/v1/videos/{video_id}").json()["status"] in ("completed", "failed"), video_id)
        assert client.get(f"/v1/videos/{video_id}").json()["status"] == "completed"
        assert client.get(f"/v1/videos/{video_id}/content").status_code == 200
        assert client.delete(f"/v1/videos/{video_id}").status_code == 200

    try:
        with TestClient(app) as client:
            until(lambda: client.get("/health").status_code == 200, "the server to become ready")
            for i in range(WARMUP):
                one_job(i)
            gc.collect()
            before = rss_bytes()
            for i in range(JOBS):
                one_job(WARMUP + i)
            gc.collect()
            grown = rss_bytes() - before
        assert grown <= GROWTH_LIMIT, f"RSS grew by {grown / 2**20:.1f} MiB over {JOBS} jobs"
    finally:
        pipeline.close()
