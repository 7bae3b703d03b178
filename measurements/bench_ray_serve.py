"""`k6fast serve --ray` throughput: R generator replicas sharing one GPU against one replica, through the official
`openai` SDK and Serve's HTTP proxy, as a client sees it.

Each configuration (`--configs 1x1,2x0.5` = 1 replica with a whole GPU, then 2 replicas with half a GPU each)
deploys the application on a local Ray cluster, warms every replica with --warmup untimed requests of the measured
geometry (the `final` arm compiles its blocks on its first request; 0 where K6_INDUCTOR_CACHE_DIR holds a warm cache),
then submits --requests requests at once and polls until all are done. Reported per configuration: wall time from
the first submit to the last completion, requests per hour, each job's replica and time, and per replica its peak
VRAM (the pipeline's telemetry; also nvidia-smi's per-process memory where the GPU's process ids are visible), peak
host RSS and job count.

Run (an H200; a synthetic checkpoint; one configuration per command, so that each stays inside a 10-minute limit;
the time is about load + warm-up compile + N x one request's time / the replicas' speed-up, not measured yet):
  k6fast make-synthetic /tmp/syn --preset pro-distill --blocks 6
  export K6_INDUCTOR_CACHE_DIR=/tmp/k6-inductor          # the second configuration reuses the first's compile
  python measurements/bench_ray_serve.py --model /tmp/syn --arm final --budget-gb 32 --requests 8 \
      --configs 1x1 --out ray1.json
  python measurements/bench_ray_serve.py --model /tmp/syn --arm final --budget-gb 32 --requests 8 \
      --configs 2x0.5 --out ray2.json
  python measurements/bench_ray_serve.py --report ray1.json ray2.json --out ray_serve_h200.json   # the comparison
  (--smoke: the tiny checkpoint on the CPU at 64x64x5, to check this script end to end; its numbers mean nothing)
Needs the k6fast[ray] extra (ray[serve], fastapi, uvicorn, openai). On a machine without a network, bring Python
3.12 wheels: `pip download --only-binary=:all: --python-version 3.12 --implementation cp --platform
manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d .whlray 'ray[serve]==2.60.0' openai
python-multipart`, minus what the machine has. Ray's own wheel (77 MB) is larger than some file-transfer limits:
`split -b 50m` it and join the parts there with `cat` before `pip install --no-index --no-deps`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

GiB = 1 << 30
W1 = (864, 480, 121)
APP = "k6fast"


def parse_configs(text: str) -> list[tuple[int, float]]:
    """`1x1,2x0.5` -> [(1, 1.0), (2, 0.5)]: replicas x GPU share of each."""
    configs = []
    for item in text.split(","):
        replicas, _, share = item.strip().partition("x")
        try:
            configs.append((int(replicas), float(share)))
        except ValueError:
            raise SystemExit(f"--configs: expected REPLICASxGPU_SHARE items like 2x0.5, found {item!r}") from None
    return configs


def parse_geometry(text: str) -> tuple[int, int, int]:
    if text.lower() == "w1":
        return W1
    try:
        width, height, frames = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--geometry: expected w1 or WIDTHxHEIGHTxFRAMES, found {text!r}") from None
    return width, height, frames


class GpuMemorySampler:
    """nvidia-smi's memory per GPU process, sampled every second; the maximum per pid (empty without nvidia-smi, or
    where the container hides the processes' ids)."""

    def __init__(self) -> None:
        self.peak_mib: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> GpuMemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
        while not self._stop.wait(1.0):
            try:
                text = subprocess.run(query, capture_output=True, text=True, timeout=10, check=True).stdout
            except (OSError, subprocess.SubprocessError):
                return
            for line in text.strip().splitlines():
                pid, _, mib = line.partition(",")
                if pid.strip().isdigit() and mib.strip().isdigit():
                    self.peak_mib[int(pid)] = max(self.peak_mib.get(int(pid), 0), int(mib))


