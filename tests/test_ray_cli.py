"""`k6fast serve --ray` on a cluster of this machine alone: replicas it has no GPUs for are refused at start (Ray
would leave them pending forever and the command would wait)."""

from __future__ import annotations

import pytest

from k6fast.server.ray_cli import RayServeError, check_local_gpus
from k6fast.server.ray_settings import RaySettings


def test_replicas_the_local_cluster_has_no_gpus_for_are_refused() -> None:
    with pytest.raises(RayServeError, match=r"--replicas 2 at --gpus-per-replica 1 need 2 GPU\(s\); .* has 0"):
        check_local_gpus(RaySettings(replicas=2), 0.0)
    with pytest.raises(RayServeError, match="has 1: expected fewer replicas"):
        check_local_gpus(RaySettings(replicas=3, gpus_per_replica=0.5), 1.0)


def test_replicas_that_fit_the_local_gpus_or_use_none_pass() -> None:
    check_local_gpus(RaySettings(replicas=2, gpus_per_replica=0.5), 1.0)
    check_local_gpus(RaySettings(replicas=4, gpus_per_replica=0.0), 0.0)  # CPU replicas (tests)
    check_local_gpus(RaySettings(replicas=8), 8.0)
