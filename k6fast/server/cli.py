"""`k6fast serve`: the OpenAI-compatible video server on uvicorn (also `python -m k6fast.server`).

Every option is checked, the device looked for, the data directory owned (datadir.py), made private (0700) and
locked, its job store opened and checked, and the socket bound before anything loads, so a bad setting, a missing GPU,
a taken port, a folder holding someone else's files, a busy or unreadable data directory, a corrupt store or a full
disk fails at once with one line `error: ...` (with the recovery step where there is one) and exit status 2; the
model then loads in the background while `/health` answers 503. If loading fails, the server stops with exit
status 1.
"""

from __future__ import annotations

import argparse
import logging
import math
import socket
import sqlite3
import sys
from pathlib import Path

from ..cli_args import DTYPES, device_problem, no_gpu_device_files, size_arg
from .config import CPU_LIMITS, DEFAULT_DATA_DIR, GPU_LIMITS, Limits, ServerConfig, device_limits, fmt_size, limits_of
from .ray_cli import RayServeError, add_ray_arguments, ray_settings_from_args

log = logging.getLogger("k6fast.server")


class ServeError(Exception):
    """A user error: printed as `error: ...` with exit status 2."""


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hub id or local Diffusers-layout checkpoint directory")
    p.add_argument("--arm", help="named arm (switches/arms/NAME.env) or path to an .env file; env vars override it")
    p.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=DTYPES, help="compute dtype (default: bf16 GPU, fp32 CPU)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8094, help="port (default 8094; 0 = any free port, logged)")
    p.add_argument("--data-dir", type=Path, help=f"jobs and videos (default: K6_DATA_DIR, else ./{DEFAULT_DATA_DIR})")
    p.add_argument("--served-model-name", help="the `model` clients send (default: the checkpoint folder's name)")
    p.add_argument("--max-queue", type=int, default=16, help="queued jobs before POST answers 429 (default 16)")
    gpu, cpu = GPU_LIMITS, CPU_LIMITS
    on = lambda name: f"GPU {getattr(gpu, name)}, CPU {getattr(cpu, name)}"  # noqa: E731
    sizes = lambda name: f"GPU {fmt_size(getattr(gpu, name))}, CPU {fmt_size(getattr(cpu, name))}"  # noqa: E731
    p.add_argument("--max-size", type=size_arg, help=f"largest WIDTHxHEIGHT, either orientation ({sizes('max_size')})")
    p.add_argument("--max-frames", type=int, help=f"longest clip in frames ({on('max_frames')})")
    p.add_argument("--max-steps", type=int, help=f"most denoising steps per job ({on('max_steps')})")
    p.add_argument("--default-size", type=size_arg, help=f"size when a request gives none ({sizes('default_size')})")
    p.add_argument("--default-seconds", help=f"seconds when a request gives none ({on('default_seconds')})")
    p.add_argument("--ttl-hours", type=float, default=24.0, help="finished jobs and their files live this long")
    p.add_argument("--max-upload-mb", type=float, default=20.0, help="largest input_reference image (default 20)")
    p.add_argument("--poll-after-ms", type=int, default=1000, help="the openai-poll-after-ms hint (default 1000)")
    p.add_argument("--max-attempts", type=int, default=3, help="starts of a job across crashes before it fails")
    p.add_argument(
        "--body-timeout-s",
        type=float,
        default=60.0,
        help="a create request's body must arrive within this (default 60)",
    )
    add_ray_arguments(p)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `serve` to the `k6fast` command line."""
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible /v1/videos API (FastAPI + uvicorn)")
    add_serve_arguments(p)
    p.set_defaults(func=cmd_serve)


def served_name(model: str) -> str:
    path = Path(model).expanduser()
    return path.resolve().name if path.is_dir() else model


def _is_hub_id(model: str) -> bool:
    """`organisation/name` that is not a local path: resolving it may download, so it happens in the background."""
    return not Path(model).expanduser().exists() and model.count("/") == 1 and not model.startswith((".", "/", "~"))


def limits_from_args(args: argparse.Namespace) -> Limits:
    """The request limits: those given on the command line, the rest this device's defaults."""
    cpu = args.device == "cpu" or (args.device is None and no_gpu_device_files())
    given = {name: getattr(args, name) for name in ("max_size", "max_frames", "max_steps", "default_size")}
    return device_limits(cpu, default_seconds=args.default_seconds, **given)