def _wait_healthy(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the application at {url} was not healthy within {timeout:.0f} s")


def _run_requests(client: Any, prompts: list[str], geometry: tuple[int, int, int], steps: int | None, timeout: float):
    """Submit all at once, poll until all finish; returns (seconds from first submit to last completion, per-job
    [id, seconds to completion as the client saw it])."""
    width, height, frames = geometry
    extra: dict[str, Any] = {"num_frames": frames}
    if steps is not None:
        extra["num_inference_steps"] = steps
    start = time.perf_counter()
    ids = [
        client.videos.create(prompt=p, size=f"{width}x{height}", extra_body={**extra, "seed": i}).id
        for i, p in enumerate(prompts)
    ]
    done: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while len(done) < len(ids):
        if time.monotonic() > deadline:
            raise SystemExit(f"{len(ids) - len(done)} request(s) still running after {timeout:.0f} s")
        for video_id in ids:
            if video_id not in done:
                video = client.videos.retrieve(video_id)
                if video.status == "failed":
                    raise SystemExit(f"{video_id} failed: {video.error}")
                if video.status == "completed":
                    done[video_id] = time.perf_counter() - start
        time.sleep(0.25)
    return max(done.values()), [(video_id, done[video_id]) for video_id in ids]


def run_config(args: argparse.Namespace, options: Any, replicas: int, share: float, port: int) -> dict[str, Any]:
    import ray
    from openai import OpenAI
    from ray import serve

    from k6fast.server.config import ServerConfig, seconds_for_frames
    from k6fast.server.jobs import JobStore
    from k6fast.server.ray_app import build_app
    from k6fast.server.ray_settings import RaySettings

    width, height, frames = args.geometry
    data_dir = Path(tempfile.mkdtemp(prefix=f"k6-ray-bench-{replicas}x{share}-"))
    # The largest request a server accepts sizes what each replica's residency planner reserves: the measured one.
    config = ServerConfig(
        model=args.model,
        served_model_name="bench",
        data_dir=data_dir,
        device=args.device,
        max_queue=max(16, args.requests),
        max_size=(width, height),
        default_size=(width, height),
        default_seconds=seconds_for_frames(frames),
        max_frames=frames,
        poll_after_ms=250,
    )
    settings = RaySettings(replicas=replicas, gpus_per_replica=share, ingress_node_ip=ray.util.get_node_ip_address())
    url = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    serve.run(build_app(config, options, settings), name=APP, route_prefix="/")
    _wait_healthy(url, args.timeout_s)
    load_s = time.perf_counter() - started
    client = OpenAI(base_url=f"{url}/v1", api_key=options.api_key or "unused", max_retries=2, timeout=60.0)
    try:
        with GpuMemorySampler() as sampler:
            warm_s = 0.0
            if args.warmup:
                warm = [f"warm-up {i}" for i in range(replicas * args.warmup)]
                warm_s, _ = _run_requests(client, warm, args.geometry, args.steps, args.timeout_s)
            prompts = [f"request {i}: a fox runs through snow, wind howling" for i in range(args.requests)]
            wall_s, jobs = _run_requests(client, prompts, args.geometry, args.steps, args.timeout_s)
    finally:
        serve.delete(APP)
    store = JobStore(data_dir / "jobs.sqlite3")
    try:
        records = {video_id: store.get(video_id) for video_id, _ in jobs}
    finally:
        store.close()
    rows, per_replica = [], {}
    for video_id, seen_s in jobs:
        telemetry = records[video_id].telemetry
        replica = telemetry["ray"]["replica"]
        rows.append(
            {
                "id": video_id,
                "replica": replica["replica"],
                "pid": replica["pid"],
                "done_after_s": round(seen_s, 3),
                "job_s": telemetry["job_s"],
                "phases_s": telemetry["phases_s"],
                "peak_vram_bytes": telemetry["peak_vram_bytes"],
                "peak_host_rss_bytes": telemetry["peak_host_rss_bytes"],
                "attempts": telemetry["ray"]["attempts"],
            }
        )
        entry = per_replica.setdefault(replica["replica"], {"pid": replica["pid"], "jobs": 0})
        entry["jobs"] += 1
        entry["peak_vram_bytes"] = max(entry.get("peak_vram_bytes", 0), telemetry["peak_vram_bytes"])
        entry["peak_host_rss_bytes"] = max(entry.get("peak_host_rss_bytes", 0), telemetry["peak_host_rss_bytes"])
    for entry in per_replica.values():
        entry["nvidia_smi_peak_mib"] = sampler.peak_mib.get(entry["pid"])
    return {
        "replicas": replicas,
        "gpus_per_replica": share,
        "requests": args.requests,
        "geometry": list(args.geometry),
        "steps": args.steps,
        "load_s": round(load_s, 3),
        "warmup_requests": replicas * args.warmup,
        "warmup_s": round(warm_s, 3),
        "wall_s": round(wall_s, 3),
        "requests_per_hour": round(args.requests / wall_s * 3600, 2),
        "job_s_p50": round(statistics.median(r["job_s"] for r in rows), 3),
        "per_replica": per_replica,
        "gpu_processes_peak_mib": sampler.peak_mib,
        "jobs": rows,
    }


def environment() -> dict[str, Any]:
    import ray
    import torch

    env = {"torch": torch.__version__, "ray": ray.__version__, "python": sys.version.split()[0]}
    query = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"]
    try:
        env["gpus"] = subprocess.run(query, capture_output=True, text=True, timeout=10, check=True).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        env["gpus"] = []
    env["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return env


def print_table(configs: list[dict[str, Any]]) -> None:
    base = configs[0]["requests_per_hour"]
    print(f"{'replicas x GPU':>15} {'N':>3} {'wall s':>8} {'req/h':>8} {'vs first':>8} {'job s p50':>9}  replicas")
    for c in configs:
        replicas = "; ".join(
            f"{rid}: {e['jobs']} jobs, VRAM {e['peak_vram_bytes'] / GiB:.2f} GiB"
            + (f" (smi {e['nvidia_smi_peak_mib'] / 1024:.2f} GiB)" if e.get("nvidia_smi_peak_mib") else "")
            + f", RSS {e['peak_host_rss_bytes'] / GiB:.2f} GiB"
            for rid, e in c["per_replica"].items()
        )
        print(
            f"{c['replicas']:>9} x {c['gpus_per_replica']:<3} {c['requests']:>3} {c['wall_s']:>8.1f} "
            f"{c['requests_per_hour']:>8.1f} {c['requests_per_hour'] / base:>7.2f}x {c['job_s_p50']:>9.1f}  {replicas}"
        )
    for c in configs:
        print(
            f"{c['replicas']}x{c['gpus_per_replica']}: "
            + ", ".join(f"{j['id'][-6:]}->{j['replica']}" for j in c["jobs"])
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON record")
    p.add_argument("--model", help="checkpoint directory (a synthetic one: k6fast make-synthetic)")
    p.add_argument("--arm", help="the replicas' arm (default: final; reference with --smoke)")
    p.add_argument("--budget-gb", type=float, default=32.0, help="K6_VRAM_BUDGET_GB of every replica")
    p.add_argument("--set", action="append", default=[], metavar="K6_X=V", help="another switch for the replicas")
    p.add_argument("--requests", type=int, default=8, help="timed requests per configuration")
    p.add_argument("--configs", default="1x1,2x0.5", help="REPLICASxGPU_SHARE, comma-separated")
    p.add_argument("--warmup", type=int, default=1, help="untimed requests per replica first (default 1; 0 when the "
                   "compile caches are warm and the first request's own start-up belongs in the figure)")  # fmt: skip
    p.add_argument("--geometry", type=parse_geometry, default=W1, help="w1 or WIDTHxHEIGHTxFRAMES")
    p.add_argument("--steps", type=int, help="denoising steps (default: the checkpoint's)")
    p.add_argument("--device", help="replica device (default: cuda)")
    p.add_argument("--address", help="an existing Ray cluster (default: a new local one)")
    p.add_argument("--port", type=int, default=8094, help="Serve's HTTP port")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per wait (deploy, warm-up, timed run)")
    p.add_argument("--smoke", action="store_true", help="tiny checkpoint on the CPU: checks this script only")
    p.add_argument("--report", nargs="+", metavar="JSON", help="merge records of earlier runs and print the table")
    args = p.parse_args(argv)

    if args.report:
        records = [json.loads(Path(path).read_text()) for path in args.report]
        configs = [c for record in records for c in record["configs"]]
        Path(args.out).write_text(json.dumps({"records": records, "configs": configs}, indent=2) + "\n")
        print_table(configs)
        return 0
    if args.smoke:
        from k6fast.testing.tiny import make_tiny

        args.model = str(args.model or make_tiny(Path(tempfile.mkdtemp(prefix="k6-tiny-")) / "tiny", seed=0))
        args.device, args.geometry, args.steps = "cpu", (64, 64, 5), args.steps or 2
        args.arm = args.arm or "reference"  # the final arm compiles (minutes on a CPU) and caches step 8
        args.configs = args.configs if args.configs != "1x1,2x0.5" else "1x0,2x0"
    if not args.model:
        p.error("--model is required (or --smoke, or --report)")
    # The replicas' switches: this environment, the budget and --set on top (the process's own is left alone).
    environ = {**os.environ, "K6_VRAM_BUDGET_GB": str(args.budget_gb)}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep or not name.startswith("K6_"):
            p.error(f"--set expects K6_NAME=VALUE, found {item!r}")
        environ[name] = value
    # Ray starts its workers in the driver's working directory, which is on their sys.path: run from a source
    # checkout whose k6fast is not the installed one (`pip install --target`), ./k6fast shadowed the installed
    # package in every replica (k6fast.switches is mapped at install time). Local paths are made absolute (a Hub id
    # stays as it is), then a neutral directory is the working one.
    if Path(args.model).exists():
        args.model = str(Path(args.model).resolve())
    args.out = str(Path(args.out).resolve())
    os.chdir(tempfile.mkdtemp(prefix="k6-ray-bench-cwd-"))

    import ray
    from ray import serve

    from k6fast.switches import load_options, provenance

    options = load_options(environ, arm=args.arm or "final")
    if not ray.is_initialized():
        env = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""} if args.smoke else {}
        ray.init(address=args.address, include_dashboard=False, runtime_env={"env_vars": env})
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    configs = [run_config(args, options, replicas, share, args.port) for replicas, share in parse_configs(args.configs)]
    record = {
        "what": "k6fast serve --ray: requests per hour, R replicas sharing one GPU vs one",
        "command": " ".join(sys.argv) if argv is None else " ".join(argv),
        "environment": environment(),
        "model": args.model,
        "provenance": provenance(options),
        "smoke": args.smoke,
        "configs": configs,
    }
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print_table(configs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
