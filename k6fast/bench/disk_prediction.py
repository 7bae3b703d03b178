"""Disk reads per denoising step of an acceptance run beside the host-memory ballast: what `k6fast doctor` predicted
for it and what the run read (issue #33 asks for both, and for the prediction to be within 20 %).

- `read_speed`: the checkpoint's disk read speed by doctor's own read test (its cached pages dropped first), once per
  session that has ballast runs.
- `predict`: with the ballast in place and before the run's process starts, `doctor.predict_disk_per_step` for the
  run's arm, budget and geometry, the host's memory as it is then (`k6fast.memory`, its one reader) and that speed.
- `StepReads`: the run's read_bytes at its denoising step boundaries, which it learns from the process's progress bar
  in its log, read just before each read_bytes sample.
- `disk_per_step`: the row's figures, the predicted bytes of one steady scan of the streamed blocks beside the
  measured ones (the formula is `steady_reads`'s).

The arm enters through the residency: doctor plans the activations of the arm's resolved kernels (an fp8 GEMM holds
more, so fewer blocks stay resident and more stream). What a streamed block reads is its stored bytes in the
checkpoint's files, whatever the arm computes in: an fp8 or DF11 checkpoint's blocks read less, an fp8 arm on a BF16
checkpoint reads BF16 blocks. The figures are for the record's reader; no run passes or fails on them.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from .. import memory
from ..memory import GiB

# tqdm's `denoise` bar as `k6fast generate` writes it to its log: "denoise:  20%|██      | 2/10 [00:18<...]".
_BAR = re.compile(r"denoise:[^\r\n|]*\|[^|\r\n]*\|\s*(\d+)/(\d+)")
_TAIL_CHARS = 200  # kept from the last read, so a bar split across two reads is still found


def read_speed(model: str) -> dict[str, Any]:
    """The checkpoint's disk read speed (GB/s) by doctor's read test, and what it read."""
    from ..doctor import checkpoint_read_speed

    gb_s, note = checkpoint_read_speed(model)
    return {"read_gb_s": round(gb_s, 4), "note": note}


def predict(
    model: str, arm: str, budget_gb: float, geometry: tuple[int, int, int], read_gb_s: float | None
) -> dict[str, Any]:
    """Doctor's prediction for one run, made now: the residency doctor plans for `arm` (its GEMM and attention as
    resolved for this machine's first GPU) under `budget_gb` GiB at `geometry`, and `predict_disk_per_step` with the
    host's MemAvailable and cgroup limit now. step_bytes/step_min_s: the figures for the host tier the run's process
    will have (K6_HOST_CACHE_GB as the arm sets it, `auto` by default: the process inherits no K6_* variable); None
    where the arm sets a number of GiB the host cannot spare (the run refuses to start)."""
    from ..doctor import dit_plan, predict_disk_per_step, read_gpus
    from ..switches import load_options

    gpus = read_gpus()
    host = memory.host_memory()
    setting = load_options({}, arm=arm).host_cache_gb
    plan = dit_plan(Path(model), int(budget_gb * GiB), gpus[0] if gpus else None, arm=arm, geometry=geometry)
    out: dict[str, Any] = {
        "arm": arm, "budget_gb": budget_gb, "geometry": "x".join(map(str, geometry)),
        "gpu": gpus[0].name if gpus else None, "host_cache_gb": setting, "available_bytes": host.available_bytes,
        "cgroup": None if host.cgroup is None else dataclasses.asdict(host.cgroup), "read_gb_s": read_gb_s,
        "resident_blocks": plan.get("resident_blocks"), "num_blocks": plan.get("num_blocks"),
    }  # fmt: skip
    if "resident_blocks" not in plan:  # the budget holds not even the streaming minimum: the run will say so too
        return {**out, "error": plan["describe"], "step_bytes": None, "step_min_s": None}
    doctor = predict_disk_per_step(plan, host.available_bytes, read_gb_s, host.cgroup, setting)
    out["doctor"] = doctor
    if doctor is None:  # every block resident: nothing streams, nothing is read per step
        return {**out, "step_bytes": 0, "step_min_s": 0.0 if read_gb_s else None}
    # The tier as set: auto or a size (None where the host cannot spare that size: the run refuses to start).
    return {**out, "step_bytes": doctor["with_tier_bytes"], "step_min_s": doctor["with_tier_min_s"]}


class StepReads:
    """The child's read_bytes when each of its denoising steps had ended, as the watcher saw them: `poll` reads the
    log's new text for the last step count its progress bar shows, then the watcher reads /proc/PID/io and `record`s
    the pair. Read in that order, a step's bytes are taken no earlier than its end, at most one sampling interval
    later, as at every other step boundary."""

    def __init__(self, log: Path):
        self.log = log
        self.at: dict[int, int] = {}  # steps ended -> read_bytes the first time the bar showed that count
        self.total: int | None = None  # the bar's number of steps
        self._offset, self._tail = 0, ""

    def poll(self) -> int | None:
        """The last step count the bar shows in the log's text since the last poll (None: none new)."""
        try:
            with open(self.log, "rb") as f:
                f.seek(self._offset)
                raw = f.read()
        except OSError:
            return None
        self._offset += len(raw)
        new = raw.decode("utf-8", errors="replace")  # a character cut by the read: the counts are ASCII
        text, self._tail = self._tail + new, (self._tail + new)[-_TAIL_CHARS:]
        found = _BAR.findall(text)
        if not found:
            return None
        done, total = (int(v) for v in found[-1])
        self.total = total
        return done

    def record(self, done: int | None, read_bytes: int | None) -> None:
        if done is not None and read_bytes is not None:
            self.at.setdefault(done, read_bytes)