def config_from_args(args: argparse.Namespace, data_dir_default: Path | None) -> ServerConfig:
    upload_mb = args.max_upload_mb
    if not math.isfinite(upload_mb) or not 0 < upload_mb <= 1024:
        raise ServeError(f"--max-upload-mb must be a number in (0, 1024], found {upload_mb}")
    if not math.isfinite(args.ttl_hours) or args.ttl_hours <= 0:
        raise ServeError(f"--ttl-hours must be a positive number, found {args.ttl_hours}")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ServeError("--served-model-name must not be empty")
    try:
        config = ServerConfig(
            model=args.model,
            served_model_name=args.served_model_name or served_name(args.model),
            data_dir=Path(args.data_dir or data_dir_default or DEFAULT_DATA_DIR).expanduser(),
            host=args.host,
            port=args.port,
            device=args.device,
            dtype=args.dtype,
            max_queue=args.max_queue,
            **vars(limits_from_args(args)),
            ttl_seconds=args.ttl_hours * 3600.0,
            max_upload_bytes=int(upload_mb * 2**20),
            poll_after_ms=args.poll_after_ms,
            max_attempts=args.max_attempts,
            body_timeout_s=args.body_timeout_s,
        )
    except ValueError as exc:
        raise ServeError(str(exc)) from None
    return config


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); expected a free port") from None
    return sock


def check_data_dir(config: ServerConfig) -> None:
    """What the server does to its data directory at start, done once here so that any failure is a ServeError: own
    it, lock it, open and check its job store."""
    from .datadir import DataDirBusy, DataDirLock, DataDirRefused, own_data_dir
    from .jobs import JobStore, StoreUnreadable
    from .storage import is_disk_full

    probe = DataDirLock(config.data_dir)
    try:
        own_data_dir(config.data_dir)
        probe.acquire()
        JobStore(config.jobs_db).close()
    except (DataDirBusy, DataDirRefused, StoreUnreadable) as exc:
        raise ServeError(str(exc)) from None
    except (OSError, sqlite3.Error) as exc:
        if is_disk_full(exc):
            raise ServeError(
                f"the disk holding the data directory {config.data_dir} is full; free space there (or choose "
                "another --data-dir) and start again"
            ) from None
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or "not usable"
        raise ServeError(
            f"cannot use the data directory {config.data_dir} ({why}); expected a directory this user can create, "
            "read and write"
        ) from None
    finally:
        probe.release()


def cmd_serve(args: argparse.Namespace) -> int:
    from ..checkpoint import open_checkpoint
    from ..switches import load_options

    options = load_options(arm=args.arm)
    config = config_from_args(args, options.data_dir)
    problem = device_problem(config.device)
    if problem:
        raise ServeError(f"--device {config.device}: {problem}")
    try:
        ray_settings = ray_settings_from_args(args)
    except RayServeError as exc:
        raise ServeError(str(exc)) from None
    if not _is_hub_id(config.model):
        open_checkpoint(config.model)  # configs and safetensors headers only: a broken checkpoint fails now
    check_data_dir(config)
    if ray_settings is not None:  # Serve's proxy listens, the replicas load the model (ray_cli.py)
        from .ray_cli import serve_on_ray

        try:
            return serve_on_ray(config, options, ray_settings, args.address)
        except RayServeError as exc:
            raise ServeError(str(exc)) from None
    sock = _listen(config.host, config.port)

    if not logging.getLogger("k6fast").handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.getLogger("k6fast").addHandler(handler)
        logging.getLogger("k6fast").setLevel(logging.INFO)

    import uvicorn

    from .app import create_app

    outcome = {"exit": 0}
    server: uvicorn.Server | None = None

    def on_load_error(exc: BaseException) -> None:
        outcome["exit"] = 1
        if server is not None:
            server.should_exit = True

    app = create_app(config, options, on_load_error=on_load_error)
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=10))
    host, port = sock.getsockname()[:2]
    log.info(
        "serving %s as %r on http://%s:%d/v1 (data dir %s, arm %s [%s], %s; limits: %s)",
        config.model,
        config.served_model_name,
        host,
        port,
        config.data_dir,
        options.arm_name,
        options.arm_hash(),
        "API key required" if options.api_key else "no API key",
        limits_of(config).describe(),
    )
    server.run(sockets=[sock])
    if not server.started:
        return 1
    return outcome["exit"]


def main(argv: list[str] | None = None) -> int:
    from ..checkpoint import CheckpointError
    from ..entry import quiet_warnings
    from ..switches import SwitchError

    quiet_warnings()
    parser = argparse.ArgumentParser(
        prog="python -m k6fast.server", description="k6fast serve: an OpenAI-compatible /v1/videos server"
    )
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return cmd_serve(args)
    except (ServeError, CheckpointError, SwitchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
