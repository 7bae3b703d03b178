"""`k6fast serve` at its defaults, as a user first runs it: `k6fast serve --model M --arm ARM` with no size options
under K6_VRAM_BUDGET_GB, four queued jobs of two sizes through the official `openai` SDK (plain HTTP where the SDK is
missing; the record says which), one prompt repeated (the prompt-embedding cache), one job DELETEd once it has reached
--delete-at percent, and one request larger than the budget holds, which must get a 400 naming what fits before it is
queued.

Recorded: start-up to ready (load and warm-up), per job submit → completed and start → completed as the client saw
them, the server's telemetry for the job (its phases, read from the job store once the server has stopped), the
server process's peak RSS and the bytes it read from disk (/proc/PID/io, sampled every 0.25 s; deltas per job),
nvidia-smi's memory above idle, how long the DELETE took to stop the job and in which phase (the server's log), and
the oversize request's status and message. One JSON record; a short table on stdout; exit 1 when anything did not go
as planned (the record says what). Every wait has a deadline: a stuck server ends the run with a failure.

Run (an H200; a full-depth synthetic checkpoint; the arm's warm compile cache from `k6fast acceptance`):
  python measurements/bench_serve_defaults.py --model /tmp/lease/syn --arm final --budget-gb 32 \
      --set K6_INDUCTOR_CACHE_DIR=/tmp/lease/work/cache/final --record /tmp/lease/record
  (--record DIR: an acceptance record folder; the JSON goes to DIR/serve/ARM-BUDGET.json and DIR/README.md is
  rendered again with it. Or --out FILE.)
The CPU test (tests/test_bench_serve_defaults.py) runs it on the tiny checkpoint with small sizes.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path
from typing import Any

from k6fast.bench.acceptance import ProcessWatch, write_readme
from k6fast.bench.acceptance_report import SERVE_DIR
from k6fast.bench.records import DEFAULT_PROMPT
from k6fast.bench.serve_report import serve_lines

SECOND_PROMPT = "A paper boat drifting down a gutter stream after a summer storm. Audio: water trickling, birdsong."
# (name, size, prompt, plan): the first job encodes the prompt, the next two reuse it, the last brings a new one.
JOBS = (
    ("large-first-prompt", "large", DEFAULT_PROMPT, "complete"),
    ("small-same-prompt", "small", DEFAULT_PROMPT, "complete"),
    ("large-deleted", "large", DEFAULT_PROMPT, "delete"),
    ("small-second-prompt", "small", SECOND_PROMPT, "complete"),
)
# --jobs: all four, or only the first (a W1 job from a fresh prompt, with the oversize request: that an arm starts and
# completes a job at a budget, for the arms and budgets beyond the one measured in full).
JOB_SETS = {"all": JOBS, "first": JOBS[:1]}
SERVING = re.compile(r"serving .* on (http://\S+?)/v1 ")
CANCELLED = re.compile(r"job (\S+): cancelled \(deleted\) during (\S+) \((.*)\) after ([\d.]+) s")
LOADED = re.compile(r"ready: .* loaded and warmed up in ([\d.]+) s")
WARMUP = re.compile(r"warm-up generation took ([\d.]+) s")
ERROR_LINE = re.compile(r"^(error: |[\w.]+(Error|Exception): )|ERROR ")


def geometry(text: str) -> tuple[int, int, int]:
    try:
        width, height, frames = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHTxFRAMES such as 864x480x121, found {text!r}") from None
    return width, height, frames


def label(g: tuple[int, int, int]) -> str:
    return "x".join(str(v) for v in g)


class Failure(Exception):
    """The run cannot go on: the server died, a wait ran out, or the API answered what it must not."""


class LogTail:
    """The server's log file, read from where the last read stopped."""

    def __init__(self, path: Path):
        self.path, self.offset, self.text = path, 0, ""

    def read(self) -> str:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                new = f.read().decode(errors="replace")
        except OSError:
            return self.text
        self.offset += len(new.encode())
        self.text += new
        return self.text

    def search(self, pattern: re.Pattern) -> re.Match | None:
        return pattern.search(self.read())

    def tail(self, lines: int = 20) -> list[str]:
        """The last lines of the server's own log, uvicorn's access lines (one per poll) left out."""
        return [line for line in self.read().splitlines() if '" 200 OK' not in line][-lines:]

    def why(self) -> str:
        """The server's last error line (an exception's or `error: ...`) and its last line."""
        lines = self.tail(400)
        errors = [line for line in lines if ERROR_LINE.search(line)]
        return " | ".join(dict.fromkeys(line.strip() for line in [*errors[-1:], *lines[-1:]])) or "no output"