def steady_reads(at: dict[int, int], forwards: dict[int, int]) -> dict[str, Any] | None:
    """Bytes read from disk per DiT forward of the steady steps: (read_bytes when step k1 had ended − when step k0 had
    ended) / (DiT forwards in steps k0+1..k1), k0 the first step boundary seen at or after the first step's end (the
    first step fills the host tier; before it come the load and the text phase) and k1 the last one seen while the
    process ran. `forwards`: {step (1-based): DiT forwards it ran}, 0 for a cached step, 2 for one with CFG. None
    when the watcher saw fewer than two boundaries or no forward ran between them."""
    seen = sorted(k for k in at if k >= 1)
    if len(seen) < 2:
        return None
    k0, k1 = seen[0], seen[-1]
    calls = sum(forwards.get(k, 1) for k in range(k0 + 1, k1 + 1))
    if calls == 0:
        return None
    read = at[k1] - at[k0]
    return {"bytes": round(read / calls), "read_bytes": read, "forwards": calls, "from_step": k0, "to_step": k1}


def step_forwards(telemetry: dict[str, Any], cache_steps: tuple[int, ...]) -> dict[int, int]:
    """{step (1-based): DiT forwards} of a finished request: 0 for the steps it did not call (its `step_called`; in
    sidecars before that, the arm's K6_PIFLOW_CACHE_STEPS, `cache_steps` 0-based, and the steps the step cache
    skipped), else the request's forwards per called step (2 with CFG)."""
    steps = len(telemetry.get("step_s", []))
    if "step_called" in telemetry:
        skipped = {i for i, called in enumerate(telemetry["step_called"]) if not called}
    else:
        skipped = set(cache_steps) | set((telemetry.get("step_cache") or {}).get("skipped_steps", []))
    called = steps - telemetry.get("cached_steps", 0)
    per_call = round(telemetry.get("dit_calls", called) / called) if called else 0
    return {i + 1: 0 if i in skipped else per_call for i in range(steps)}


def disk_per_step(prediction: dict[str, Any], reads: StepReads, sidecar: Path, arm: str) -> dict[str, Any]:
    """The row's `disk_per_step`: the predicted bytes and floor seconds of one scan of the streamed blocks, and the
    measured bytes (`steady_reads`) and seconds (the sidecar's step_s over the same steps) per DiT forward, where the
    run left its sidecar and the watcher saw two step boundaries."""
    out: dict[str, Any] = {
        "predicted_bytes": prediction.get("step_bytes"),
        "predicted_min_s": prediction.get("step_min_s"),
        "boundaries": {str(k): v for k, v in sorted(reads.at.items())},
    }
    if not sidecar.is_file():
        return out
    from ..switches import load_options

    telemetry = json.loads(sidecar.read_text())["telemetry"]
    forwards = step_forwards(telemetry, tuple(load_options({}, arm=arm).piflow_cache_steps))
    steady = steady_reads(reads.at, forwards)
    if steady is None:
        return out
    seconds = sum(telemetry.get("step_s", [])[steady["from_step"] : steady["to_step"]])
    out.update(measured_bytes=steady["bytes"], measured_s=round(seconds / steady["forwards"], 4), measured=steady)
    return out
