"""`k6fast acceptance`: the product run whole, as a user runs it. Every shipped arm at full depth and the real
geometry, each run a fresh `k6fast generate` process under a VRAM budget: cold (empty compile caches) and warm
(caches from the cold run), under a host-memory ballast that leaves what a consumer machine has, and the diffusers
peer in the same session.

A run's row (appended to `runs.jsonl` as it ends, so an interrupted session keeps what it measured): pass/fail and
why, process wall time, the request's phases, compile seconds and graphs, peak VRAM (allocator; per phase; and what
nvidia-smi saw, CUDA context included), peak host RSS, bytes the process read from disk, share of the weight copies
hidden, and the final latents' rel. L2 / cosine against the reference arm's (same seed): the whole chain's numerical
cost. `README.md` in the record folder is the table (`acceptance_report.py`), with the records of
`measurements/bench_serve_defaults.py` in its `serve/` folder (the same arms through `k6fast serve`) below it.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ..atomic import write_bytes_atomic
from ..checkpoint import open_checkpoint
from .acceptance_report import (
    PLAN_FILE,
    ROWS_FILE,
    SERVE_DIR,
    is_peer_arm,
    latent_error,
    latents_identical,
    render_table,
    request_summary,
)
from .decode_ceiling import row_decode_ceiling
from .disk_prediction import StepReads, disk_per_step, predict, read_speed
from .projection import project_peer, project_run
from .records import append_jsonl, read_jsonl, write_json
from .roofline import row_ceiling

REFERENCE_ARM = "reference"


@dataclass(frozen=True)
class Run:
    """One fresh process: an arm (or the peer) under a budget, with cold or warm compile caches, optionally a
    ballast that leaves `host_ram_gb` of the host's memory, and the checkpoint it reads: the session's own, or
    (`checkpoint="df11"`) its lossless compressed copy (`k6fast quantize --format df11`), whose latents must equal
    the same run's on the BF16 checkpoint bit for bit."""

    arm: str
    budget_gb: float
    cache: str  # "cold": caches emptied first; "warm": the caches a cold run of this arm left
    host_ram_gb: float | None = None
    checkpoint: str = ""  # "": the workload's model; "df11": its compressed copy (Workload.df11_model)

    @property
    def name(self) -> str:
        ballast = f", {self.host_ram_gb:g} GB host" if self.host_ram_gb else ""
        stored = f", {self.checkpoint} checkpoint" if self.checkpoint else ""
        return f"{self.arm} @ {self.budget_gb:g} GiB, {self.cache}{ballast}{stored}"

    @property
    def peer(self) -> bool:
        return is_peer_arm(self.arm)

    @property
    def slug(self) -> str:
        ballast = f"-host{self.host_ram_gb:g}" if self.host_ram_gb else ""
        stored = f"-{self.checkpoint}" if self.checkpoint else ""
        return f"{self.arm}-{self.budget_gb:g}-{self.cache}{ballast}{stored}".replace("/", "_")

    @property
    def bf16_twin(self) -> Run:
        """The same run on the session's own (BF16) checkpoint."""
        return replace(self, checkpoint="")


def build_plan(
    arms: list[str],
    budgets: list[float],
    *,
    ballast_arms: list[str] = (),
    host_ram_gb: float | None = None,
    peer: str | None = None,
    df11_arms: list[str] = (),
) -> list[Run]:
    """Most important first (a lease can end early): every arm cold at the first budget, then warm there, every arm
    warm at the other budgets, the ballast runs, the peer last (it fills the host's memory and page cache). With
    `df11_arms`: each of them warm at the first budget on the compressed checkpoint, and beside the ballast where it
    has a ballast run, after the BF16 runs (a lease writes the compressed copy from the BF16 one)."""
    if not arms or not budgets:
        raise ValueError("expected at least one arm and one budget")
    first, *others = budgets
    runs = [Run(arm, first, "cold") for arm in arms]
    runs += [Run(arm, first, "warm") for arm in arms]
    runs += [Run(arm, budget, "warm") for budget in others for arm in arms]
    if host_ram_gb:
        runs += [Run(arm, first, "warm", host_ram_gb) for arm in ballast_arms]
    runs += [Run(arm, first, "warm", checkpoint="df11") for arm in df11_arms]
    if host_ram_gb:
        runs += [Run(arm, first, "warm", host_ram_gb, "df11") for arm in df11_arms if arm in ballast_arms]
    if peer:
        runs.append(Run(peer, first, "cold"))
    return runs


