"""Server metrics in the Prometheus text format (0.0.4), without a client library: a few counters and histograms.

Job counts by status come from the job store at scrape time (they survive restarts); the rest (step and job times,
peak GPU memory, outcomes) counts since this process started.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Steps take milliseconds on the tiny CPU model and seconds at W1 on one GPU; jobs take seconds to many minutes.
STEP_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
JOB_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 3600.0)
OUTCOMES = ("completed", "failed", "cancelled", "requeued")


def _num(value: float) -> str:
    if math.isinf(value):
        return "+Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class Histogram:
    def __init__(self, buckets: Iterable[float]):
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * len(self.bounds)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, help_text: str) -> list[str]:
        out = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        out += [f'{name}_bucket{{le="{_num(b)}"}} {c}' for b, c in zip(self.bounds, self.counts, strict=True)]
        out += [
            f'{name}_bucket{{le="+Inf"}} {self.count}',
            f"{name}_sum {_num(self.total)}",
            f"{name}_count {self.count}",
        ]
        return out


class Metrics:
    """Thread-safe: the worker observes, the API thread renders."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.steps = Histogram(STEP_BUCKETS)
        self.jobs = Histogram(JOB_BUCKETS)
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.peak_vram_bytes = 0
        self.last_peak_vram_bytes = 0

    def observe_step(self, seconds: float) -> None:
        with self._lock:
            self.steps.observe(seconds)

    def observe_job(self, outcome: str, seconds: float | None = None, peak_vram_bytes: int = 0) -> None:
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {', '.join(OUTCOMES)}, found {outcome!r}")
        with self._lock:
            self.outcomes[outcome] += 1
            if outcome == "completed" and seconds is not None:
                self.jobs.observe(seconds)
                self.last_peak_vram_bytes = peak_vram_bytes
                self.peak_vram_bytes = max(self.peak_vram_bytes, peak_vram_bytes)

    def mean_job_seconds(self) -> float | None:
        with self._lock:
            return self.jobs.total / self.jobs.count if self.jobs.count else None

    def render(self, counts: Mapping[str, int], ready: bool, busy: bool) -> str:
        def gauge(name: str, help_text: str, value: float) -> list[str]:
            return [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {_num(value)}"]

        with self._lock:
            lines = gauge("k6fast_ready", "1 once the model is loaded and warmed up.", int(ready))
            lines += gauge("k6fast_worker_busy", "1 while the GPU worker runs a job.", int(busy))
            lines += gauge("k6fast_queue_depth", "Jobs waiting for the GPU worker.", counts.get("queued", 0))
            lines += ["# HELP k6fast_jobs Jobs in the store by status.", "# TYPE k6fast_jobs gauge"]
            lines += [f'k6fast_jobs{{status="{s}"}} {n}' for s, n in counts.items()]
            lines += [
                "# HELP k6fast_jobs_finished_total Jobs the worker finished since start, by outcome.",
                "# TYPE k6fast_jobs_finished_total counter",
            ]
            lines += [f'k6fast_jobs_finished_total{{outcome="{o}"}} {n}' for o, n in self.outcomes.items()]
            lines += self.steps.lines("k6fast_step_seconds", "Wall time of one denoising step.")
            lines += self.jobs.lines("k6fast_job_seconds", "Wall time of a completed job, start to written MP4.")
            lines += gauge(
                "k6fast_peak_vram_bytes", "Highest peak GPU memory of any job since start.", self.peak_vram_bytes
            )
            lines += gauge(
                "k6fast_last_job_peak_vram_bytes",
                "Peak GPU memory of the last completed job.",
                self.last_peak_vram_bytes,
            )
        return "\n".join(lines) + "\n"
