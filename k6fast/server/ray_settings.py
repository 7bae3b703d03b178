"""How `k6fast serve --ray` lays the server out on a Ray cluster; checked at start (no Ray import here)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

APP_NAME = "k6fast"
GENERATOR = "Generator"
INGRESS = "Ingress"


@dataclass(frozen=True)
class RaySettings:
    replicas: int = 1  # generator replicas (the lower bound when autoscaling)
    max_replicas: int | None = None  # set (> replicas): Serve autoscales between the two on queued jobs
    gpus_per_replica: float = 1.0  # 0 = CPU replicas; 0.5 = two replicas share one GPU
    cpus_per_replica: float = 1.0
    shared_data_dir: bool = False  # --data-dir is mounted at the same path on every node: replicas write clips there
    ingress_node_ip: str | None = None  # pin the ingress (it owns the data directory) to this node
    app_name: str = APP_NAME

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.replicas, int) or self.replicas < 1:
            problems.append(f"--replicas must be an integer >= 1, found {self.replicas!r}")
        if self.max_replicas is not None and (
            not isinstance(self.max_replicas, int) or self.max_replicas <= self.replicas
        ):
            problems.append(f"--max-replicas must be an integer above --replicas, found {self.max_replicas!r}")
        if not (math.isfinite(self.gpus_per_replica) and 0 <= self.gpus_per_replica <= 1):
            problems.append(
                f"--gpus-per-replica must be in [0, 1] (one pipeline uses one GPU; 0 = CPU), "
                f"found {self.gpus_per_replica!r}"
            )
        if not (math.isfinite(self.cpus_per_replica) and self.cpus_per_replica >= 0):
            problems.append(f"cpus_per_replica must be >= 0, found {self.cpus_per_replica!r}")
        if problems:
            raise ValueError("invalid Ray settings: " + "; ".join(problems))

    @property
    def capacity(self) -> int:
        """Jobs the ingress keeps in flight: one per replica, up to the autoscaling bound, so that Serve's
        autoscaler sees the queued ones as demand."""
        return self.max_replicas or self.replicas

    def generator_options(self) -> dict[str, Any]:
        """`serve.deployment(...).options(...)` of the generator deployment."""
        options: dict[str, Any] = {
            "name": GENERATOR,
            "max_ongoing_requests": 1,
            "ray_actor_options": {"num_gpus": self.gpus_per_replica, "num_cpus": self.cpus_per_replica},
            # Loading a checkpoint and its warm-up generation take minutes at full size.
            "health_check_timeout_s": 600,
            "graceful_shutdown_timeout_s": 120,
        }
        if self.max_replicas is None:
            options["num_replicas"] = self.replicas
        else:
            options["autoscaling_config"] = {
                "min_replicas": self.replicas,
                "max_replicas": self.max_replicas,
                "target_ongoing_requests": 1,
            }
        return options

    def ingress_options(self) -> dict[str, Any]:
        actor: dict[str, Any] = {"num_cpus": 0}
        if self.ingress_node_ip:
            # Ray gives each node a `node:<ip>` resource; a sliver of it pins the ingress (and its restarts) there.
            actor["resources"] = {f"node:{self.ingress_node_ip}": 0.001}
        return {"name": INGRESS, "num_replicas": 1, "ray_actor_options": actor, "max_ongoing_requests": 256}