class Api:
    """The Videos API through the openai SDK, or plain HTTP without it: each call returns (status, JSON body)."""

    def __init__(self, base_url: str, force_http: bool = False):
        self.base_url = base_url
        self.sdk = None
        if not force_http:
            try:
                import openai
            except ImportError:
                openai = None
            client = openai and openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60.0)
            if client is not None and hasattr(client, "videos"):  # the Videos API came with openai 1.x in 2025
                self.sdk, self.client = openai, client
        why = "forced" if force_http else "no openai SDK with the Videos API installed"
        self.name = f"openai {self.sdk.__version__} SDK" if self.sdk else f"plain HTTP ({why})"

    def _sdk_call(self, call) -> tuple[int, dict]:
        try:
            return 200, call().model_dump()
        except self.sdk.APIStatusError as exc:
            body = exc.body if isinstance(exc.body, dict) else {"message": str(exc)}
            return exc.status_code, body.get("error", body)

    def _http(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.base_url}/v1/videos{path}", data=data, method=method,
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            try:
                payload = json.loads(exc.read())
            except ValueError:
                payload = {}
            return exc.code, payload.get("error", payload)

    def create(self, prompt: str, g: tuple[int, int, int], seed: int, steps: int | None) -> tuple[int, dict]:
        extra = {"num_frames": g[2], "seed": seed, **({"num_inference_steps": steps} if steps else {})}
        if self.sdk:
            size = f"{g[0]}x{g[1]}"
            return self._sdk_call(lambda: self.client.videos.create(prompt=prompt, size=size, extra_body=extra))
        return self._http("POST", "", {"prompt": prompt, "size": f"{g[0]}x{g[1]}", **extra})

    def retrieve(self, video_id: str) -> tuple[int, dict]:
        if self.sdk:
            return self._sdk_call(lambda: self.client.videos.retrieve(video_id))
        return self._http("GET", f"/{video_id}")

    def delete(self, video_id: str) -> tuple[int, dict]:
        if self.sdk:
            return self._sdk_call(lambda: self.client.videos.delete(video_id))
        return self._http("DELETE", f"/{video_id}")

    def list_ids(self) -> set[str]:
        if self.sdk:
            return {v.id for v in self.client.videos.list(limit=100)}
        return {v["id"] for v in self._http("GET", "?limit=100")[1].get("data", [])}

    def download(self, video_id: str, path: Path) -> int:
        if self.sdk:
            self.client.videos.download_content(video_id).write_to_file(path)
        else:
            with urllib.request.urlopen(f"{self.base_url}/v1/videos/{video_id}/content", timeout=120) as r:
                path.write_bytes(r.read())
        head = path.read_bytes()[:12]
        if head[4:8] != b"ftyp":
            raise Failure(f"{video_id}: the content is not an MP4 (starts {head!r})")
        return path.stat().st_size


