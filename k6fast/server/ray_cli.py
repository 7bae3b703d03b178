"""The `--ray` options of `k6fast serve` and what runs them. Importing this module needs no Ray.

    k6fast serve --ray --replicas 4 --model M                     # a local Ray cluster (or the one `ray start` made)
    k6fast serve --ray --address HEAD:6379 --replicas 8 --model M  # an existing multi-node cluster

The command deploys the application (ray_app.py), waits until every replica has loaded its pipeline, then serves
until SIGINT or SIGTERM, when it deletes the application: running jobs go back to the queue in the store, and the
next start runs them.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import threading

from .config import ServerConfig, fmt_size
from .ray_settings import RaySettings

log = logging.getLogger("k6fast.server")
_RAY_ONLY = ("replicas", "max_replicas", "gpus_per_replica", "address", "shared_data_dir")


class RayServeError(ValueError):
    """A user error of the --ray options (printed as `error: ...`, exit status 2)."""


def add_ray_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("many GPUs and machines (Ray Serve; needs the k6fast[ray] extra on every node)")
    g.add_argument("--ray", action="store_true", help="serve through Ray Serve: one pipeline per replica")
    g.add_argument("--replicas", type=int, help="generator replicas (default 1; the minimum with --max-replicas)")
    g.add_argument("--max-replicas", type=int, help="autoscale between --replicas and this on queued jobs")
    g.add_argument(
        "--gpus-per-replica", type=float, help="GPU share of a replica (default 1; 0.5 = two per GPU; 0 = CPU)"
    )
    g.add_argument(
        "--address",
        help="Ray cluster to join, e.g. HEAD_IP:6379 (default: RAY_ADDRESS, else one `ray start` made here, "
        "else a new local one)",
    )
    g.add_argument(
        "--shared-data-dir",
        action="store_true",
        help="--data-dir is mounted at the same path on every node: replicas write clips there directly",
    )


def ray_settings_from_args(args: argparse.Namespace) -> RaySettings | None:
    """The Ray layout asked for, or None without --ray (where the Ray-only options are refused)."""
    if not getattr(args, "ray", False):
        given = [f"--{name.replace('_', '-')}" for name in _RAY_ONLY if getattr(args, name, None) not in (None, False)]
        if given:
            raise RayServeError(f"{', '.join(given)} only apply with --ray")
        return None
    try:
        return RaySettings(
            replicas=1 if args.replicas is None else args.replicas,
            max_replicas=args.max_replicas,
            gpus_per_replica=1.0 if args.gpus_per_replica is None else args.gpus_per_replica,
            shared_data_dir=args.shared_data_dir,
        )
    except ValueError as exc:
        raise RayServeError(str(exc)) from None


def check_local_gpus(settings: RaySettings, gpus: float) -> None:
    """Refuse a deployment whose replicas need more GPUs than the local cluster has (`gpus`, Ray's count)."""
    needed = settings.replicas * settings.gpus_per_replica
    if needed > gpus + 1e-9:
        raise RayServeError(
            f"--replicas {settings.replicas} at --gpus-per-replica {settings.gpus_per_replica:g} need {needed:g} "
            f"GPU(s); the Ray cluster on this machine has {gpus:g}: expected fewer replicas, --gpus-per-replica 0 "
            "(CPU replicas, for tests), or --address of a cluster with the GPUs"
        )


def serve_on_ray(config: ServerConfig, options, settings: RaySettings, address: str | None) -> int:
    """Deploy and serve until a signal; returns the exit status."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise RayServeError(
            "--ray needs Ray Serve, which is not installed; expected `pip install 'k6fast[ray]'`"
        ) from None
    from .ray_app import build_app
    from .ray_replica import ensure_logging

    ensure_logging()
    try:
        ray.init(address=address, logging_level=logging.WARNING)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        raise RayServeError(f"cannot join the Ray cluster at {address or 'RAY_ADDRESS'} ({exc})") from None
    try:
        if address is None and not os.environ.get("RAY_ADDRESS"):
            # A cluster on this machine alone gains no GPUs later: replicas it cannot place would wait forever.
            check_local_gpus(settings, ray.cluster_resources().get("GPU", 0.0))
        # The ingress owns --data-dir (the job store's lock and files), so it runs on this machine.
        settings = dataclasses.replace(settings, ingress_node_ip=ray.util.get_node_ip_address())
        serve.start(http_options={"host": config.host, "port": config.port})
        log.info(
            "deploying %s on Ray: %s replica(s), %s GPU each; waiting until every replica has loaded it",
            config.model,
            f"{settings.replicas}-{settings.max_replicas}" if settings.max_replicas else settings.replicas,
            settings.gpus_per_replica,
        )
        # Ctrl-C (or SIGTERM) from here on stops the server the graceful way, also while the replicas still load:
        # the deploy finishes, then running jobs go back to the queue and the application is deleted. A second one
        # gives up waiting. Installed after serve.run, a signal during the deploy ended the process inside Ray's
        # wait, leaving the application deployed (CI's existing-cluster test caught it).
        stop = threading.Event()

        def on_signal(signum, frame) -> None:
            if stop.is_set():
                raise KeyboardInterrupt
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        try:
            serve.run(build_app(config, options, settings), name=settings.app_name, route_prefix="/")
        except RuntimeError as exc:
            log.error("could not deploy: %s", exc)
            serve.delete(settings.app_name)
            return 1
        log.info(
            "serving %s as %r on http://%s:%d/v1 (data dir %s, arm %s [%s], %s, max size %s)",
            config.model,
            config.served_model_name,
            config.host,
            config.port,
            config.data_dir,
            options.arm_name,
            options.arm_hash(),
            "API key required" if options.api_key else "no API key",
            fmt_size(config.max_size),
        )
        while not stop.wait(1.0):
            pass
        log.info("stopping: running jobs go back to the queue")
        if not serve.get_app_handle(settings.app_name).stop_dispatching.remote().result(timeout_s=120):
            log.warning("a running job did not stop in time; it runs again at the next start")
        serve.delete(settings.app_name)
        return 0
    finally:
        ray.shutdown()