class ProcessWatch:
    """Peak RSS of a child process (VmRSS and RssAnon from /proc, sampled), the bytes it has caused to be read from
    storage (read_bytes of /proc/PID/io: page-cache misses, which a host short of memory pays on every run; None where
    the file cannot be read) and the GPU memory nvidia-smi reports in use above what it showed before the child
    started (the CUDA context and everything outside the allocator). `mark()` splits the run into windows (a server's
    jobs). `steps`: where to note read_bytes at the child's denoising step boundaries (its log's progress bar)."""

    def __init__(self, pid: int, interval_s: float = 0.25, smi: str | None = None, steps: StepReads | None = None):
        self.pid, self.interval_s, self.steps = pid, interval_s, steps
        self.smi = smi if smi is not None else shutil.which("nvidia-smi")
        self.peak_rss = self.peak_anon = self.peak_smi_mib = self.window_rss = 0
        self.read_bytes: int | None = None
        self._read_at_mark = 0
        self.baseline_smi_mib = self._smi_used()
        self._lock, self._sampling = threading.Lock(), threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="k6fast-acceptance-watch", daemon=True)
        self._thread.start()

    def _smi_used(self) -> int:
        if not self.smi:
            return 0
        try:
            out = subprocess.run([self.smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10, check=False).stdout  # fmt: skip
            return sum(int(v) for v in out.split() if v.isdigit())
        except (OSError, subprocess.SubprocessError):
            return 0

    def _sample(self) -> None:
        with self._sampling:  # the watcher's thread and mark() both sample; StepReads reads its log in order
            done = None if self.steps is None else self.steps.poll()  # before read_bytes: see StepReads
            read = self._read_proc()
            if self.steps is not None:
                self.steps.record(done, read)

    def _read_proc(self) -> int | None:
        """Sample /proc/PID: the peaks, and the read_bytes it shows now (None where it could not be read)."""
        try:
            status = Path(f"/proc/{self.pid}/status").read_text()
        except OSError:
            return None
        try:
            io = Path(f"/proc/{self.pid}/io").read_text()
        except OSError:
            io = ""
        read = None
        with self._lock:
            for line in status.splitlines():
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                    self.peak_rss, self.window_rss = max(self.peak_rss, rss), max(self.window_rss, rss)
                elif line.startswith("RssAnon:"):
                    self.peak_anon = max(self.peak_anon, int(line.split()[1]) * 1024)
            for line in io.splitlines():
                if line.startswith("read_bytes:"):
                    read = int(line.split()[1])
                    self.read_bytes = max(self.read_bytes or 0, read)
        return read

    def mark(self) -> tuple[int, int | None]:
        """(peak RSS, bytes read) since the last mark, or since the start; the next window starts now."""
        self._sample()
        with self._lock:
            peak, self.window_rss = self.window_rss, 0
            read = None if self.read_bytes is None else self.read_bytes - self._read_at_mark
            self._read_at_mark = self.read_bytes or 0
            return peak, read

    def _run(self) -> None:
        tick = 0
        while not self._stop.wait(self.interval_s):
            self._sample()
            tick += 1
            if tick % 4 == 0:  # nvidia-smi is a process start per call: once a second is enough
                self.peak_smi_mib = max(self.peak_smi_mib, self._smi_used() - self.baseline_smi_mib)

    def stop(self) -> dict[str, int | None]:
        self._stop.set()
        self._thread.join()
        return {"peak_rss_bytes": self.peak_rss, "peak_rss_anon_bytes": self.peak_anon,
                "peak_smi_used_mib": self.peak_smi_mib, "disk_read_bytes": self.read_bytes}  # fmt: skip


class Ballast:
    """A process holding host memory locked so that only `leave_gb` (10^9 bytes) stays for everything else (page
    cache included): a consumer machine's share of RAM on a bigger host (`k6fast/bench/ballast.py`)."""

    def __init__(self, leave_gb: float, python: str = sys.executable):
        self.proc = subprocess.Popen([python, "-m", "k6fast.bench.ballast", "--leave-gb", str(leave_gb)],
                                     stdout=subprocess.PIPE, text=True)  # fmt: skip
        line = self.proc.stdout.readline().strip()  # "held N bytes of M" once every page is in place
        if not line.startswith("held"):
            self.proc.kill()
            raise RuntimeError(f"the host-memory ballast did not start: {line or 'no output'}")
        self.description = line

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def child_env(run: Run, work: Path, base: dict[str, str]) -> dict[str, str]:
    """The run's environment: no K6_* from the caller (the arm file decides), the budget, and the arm's own compile
    caches through K6_INDUCTOR_CACHE_DIR (Inductor's, Triton's, flash-attn-4's: what a second start reuses)."""
    env = {k: v for k, v in base.items() if not k.startswith("K6_")}
    cache = work / "cache" / run.arm
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"):
        env.pop(name, None)  # the caller's caches would make a cold run warm
    env.update(K6_VRAM_BUDGET_GB=f"{run.budget_gb:g}", K6_INDUCTOR_CACHE_DIR=str(cache), PYTHONUNBUFFERED="1")
    return env


@dataclass(frozen=True)
class Workload:
    """What every run of a session asks for: the same request."""

    model: str
    geometry: str  # WIDTHxHEIGHTxFRAMES
    prompt: str
    seed: int
    steps: int
    guidance: float
    # The peer's checkpoint where it cannot read `model`: the peer holds the whole DiT and its text encoders in host
    # memory, so beside real-size text encoders on a 128 GB host it reads a copy whose text encoders are one layer
    # (the record's plan says so). Not part of the request: a session's parts may differ in it.
    peer_model: str = ""
    # The lossless compressed copy of `model` (`k6fast quantize --format df11`) the df11 runs read; not part of the
    # request either.
    df11_model: str = ""
    # Every run denoises only the schedule's first steps (`generate --stop-after-steps`): a long schedule's per-step
    # cost (the 50-step base checkpoints), side by side with the peer's; None = the whole schedule.
    stop_after_steps: int | None = None
    # The peer's own stop where it differs (None: `stop_after_steps`). It streams every block from host memory each
    # pass, so its steps cost the same and fewer of them show it; a lease's device time is the limit.
    peer_stop_after_steps: int | None = None

    @property
    def peer_stop(self) -> int | None:
        return self.peer_stop_after_steps or self.stop_after_steps

    def model_for(self, run: Run) -> str:
        return self.df11_model if run.checkpoint == "df11" else self.model


REQUEST_FIELDS = ("model", "geometry", "prompt", "seed", "steps", "guidance", "stop_after_steps")


def generate_command(run: Run, w: Workload, run_dir: Path, python: str) -> list[str]:
    """`k6fast generate` for the run, without the prompt cache: a warm run is one with the compile caches a cold run
    left, and it encodes the prompt as every other row and the peer do (with the cache, the cold run's encoding
    made the warm row's text phase 0 s: the second 2026-12-02 envelope record's `final` warm row)."""
    width, height, frames = w.geometry.split("x")
    return [python, "-m", "k6fast.cli", "generate", "--model", w.model_for(run), "--arm", run.arm, "--prompt", w.prompt,
            "--seed", str(w.seed), "--steps", str(w.steps), "--guidance", f"{w.guidance:g}",
            "--size", f"{width}x{height}", "--frames", frames,
            "--out", str(run_dir / "clip.mp4"), "--save-latents", str(run_dir / "latents.safetensors"),
            "--prompt-cache", "none",
            *(["--stop-after-steps", str(w.stop_after_steps)] if w.stop_after_steps else [])]  # fmt: skip


def peer_command(run: Run, w: Workload, run_dir: Path, python: str) -> list[str]:
    """The peer through `k6fast bench`'s visit process: one request, no warm-up (a user's first request), under
    the same allocator cap, MP4 written by the same writer."""
    from .runner import VisitSpec

    width, height, frames = (int(v) for v in w.geometry.split("x"))
    spec = VisitSpec(session="acceptance", visit=0, position=0, repeat=0, arm=run.arm, model=w.peer_model or w.model,
                     component="pipeline", width=width, height=height, frames=frames, steps=w.steps,
                     guidance=w.guidance, seed=w.seed, prompt=w.prompt, requests=1, warmup=0,
                     switches={"K6_VRAM_BUDGET_GB": f"{run.budget_gb:g}"},
                     stop_after_steps=w.peer_stop)  # fmt: skip
    (run_dir / "spec.json").write_text(json.dumps(spec.as_dict()))
    return [python, "-m", "k6fast.bench.visit", "--spec", str(run_dir / "spec.json"),
            "--out", str(run_dir / "peer.json")]  # fmt: skip


def execute(run: Run, w: Workload, *, work: Path, timeout_s: float, python: str = sys.executable,
            reference_latents: Path | None = None, read_gb_s: float | None = None) -> dict[str, Any]:  # fmt: skip
    """Run one fresh process and return its row. Beside a ballast, a k6fast arm's row also carries doctor's
    prediction of its disk reads per step, made once the ballast holds its memory, at `read_gb_s` (`disk_prediction`),
    and the measured counterpart."""
    run_dir = work / "runs" / run.slug
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    if run.cache == "cold":
        shutil.rmtree(work / "cache" / run.arm, ignore_errors=True)
    make = peer_command if run.peer else generate_command
    cmd = make(run, w, run_dir, python)
    ballast = Ballast(run.host_ram_gb, python) if run.host_ram_gb else None
    row: dict[str, Any] = {"run": run.name, "slug": run.slug, **asdict(run), "command": cmd,
                           "ballast": ballast.description if ballast else None}  # fmt: skip
    predicted = ballast is not None and not run.peer
    steps = StepReads(run_dir / "stderr.log") if predicted else None
    try:
        if predicted:
            row["disk_prediction"] = _prediction(run, w, read_gb_s)
        start = time.perf_counter()
        with open(run_dir / "stderr.log", "w") as log:
            proc = subprocess.Popen(cmd, env=child_env(run, work, dict(os.environ)), stdout=log, stderr=log)
            watch = ProcessWatch(proc.pid, steps=steps)
            try:
                row["returncode"] = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                row["returncode"] = None
            row.update(watch.stop())
    finally:
        if ballast is not None:
            ballast.close()
    row["process_s"] = round(time.perf_counter() - start, 3)
    row.update(request_summary(run_dir, peer=run.peer))
    if not run.peer and (run_dir / "clip.mp4.json").is_file():
        row.update(_sidecar_figures(run_dir / "clip.mp4.json", w.model_for(run), stopped=bool(w.stop_after_steps)))
    elif run.peer and w.peer_stop:
        row["projected"] = project_peer(row, w.steps, w.peer_stop)
    if steps is not None:
        row["disk_per_step"] = disk_per_step(row["disk_prediction"], steps, run_dir / "clip.mp4.json", run.arm)
    tail = (run_dir / "stderr.log").read_text(errors="replace").splitlines()[-15:]
    if row["returncode"] != 0:
        why = f"timed out after {timeout_s:.0f} s" if row["returncode"] is None else f"exit {row['returncode']}"
        row.update(passed=False, error=f"{why}: " + " | ".join(line.strip() for line in tail[-3:]))
    else:
        row["passed"] = row.get("error") is None
    row["stderr_tail"] = tail
    latents = run_dir / "latents.safetensors"
    if row["passed"] and not run.peer and reference_latents is not None and latents.is_file():
        row["vs_reference"] = latent_error(latents, reference_latents)
    clip = run_dir / "clip.mp4"
    if clip.is_file():  # checked, then dropped: a W1 clip of random-weight noise is large, the disk is the limit
        row["clip_bytes"] = clip.stat().st_size
        clip.unlink()
    return row


def _sidecar_figures(sidecar: Path, model: str, stopped: bool) -> dict[str, Any]:
    """The run's DiT step and video decode against their ceilings (`roofline`, `decode_ceiling`), and where the run
    was `stopped` its whole request projected (`projection`): None where there are none for it; a failure is
    recorded in the figure's place, never as the run's verdict."""
    keys = ("step_ceiling", "decode_ceiling", *(("projected",) if stopped else ()))
    try:
        record, ckpt = json.loads(sidecar.read_text()), open_checkpoint(model)
    except Exception as exc:
        return dict.fromkeys(keys, _failed(exc))
    figures = {"step_ceiling": _guarded(row_ceiling, record, ckpt.dit),
               "decode_ceiling": _guarded(row_decode_ceiling, record, ckpt.root)}  # fmt: skip
    if stopped:
        figures["projected"] = _guarded(project_run, record, ckpt)
    return figures


def _guarded(compute, *args: Any) -> dict[str, Any] | None:
    try:
        return compute(*args)
    except Exception as exc:
        return _failed(exc)


def _failed(exc: Exception) -> dict[str, str]:
    return {"error": f"{type(exc).__name__}: {exc}"}


def _prediction(run: Run, w: Workload, read_gb_s: float | None) -> dict[str, Any]:
    """`disk_prediction.predict` for the run; a prediction that fails is recorded as such rather than costing the
    run its measurement (a lease cannot run it again)."""
    geometry = tuple(int(v) for v in w.geometry.split("x"))
    try:
        return predict(w.model_for(run), run.arm, run.budget_gb, geometry, read_gb_s)
    except Exception as exc:  # whatever doctor raises, the run goes on
        return {"error": f"{type(exc).__name__}: {exc}", "step_bytes": None, "step_min_s": None}


def run_acceptance(
    runs: list[Run], w: Workload, *, out: Path, work: Path, timeout_s: float = 1200.0,
    header: dict[str, Any] | None = None, log=lambda line: print(line, file=sys.stderr, flush=True),
) -> Path:  # fmt: skip
    """Run the plan; rows go to `out/runs.jsonl` as they end, the table to `out/README.md` after each run. A record
    folder that already holds rows of the same workload is continued (a session run in several parts): its first
    passing reference run stays the one every arm is held against, the rows run before it included."""
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    now = lambda: dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")  # noqa: E731
    rows = read_jsonl(out / ROWS_FILE) if (out / ROWS_FILE).is_file() else []
    plan = {**asdict(w), "timeout_s": timeout_s, "runs": [], "started": now(), "argv": sys.argv, **(header or {})}
    if rows and (out / PLAN_FILE).is_file():
        earlier = json.loads((out / PLAN_FILE).read_text())
        if {k: earlier.get(k) for k in REQUEST_FIELDS} != {k: getattr(w, k) for k in REQUEST_FIELDS}:
            raise ValueError(f"{out} holds a session of another workload; expected an empty folder or the same one")
        plan = {**earlier, "runs": earlier.get("runs", []), "parts": earlier.get("parts", 1) + 1}
        if w.df11_model:  # the part that runs on the compressed copy says which
            plan["df11_model"] = w.df11_model
        if w.peer_model:  # the part that runs the peer says what it read
            plan.update(
                {"peer_model": w.peer_model, "peer_stop_after_steps": w.peer_stop_after_steps,
                 **{k: v for k, v in (header or {}).items() if k.startswith("peer_")}}
            )  # fmt: skip
    plan["runs"] += [asdict(r) for r in runs]
    plan.pop("finished", None)
    write_json(out / PLAN_FILE, plan)
    reference = next((work / "runs" / row["slug"] / "latents.safetensors" for row in rows
                      if row.get("arm") == REFERENCE_ARM and row.get("passed")), None)  # fmt: skip
    for i, run in enumerate(runs, 1):
        if run.host_ram_gb and not run.peer and "disk_read_test" not in plan:
            # Once per session, before its first ballast run (the test drops cached pages the runs before it read).
            plan["disk_read_test"] = read_speed(w.model_for(run))  # the BF16 DiT may be gone before a df11 part
            write_json(out / PLAN_FILE, plan)
            log(f"acceptance: checkpoint read speed {plan['disk_read_test']['read_gb_s']:.2f} GB/s (doctor's test)")
        log(f"acceptance: run {i}/{len(runs)}: {run.name}")
        read_gb_s = plan.get("disk_read_test", {}).get("read_gb_s")
        row = execute(run, w, work=work, timeout_s=timeout_s, reference_latents=reference, read_gb_s=read_gb_s)
        latents = work / "runs" / run.slug / "latents.safetensors"
        if run.checkpoint == "df11":  # first: a compressed run that fails it is no reference either
            hold_to_bf16_twin(row, latents, work / "runs" / run.bf16_twin.slug / "latents.safetensors")
        first_reference = run.arm == REFERENCE_ARM and reference is None and row["passed"] and latents.is_file()
        if first_reference:
            reference = latents  # the first reference run that passed is what every arm is held against
            row["vs_reference"] = latent_error(latents, latents)
        append_jsonl(out / ROWS_FILE, row)
        if first_reference:
            hold_earlier_rows(out / ROWS_FILE, work, reference)
        verdict = "PASS" if row["passed"] else f"FAIL ({row.get('error', '')[:200]})"
        log(f"acceptance:   {verdict} in {row['process_s']:.1f} s")
        write_readme(out, plan)
    plan["finished"] = now()
    write_json(out / PLAN_FILE, plan)
    write_readme(out, plan)
    return out


def hold_to_bf16_twin(row: dict[str, Any], latents: Path, twin: Path) -> None:
    """A run on the compressed checkpoint fails unless its latents equal the same run's on the BF16 checkpoint, bit
    for bit (DF11 is lossless); also where that run's latents are not on disk: it cannot show what it is for."""
    if not (row["passed"] and latents.is_file()):
        return
    if not twin.is_file():
        row["passed"] = False
        row["error"] = f"no latents of the same run on the BF16 checkpoint to compare with ({twin}): run it first"
        return
    row["vs_bf16"] = latents_identical(latents, twin)
    differ = [key for key, same in row["vs_bf16"].items() if not same]
    if differ:
        row["passed"] = False
        row["error"] = f"{', '.join(differ)} latents differ from the same run's on the BF16 checkpoint ({twin})"


def write_readme(out: Path, plan: dict[str, Any] | None = None) -> bool:
    """Render `out/README.md` from the record's runs, its plan (read from `out` when not given) and the serve records
    in `out/serve/`; False (nothing written) when `out` holds no plan yet."""
    if plan is None:
        if not (out / PLAN_FILE).is_file():
            return False
        plan = json.loads((out / PLAN_FILE).read_text())
    rows = read_jsonl(out / ROWS_FILE) if (out / ROWS_FILE).is_file() else []
    serve = [json.loads(path.read_text()) for path in sorted((out / SERVE_DIR).glob("*.json"))]
    write_bytes_atomic(out / "README.md", render_table(rows, plan, serve).encode("utf-8"))
    return True


def hold_earlier_rows(rows_file: Path, work: Path, reference: Path) -> None:
    """Compare the rows that ran before the session's first passing reference (a lease orders runs by what the
    machine's state allows, not by what they are compared with) against it, where their latents are still on disk."""
    rows = read_jsonl(rows_file)
    changed = False
    for row in rows:
        latents = work / "runs" / row["slug"] / "latents.safetensors"
        if row.get("passed") and not is_peer_arm(row["arm"]) and "vs_reference" not in row and latents.is_file():
            row["vs_reference"] = latent_error(latents, reference)
            changed = True
    if changed:
        text = "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows)
        write_bytes_atomic(rows_file, text.encode("utf-8"))