class Server:
    """`k6fast serve` as a subprocess (the installed k6fast: it runs in a neutral folder), its log in a file."""

    def __init__(self, args: argparse.Namespace, work: Path):
        self.log_path = work / "server.log"
        self.command = [sys.executable, "-m", "k6fast.cli", "serve", "--model", args.model, "--port", "0",
                        "--data-dir", str(work / "data"), *(["--arm", args.arm] if args.arm else [])]  # fmt: skip
        # The caller's switches and compile caches stay out: the arm, the budget and --set decide.
        env = {k: v for k, v in os.environ.items() if not k.startswith("K6_")}
        for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"):
            env.pop(name, None)
        env.update(K6_VRAM_BUDGET_GB=f"{args.budget_gb:g}", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", **args.switches)
        self.started = time.perf_counter()
        with open(self.log_path, "wb") as log:
            # In this script's process group: a `timeout` or a lease's `stop` that ends the group ends the server too.
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work)
        self.log = LogTail(self.log_path)
        self.url: str | None = None

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise Failure(f"the server exited with status {self.proc.returncode}: {self.log.why()}")

    def wait_ready(self, deadline: float) -> float:
        """Seconds from the start to /health answering 200 (the model loaded and warmed up)."""
        while time.monotonic() < deadline:
            self.check_alive()
            if self.url is None and (match := self.log.search(SERVING)):
                self.url = match.group(1)
            if self.url is not None:
                try:
                    with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                        if response.status == 200:
                            return time.perf_counter() - self.started
                except OSError:  # 503 while loading (HTTPError is an OSError), or not accepting yet
                    pass
            time.sleep(0.25)
        raise Failure(f"the server was not ready in time: {self.log.why()}")

    def stop(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """SIGTERM (the worker stops its job, uvicorn shuts down), SIGKILL after `timeout_s`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
                return {"exit": "killed after SIGTERM timed out"}
        return {"exit": self.proc.returncode}


def run_jobs(api: Api, server: Server, watch: ProcessWatch, args: argparse.Namespace, deadline: float,
             record: dict) -> None:  # fmt: skip
    """Submit the jobs (--jobs) and the oversize request and follow the jobs, oldest first (the order the worker runs
    them), to their end; fills record["jobs"] and record["oversize"] as it goes, so a failure keeps what was seen."""
    sizes, chosen = {"large": args.large, "small": args.small}, JOB_SETS[args.jobs]
    jobs = [{"name": n, "geometry": label(sizes[s]), "prompt": "second" if p != DEFAULT_PROMPT else "first",
             "seed": i + 1, "plan": plan, "outcome": None} for i, (n, s, p, plan) in enumerate(chosen)]  # fmt: skip
    record["jobs"] = jobs
    start = time.perf_counter()
    since = lambda: round(time.perf_counter() - start, 3)  # noqa: E731
    for job, (_, size, prompt, _) in zip(jobs, chosen, strict=True):
        status, body = api.create(prompt, sizes[size], job["seed"], args.steps)
        if status != 200:
            raise Failure(f"{job['name']}: POST answered {status}: {body.get('message')}")
        job.update(id=body["id"], submitted_after_s=since())
    before = api.list_ids()
    sent = time.perf_counter()
    status, body = api.create(DEFAULT_PROMPT, args.oversize, 99, args.steps)
    record["oversize"] = {"geometry": label(args.oversize), "status": status, "message": body.get("message"),
                          "seconds": round(time.perf_counter() - sent, 3)}  # fmt: skip
    if status == 200:  # accepted: it would hold the worker for long; take it out again
        api.delete(body["id"])
    record["oversize"]["queued"] = status == 200 or api.list_ids() != before
    pending = list(jobs)
    while pending:
        if time.monotonic() > deadline:
            for job in pending:
                job["outcome"] = "unfinished"
            raise Failure(f"{len(pending)} job(s) unfinished when --timeout-s ran out")
        server.check_alive()
        job = pending[0]
        job.setdefault("started_after_s", since())  # the worker takes the next job as the one before ends
        if "delete" in job:  # DELETE sent: the worker logs where it stopped the job
            match = next((m for m in CANCELLED.finditer(server.log.read()) if m.group(1) == job["id"]), None)
            waited = time.perf_counter() - job["_deleted_at"]
            if match or waited > args.cancel_wait_s:
                phase, where = (match.group(2), match.group(3)) if match else (None, None)
                job["delete"].update(took_effect_s=round(waited, 3) if match else None, phase=phase, where=where)
                job["outcome"] = "deleted" if match else "deleted, no cancel logged"
                pending.pop(0)
                _end_window(job, watch, since)
                continue
        else:
            status, video = api.retrieve(job["id"])
            if status != 200:
                raise Failure(f"{job['name']}: GET answered {status}: {video.get('message')}")
            if video["status"] in ("completed", "failed"):
                job["outcome"] = video["status"]
                job["error"] = video.get("error")
                pending.pop(0)
                _end_window(job, watch, since)
                if job["outcome"] == "completed":
                    job["content_bytes"] = api.download(job["id"], server.log_path.parent / "clip.mp4")
                continue
            if job["plan"] == "delete" and video["progress"] >= args.delete_at:
                job["_deleted_at"] = time.perf_counter()
                status, body = api.delete(job["id"])
                job["delete"] = {"progress": video["progress"], "status": status,
                                 "answered_s": round(time.perf_counter() - job["_deleted_at"], 3)}  # fmt: skip
        time.sleep(args.poll_s)


def _end_window(job: dict, watch: ProcessWatch, since) -> None:
    """The job's share of the server's RSS peak and disk reads: from the end of the one before to its own end."""
    job["done_after_s"] = since()
    job["run_s"] = round(job["done_after_s"] - job["started_after_s"], 3)
    job.pop("_deleted_at", None)
    job["peak_rss_bytes"], job["disk_read_bytes"] = watch.mark()


def add_telemetry(jobs: list[dict], data_dir: Path) -> None:
    """The server's telemetry of each completed job, from its job store (the server has stopped)."""
    from k6fast.server.jobs import JobStore

    store = JobStore(data_dir / "jobs.sqlite3")
    try:
        for job in jobs:
            record = store.get(job["id"]) if job.get("outcome") == "completed" else None
            if record is not None and record.telemetry:
                t = dict(record.telemetry)
                streamed = t.pop("stream_steps", [])
                copy = sum(s.get("copy_s", 0.0) for s in streamed)
                t["hidden_share"] = None if copy <= 0 else 1 - sum(s.get("exposed_s", 0.0) for s in streamed) / copy
                job["telemetry"] = t
    finally:
        store.close()


def problems_of(result: dict, args: argparse.Namespace) -> list[str]:
    out = []
    for job in result.get("jobs", []):
        want = "deleted" if job["plan"] == "delete" else "completed"
        if job.get("outcome") != want:
            out.append(f"{job['name']}: expected {want}, found {job.get('outcome')}")
    over = result.get("oversize")
    if over and (over["status"] != 400 or over["queued"]):
        out.append(f"oversize {over['geometry']}: expected a 400 before queueing, found {over['status']}"
                   + (" and it was queued" if over["queued"] else ""))  # fmt: skip
    return out


def environment() -> dict[str, Any]:
    from k6fast.bench.gpu import gpu_inventory

    versions = {}
    for name in ("torch", "triton", "transformers", "diffusers", "k6fast", "openai", "fastapi", "uvicorn"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"gpus": gpu_inventory(), "versions": versions, "python": sys.version.split()[0], "date": date}


def print_table(record: dict) -> None:
    print("\n".join(serve_lines([record])[4:]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--arm", help="the server's arm (default: none, the reference path)")
    p.add_argument("--budget-gb", type=float, default=32.0, help="K6_VRAM_BUDGET_GB of the server (default 32)")
    p.add_argument("--set", action="append", default=[], metavar="K6_X=V", help="another switch for the server")
    p.add_argument("--large", type=geometry, default=(864, 480, 121), help="the larger jobs (default W1, 864x480x121)")
    p.add_argument("--small", type=geometry, default=(640, 352, 73), help="the smaller jobs (default 640x352x73: 3 s)")
    p.add_argument("--oversize", type=geometry, default=(1280, 720, 241), help="the request that must get a 400")
    p.add_argument("--steps", type=int, help="denoising steps of every job (default: the checkpoint's)")
    p.add_argument("--delete-at", type=int, default=30, help="DELETE the third job at this progress, %% (default 30)")
    p.add_argument("--out", type=Path, help="the JSON record")
    p.add_argument("--record", type=Path, help="an acceptance record folder: the JSON goes to its serve/ folder")
    p.add_argument("--work", type=Path, help="data dir and server log (default: a temporary folder, removed)")
    p.add_argument("--start-timeout-s", type=float, default=900.0, help="start-up to ready (default 900)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="the whole run, start-up included (default 1800)")
    p.add_argument("--poll-s", type=float, default=0.1, help="polling interval (default 0.1)")
    p.add_argument("--cancel-wait-s", type=float, default=120.0, help="DELETE to the server's log of the stop")
    p.add_argument("--http", action="store_true", help="plain HTTP even where the openai SDK is installed")
    p.add_argument("--jobs", choices=tuple(JOB_SETS), default="all",
                   help="all: the four jobs (default); first: only the first, a W1 job of a fresh prompt")  # fmt: skip
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", "The Sora API", DeprecationWarning)  # the Videos API k6fast serves
    if not args.out and not args.record:
        p.error("expected --out FILE or --record DIR")
    args.switches = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep or not name.startswith("K6_"):
            p.error(f"--set expects K6_NAME=VALUE, found {item!r}")
        args.switches[name] = value
    slug = f"{args.arm or 'env'}-{args.budget_gb:g}{'-first' if args.jobs == 'first' else ''}".replace("/", "_")
    out = args.out or args.record / SERVE_DIR / f"{slug}.json"
    args.model = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model
    work = args.work or Path(tempfile.mkdtemp(prefix=f"k6-serve-{slug}-"))
    shutil.rmtree(work / "data", ignore_errors=True)  # a fresh store: no jobs from an earlier run
    work.mkdir(parents=True, exist_ok=True)

    from k6fast.switches import load_options, provenance

    deadline = time.monotonic() + args.timeout_s
    commit_file = Path(__file__).resolve().parents[1] / "LEASE_COMMIT"
    record: dict[str, Any] = {
        "what": "k6fast serve at its defaults: four queued jobs of two sizes, one DELETE, one oversize request"
        if args.jobs == "all" else "k6fast serve at its defaults: one W1 job, one oversize request",
        "jobs_set": args.jobs,
        "command": " ".join([sys.executable, *sys.argv]) if argv is None else " ".join(argv),
        "commit": commit_file.read_text().strip() if commit_file.is_file() else None,
        "environment": environment(),
        "provenance": provenance(load_options({**args.switches, "K6_VRAM_BUDGET_GB": f"{args.budget_gb:g}"},
                                              arm=args.arm)),  # fmt: skip
        "model": args.model, "arm": args.arm, "budget_gb": args.budget_gb, "switches_set": args.switches,
        "sizes": {"large": label(args.large), "small": label(args.small)}, "steps": args.steps,
    }  # fmt: skip
    # A `timeout` or a lease's `stop` sends SIGTERM: stop the server and write what was measured.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped by SIGTERM"))
    server = Server(args, work)
    record["server_command"] = server.command
    watch = ProcessWatch(server.proc.pid)
    problems: list[str] = []
    try:
        ready_s = server.wait_ready(min(deadline, time.monotonic() + args.start_timeout_s))
        startup_rss, startup_read = watch.mark()
        loaded, warmup = server.log.search(LOADED), server.log.search(WARMUP)
        record["startup"] = {"ready_s": round(ready_s, 3), "peak_rss_bytes": startup_rss,
                             "disk_read_bytes": startup_read,
                             "load_and_warmup_s": float(loaded.group(1)) if loaded else None,
                             "warmup_s": float(warmup.group(1)) if warmup else None}  # fmt: skip
        api = Api(server.url, force_http=args.http)
        record["client"] = api.name
        run_jobs(api, server, watch, args, deadline, record)
    except (Exception, KeyboardInterrupt, SystemExit) as exc:  # recorded; the server is stopped either way
        problems.append(str(exc) if isinstance(exc, Failure) else f"{type(exc).__name__}: {exc}")
    finally:
        record["stop"] = server.stop()
        record.update(watch.stop())
        record["server_log_tail"] = server.log.tail(25)
    if "jobs" in record:
        try:
            add_telemetry(record["jobs"], work / "data")
        except Exception as exc:  # the store is evidence, not the measurement: say so and keep the rest
            problems.append(f"the job store could not be read: {exc}")
    record["problems"] = problems + problems_of(record, args)
    record["passed"] = not record["problems"] and "jobs" in record
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    if args.record:
        write_readme(args.record)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    print_table(record)
    print(f"record: {out}")
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
