"""One telemetry object per request: wall time per phase, per-step times, peak GPU memory and peak host RSS.

`generate`, `serve` and `bench` print or record it the same way (`summary()` for people, `as_dict()` for records).
"""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


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
    import sys

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
    dit_calls: int = 0
    cached_steps: int = 0
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
    dit_blocks_uploaded: int = 0  # resident DiT blocks uploaded during the request (a geometry change brought them)
    mux_streamed: bool = False
    mux_encode_s: float | None = None  # seconds the encoder worked (frame conversion, encode, finishing the file)
    mux_exposed_s: float | None = None  # seconds from the last decoded frame to the finished MP4
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
        cuda = self.device.startswith("cuda") and torch.cuda.is_available()
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
            "dit_calls": self.dit_calls,
            "cached_steps": self.cached_steps,
            "peak_vram_bytes": self.peak_vram_bytes,
            "peak_vram_reserved_bytes": self.peak_vram_reserved_bytes,
            "phase_peaks": self.phase_peaks,
            "stream_steps": self.stream_steps,
            "video_decode": self.video_decode,
            "compile_s": round(self.compile_s, 3),
            "compiled_graphs": self.compiled_graphs,
            "text_source": self.text_source,
            "text_bytes_streamed": self.text_bytes_streamed,
            "dit_blocks_uploaded": self.dit_blocks_uploaded,
            "mux_streamed": self.mux_streamed,
            "mux_encode_s": None if self.mux_encode_s is None else round(self.mux_encode_s, 6),
            "mux_exposed_s": None if self.mux_exposed_s is None else round(self.mux_exposed_s, 6),
            "peak_host_rss_bytes": peak_host_rss_bytes(),
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
                f"peak GPU memory: {self.peak_vram_bytes / 2**30:.2f} GiB allocated, "
                f"{self.peak_vram_reserved_bytes / 2**30:.2f} GiB reserved"
            )
        lines.append(f"peak host RSS: {peak_host_rss_bytes() / 2**30:.2f} GiB")
        return "\n".join(lines)
