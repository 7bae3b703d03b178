"""One telemetry object per request: wall time per phase, per-step times, peak GPU memory and peak host RSS; and the
start-up profile of a `k6fast generate` process (`StartupClock`), from the process's start to its exit.

`generate`, `serve` and `bench` print or record it the same way (`summary()` for people, `as_dict()` for records).
Importing this module does not import PyTorch (the command line times its own imports with it).
"""

from __future__ import annotations

import os
import resource
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from .memory import GiB


def peak_host_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def anon_rss_bytes() -> int:
    """Current anonymous resident memory (RssAnon): what this process holds that the kernel cannot drop, unlike
    page cache behind a read-only mapping or pread."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def compile_counters() -> tuple[float, int]:
    """(seconds, graphs) torch.compile has spent and made in this process so far; (0, 0) before any compile.
    Dynamo's own bookkeeping: `_compile.compile_inner` wraps each frame's compile, Inductor's included."""
    utils = sys.modules.get("torch._dynamo.utils")  # not imported = nothing compiled yet; never import it here
    if utils is None:
        return 0.0, 0
    seconds = sum(utils.compilation_time_metrics.get("_compile.compile_inner", ()))
    return seconds, int(utils.counters["stats"].get("unique_graphs", 0))


@dataclass
class Telemetry:
    device: str = "cpu"
    phases: dict[str, float] = field(default_factory=dict)  # seconds
    step_seconds: list[float] = field(default_factory=list)
    step_called: list[bool] = field(default_factory=list)  # per step: the DiT ran (False: a cached prediction)
    dit_calls: int = 0
    cached_steps: int = 0
    step_cache: dict = field(default_factory=dict)  # K6_STEP_CACHE: its calibration (file, digest), steps skipped
    peak_vram_bytes: int = 0  # the largest allocated peak of any phase
    peak_vram_reserved_bytes: int = 0  # ... and reserved (what the budget caps)
    phase_peaks: dict[str, dict[str, int]] = field(default_factory=dict)  # phase → {"allocated", "reserved"}
    stream_steps: list[dict] = field(default_factory=list)  # per denoising step: streamed blocks' copy/compute
    video_decode: str = ""  # how the video was decoded (the decode plan)
    compile_s: float = 0.0  # torch.compile time spent inside this request's phases (Dynamo + Inductor)
    compiled_graphs: int = 0  # graphs compiled inside them (a recompile is one more)
    # The MP4 mux (output.py). Streamed, it encodes on its own thread while the video decode goes on, and its
    # "mux" phase is only the wait after the decode; sequential, it starts after the decode and is all exposed.
    text_source: str = ""  # where the prompt's embeddings came from: "encoded", or a cache hit ("memory", "disk")
    text_bytes_streamed: int = 0  # text-encoder weight bytes copied to the device for this request
    # The prompt was encoded on its own thread during the load (`Pipeline(first_request=...)`): that encode's seconds;
    # the "text_encode" phase is then only the wait for it, and the encode's device-memory peak falls in the load, not
    # in this request's peaks.
    text_ahead_s: float | None = None
    dit_blocks_uploaded: int = 0  # resident DiT blocks uploaded during the request (a geometry change brought them)
    mux_streamed: bool = False
    mux_encode_s: float | None = None  # seconds the encoder worked (frame conversion, encode, finishing the file)
    mux_exposed_s: float | None = None  # seconds from the last decoded frame to the finished MP4
    # A measurement that ran only the schedule's first steps (`generate --stop-after-steps`): how many, of how many.
    stopped_after_steps: tuple[int, int] | None = None
    # Restart CUDA's peak counters per phase. Off where work runs outside any phase (a peer's denoising loop, timed
    # between phases): there the caller reads the whole request's peak itself.
    per_phase_peaks: bool = True

    def add_stream_step(self, timings: list) -> None:
        """Aggregate one step's `BlockTiming`s: copy, compute and exposed seconds, hidden share of the copies."""
        if not timings:
            return
        copy = sum(t.copy_s for t in timings)
        exposed = sum(t.exposed_s for t in timings)
        self.stream_steps.append(
            {
                "blocks": len(timings),
                "copy_s": round(copy, 6),
                "compute_s": round(sum(t.compute_s for t in timings), 6),
                "exposed_s": round(exposed, 6),
                "hidden_share": round(1 - exposed / copy, 4) if copy > 0 else None,
                "per_block": [
                    {"block": t.block, "copy_s": t.copy_s, "compute_s": t.compute_s, "exposed_s": t.exposed_s}
                    for t in timings
                ],
            }
        )

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a phase; on CUDA also its own peak memory (the peak counters restart with each phase, so the
        residency planner's estimate can be held against the denoise phase alone)."""
        cuda = self.device.startswith("cuda")
        if cuda:
            import torch

            cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
            if self.per_phase_peaks:
                torch.cuda.reset_peak_memory_stats()
        compile_before = compile_counters()
        start = time.perf_counter()
        try:
            yield
        finally:
            if cuda:
                torch.cuda.synchronize()
                allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
                if self.per_phase_peaks:
                    seen = self.phase_peaks.setdefault(name, {"allocated": 0, "reserved": 0})
                    seen["allocated"] = max(seen["allocated"], allocated)
                    seen["reserved"] = max(seen["reserved"], reserved)
                self.peak_vram_bytes = max(self.peak_vram_bytes, allocated)
                self.peak_vram_reserved_bytes = max(self.peak_vram_reserved_bytes, reserved)
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - start
            seconds, graphs = compile_counters()
            self.compile_s += seconds - compile_before[0]
            self.compiled_graphs += graphs - compile_before[1]

    def as_dict(self) -> dict:
        return {
            "device": self.device,
            "phases_s": {k: round(v, 6) for k, v in self.phases.items()},
            "step_s": [round(s, 6) for s in self.step_seconds],
            "step_called": self.step_called,
            "dit_calls": self.dit_calls,
            "cached_steps": self.cached_steps,
            "step_cache": self.step_cache,
            "peak_vram_bytes": self.peak_vram_bytes,
            "peak_vram_reserved_bytes": self.peak_vram_reserved_bytes,
            "phase_peaks": self.phase_peaks,
            "stream_steps": self.stream_steps,
            "video_decode": self.video_decode,
            "compile_s": round(self.compile_s, 3),
            "compiled_graphs": self.compiled_graphs,
            "text_source": self.text_source,
            "text_bytes_streamed": self.text_bytes_streamed,
            **({"text_ahead_s": round(self.text_ahead_s, 6)} if self.text_ahead_s is not None else {}),
            "dit_blocks_uploaded": self.dit_blocks_uploaded,
            "mux_streamed": self.mux_streamed,
            "mux_encode_s": None if self.mux_encode_s is None else round(self.mux_encode_s, 6),
            "mux_exposed_s": None if self.mux_exposed_s is None else round(self.mux_exposed_s, 6),
            "peak_host_rss_bytes": peak_host_rss_bytes(),
            **({"stopped_after_steps": list(self.stopped_after_steps)} if self.stopped_after_steps else {}),
        }

    def summary(self) -> str:
        steps = len(self.step_seconds)
        lines = [f"{'phase':<14}{'seconds':>10}"]
        lines += [f"{name:<14}{seconds:>10.2f}" for name, seconds in self.phases.items()]
        lines.append(f"{'total':<14}{sum(self.phases.values()):>10.2f}")
        lines.append(
            f"denoising: {steps} steps, {steps - self.cached_steps} DiT steps ({self.dit_calls} DiT calls), "
            f"{self.cached_steps} cached"
        )
        if self.stream_steps:
            copy = sum(s["copy_s"] for s in self.stream_steps)
            exposed = sum(s["exposed_s"] for s in self.stream_steps)
            share = f"{100 * (1 - exposed / copy):.1f}%" if copy > 0 else "n/a"
            lines.append(f"streaming: copies {copy:.2f} s, exposed {exposed:.3f} s, hidden {share}")
        if self.video_decode:
            lines.append(f"video decode: {self.video_decode}")
        if self.mux_exposed_s is not None:
            how = "streamed beside the video decode" if self.mux_streamed else "after the video decode"
            lines.append(
                f"mux: {how}, encoding {self.mux_encode_s:.2f} s, {self.mux_exposed_s:.2f} s of it after the last frame"
            )
        if self.compiled_graphs:
            lines.append(f"torch.compile: {self.compiled_graphs} graphs in {self.compile_s:.1f} s")
        if self.peak_vram_bytes:
            lines.append(
                f"peak GPU memory: {self.peak_vram_bytes / GiB:.2f} GiB allocated, "
                f"{self.peak_vram_reserved_bytes / GiB:.2f} GiB reserved"
            )
        lines.append(f"peak host RSS: {peak_host_rss_bytes() / GiB:.2f} GiB")
        return "\n".join(lines)


def process_age_s() -> float | None:
    """Seconds since this process started, by the kernel's account: its start time in /proc/self/stat against
    /proc/uptime, both on the boot clock, in 10 ms ticks. None where /proc does not say (not Linux)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22, starttime
    except (OSError, ValueError, IndexError):
        return None


def processor_s() -> float:
    """Processor seconds this process has spent (user and system, every thread) since it started."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def bytecode_compiled(since: float) -> dict:
    """Of the modules this process imported from Python source, how many it compiled itself instead of reading their
    bytecode (.pyc): none existed and none could be written (an install without bytecode, such as `pip install
    --no-compile` or uv's default, with PYTHONDONTWRITEBYTECODE set or a read-only folder), or this process wrote it
    (modified since `since`, the process's start on the wall clock). Compiling is most of what such an import costs:
    measurements/sessions/2026-12-02_imports-cpu found the generate path's imports twice as long without bytecode.
    {"source_modules", "compiled", "compiled_by_package" (the eight largest counts), "writes_bytecode"}."""
    source = compiled = 0
    by_package: Counter[str] = Counter()
    seen = set()  # a module under two names (`__main__` and multiprocessing's `__mp_main__`) counts once
    for name, module in list(sys.modules.items()):
        spec = getattr(module, "__spec__", None)
        cached, origin = getattr(spec, "cached", None), getattr(spec, "origin", None)
        if not cached or not isinstance(origin, str) or not origin.endswith(".py") or origin in seen:
            continue  # built in, frozen, an extension module, bytecode without its source, or counted
        seen.add(origin)
        source += 1
        try:
            fresh = os.stat(cached).st_mtime >= since
        except OSError:  # no .pyc after the import: compiled in memory, not written
            fresh = True
        if fresh:
            compiled += 1
            by_package[name.partition(".")[0]] += 1
    return {"source_modules": source, "compiled": compiled, "compiled_by_package": dict(by_package.most_common(8)),
            "writes_bytecode": not sys.dont_write_bytecode}  # fmt: skip


# The parts of a `k6fast generate` process after its start-up: its request (the MP4 and sidecar written), the latents
# it was asked to save, and its teardown (from there to the process's end).
AFTER_STARTUP = ("request", "latents", "teardown")


class StartupClock:
    """The start-up profile of one process, in parts: `lap(part)` adds the seconds since the previous lap (the first:
    since the process started) to `part`, and the processor seconds spent in them to its `cpu_s`, so the parts cover
    the process's life up to the last lap, each second counted once, except those of a split span's parts that ran
    beside earlier laps on another thread (`lap_split`'s `overlapped`, reported as `load_overlapped_s`). `facts` holds
    what a caller found on the way (whether CUDA was running, how much bytecode was compiled); `as_dict()` is what the
    sidecar records."""

    def __init__(self, from_process_start: bool = True) -> None:
        """from_process_start: the first part starts when the process did (where /proc says when); else now."""
        age = process_age_s() if from_process_start else None
        self.origin = "process start" if age is not None else "clock"  # where the first part starts
        self._last = time.perf_counter() - (age or 0.0)
        self._last_cpu = 0.0 if age is not None else processor_s()
        self.started = time.time() - (age or 0.0)  # the first part's start on the wall clock (file times compare)
        self.parts: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.facts: dict = {}
        self.overlapped = 0.0  # seconds counted in two parts: a split span's part and an earlier lap it ran beside
        self.ended = False  # set when the process ends at the last lap (`k6fast.entry.end_process`)

    def lap(self, part: str) -> None:
        self._lap(part, whole=True)

    def _lap(self, part: str, whole: bool) -> None:
        now, cpu = time.perf_counter(), processor_s()
        self.parts[part] = self.parts.get(part, 0.0) + now - self._last
        if whole:
            self.cpu[part] = self.cpu.get(part, 0.0) + cpu - self._last_cpu
        self._last, self._last_cpu = now, cpu

    def lap_split(self, parts: dict[str, float], rest: str, overlapped: float = 0.0) -> None:
        """Lap a span whose own parts were timed inside it (a pipeline's load): those parts, and the span's remainder
        as `rest`. No processor time is kept for them: the parts' own is not known. overlapped: of the parts' seconds,
        those that ran before the span, on another thread beside earlier laps (the DiT's build beside the imports):
        each part keeps its whole duration and `rest` only what the span holds besides, so the parts' sum exceeds the
        process's age by `overlapped`."""
        span = time.perf_counter() - self._last
        self._lap(rest, whole=False)
        for name, seconds in parts.items():
            self.parts[name] = self.parts.get(name, 0.0) + seconds
        self.parts[rest] -= min(span, sum(parts.values()) - overlapped)
        self.overlapped += overlapped

    def as_dict(self) -> dict:
        """{"startup_s": {part: seconds} in the order lapped, "cpu_s": {part: processor seconds} for each part lapped
        whole (the request's and the teardown's included; every thread's, so a part may hold more than its seconds),
        "load_overlapped_s" (seconds the parts count twice: `lap_split`), "origin" (when the first part starts), the
        `facts`, "request_s" and "latents_s" (when lapped), "teardown_s" and "ended_at_s" (the process's age at its
        end: the parts' sum less `load_overlapped_s`; both None unless the process ended at the last lap)}."""
        startup = {name: round(s, 4) for name, s in self.parts.items() if name not in AFTER_STARTUP}
        cpu = {name: round(s, 4) for name, s in self.cpu.items()}
        overlapped = round(self.overlapped, 4)
        out = {"startup_s": startup, "cpu_s": cpu, "load_overlapped_s": overlapped, "origin": self.origin, **self.facts}
        out |= {f"{name}_s": round(self.parts[name], 4) for name in AFTER_STARTUP[:2] if name in self.parts}
        ended = self.ended and "teardown" in self.parts
        out["teardown_s"] = round(self.parts["teardown"], 4) if ended else None
        out["ended_at_s"] = round(sum(self.parts.values()) - self.overlapped, 4) if ended else None
        return out
