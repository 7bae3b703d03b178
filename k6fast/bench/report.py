"""`k6fast bench report`: every recorded session, rendered into `measurements/README.md` and one PNG per session.

The README keeps whatever is written above the marker line (a hand-written preamble) and regenerates everything
below it. Per session: one table (arm, samples, median, spread, speedup against the control arm and against the
peer row, warm-up, load, peak VRAM, peak anonymous host RSS, contaminated visits) and a plot of time per arm; when
the session folder holds a quality-gate report, a second panel plots speed against LPIPS.

A gate report is the gate's `report.json` (copied in as `gate*.json`, or a gate output folder `gate*/`): per arm
`{"arm": spec, "label": ..., "arm_hash": ..., "set": {"lpips_mean": x}}` in a list under "arms". A bench arm is
matched by name, file stem or arm hash; a flat `{"arms": {"<arm>": {"lpips_mean": x}}}` is read too.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..atomic import write_bytes_atomic as write_atomic
from ..memory import GiB
from .records import PLOT_FILE, SessionRecord, load_sessions
from .stats import Summary, compare, median

MARKER = "<!-- k6fast bench report: everything below this line is generated; edit above it -->"
DEFAULT_PREAMBLE = """# Measurements

Bench sessions recorded by `k6fast bench` (one folder per session under `sessions/`, one JSON row per visit in its
`visits.jsonl`). Each visit is a fresh process; arms are visited mirrored (A B B A); one warm-up request per visit
is kept apart from the statistic and shown on its own; the statistic is the median per arm with the observed range,
and a median inside the baseline's range reads "no difference". Contaminated visits (another process used the GPU)
are left out of the statistic and listed. Regenerate the part below the marker with `k6fast bench report`.
"""
_LPIPS_KEYS = ("lpips_mean", "mean_lpips", "lpips")
_UNITS = {"pipeline": "s per request", "dit": "s per DiT forward", "block": "s per fused block"}


def display_name(arm: str) -> str:
    """Arm files are shown by file name (`arms/final.env` → `final.env`); names and peers as they are."""
    return Path(arm).name if ("/" in arm or arm.endswith(".env")) else arm


@dataclass
class ArmResult:
    arm: str
    seconds: list[float] = field(default_factory=list)  # clean timed requests
    step_seconds: list[float] = field(default_factory=list)  # per clean request: mean seconds per denoising step
    warmup: list[float] = field(default_factory=list)
    load: list[float] = field(default_factory=list)
    peak_vram: int = 0
    peak_rss_anon: int = 0
    contaminated: list[int] = field(default_factory=list)  # visit indices
    contaminated_seconds: list[float] = field(default_factory=list)
    visits: int = 0
    hashes: set[str] = field(default_factory=set)  # arm hashes the visits recorded (k6fast arms)
    copy_s: float = 0.0  # streamed weights, summed over clean requests: copy time and the part compute did not hide
    exposed_s: float = 0.0

    def summary(self) -> Summary | None:
        return Summary.of(self.seconds) if self.seconds else None

    def step_summary(self) -> Summary | None:
        return Summary.of(self.step_seconds) if self.step_seconds else None


def collect(record: SessionRecord) -> tuple[dict[str, ArmResult], list[str]]:
    """Per-arm results of one session in plan order, and notes on visits the statistic could not use as is."""
    plan = record.session.get("plan", {})
    arms = {arm: ArmResult(arm) for arm in plan.get("arms", [])}
    notes = []
    for row in record.visits:
        name = row.get("arm", "?")
        arm = arms.setdefault(name, ArmResult(name))
        if "error" in row:
            notes.append(f"visit {row.get('visit')} ({display_name(name)}) failed: {row['error'].splitlines()[0]}")
            continue
        arm.visits += 1
        arm_hash = (row.get("provenance") or {}).get("arm_hash")
        if arm_hash:
            arm.hashes.add(arm_hash)
        idle = row.get("idle_wait") or {}
        if idle.get("idle") is False:
            notes.append(f"visit {row.get('visit')} ({display_name(name)}) started before the GPU was idle")
        requests = row.get("requests", [])
        if row.get("contaminated"):
            arm.contaminated.append(row.get("visit"))
            arm.contaminated_seconds += [r["seconds"] for r in requests]
        else:
            arm.seconds += [r["seconds"] for r in requests]
            for r in requests:
                telemetry = r.get("telemetry", {})
                steps = telemetry.get("step_s") or []
                if steps:
                    arm.step_seconds.append(sum(steps) / len(steps))
                for stream in telemetry.get("stream_steps") or []:
                    arm.copy_s += stream.get("copy_s", 0.0)
                    arm.exposed_s += stream.get("exposed_s", 0.0)
        arm.warmup += [w["seconds"] for w in row.get("warmup", [])]
        if isinstance(row.get("load_s"), int | float):
            arm.load.append(row["load_s"])
        arm.peak_vram = max(arm.peak_vram, int(row.get("peak_vram_bytes") or 0))
        arm.peak_rss_anon = max(arm.peak_rss_anon, int(row.get("peak_rss_anon_bytes") or 0))
    return arms, notes


def _fmt_s(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.3f}" if value < 100 else f"{value:.1f}"


def _fmt_gib(value: int) -> str:
    return f"{value / GiB:.2f}" if value else "—"


def _fmt_cmp(arm: ArmResult, base: ArmResult | None, steps: bool = False) -> str:
    if base is None or arm is base:
        return "—"
    a, b = (arm.step_summary(), base.step_summary()) if steps else (arm.summary(), base.summary())
    if a is None or b is None:
        return "—"
    return compare(a, b).describe()


def gate_lpips(report: dict[str, Any]) -> dict[str, float]:
    """Mean LPIPS per arm from a quality-gate report, keyed by every name the arm goes by there (its spec, label
    and hash), so a bench arm can be matched by name, file stem or arm hash."""
    entries = report.get("arms", report.get("results"))
    if isinstance(entries, dict):
        entries = [{"arm": name, **values} for name, values in entries.items() if isinstance(values, dict)]
    out: dict[str, float] = {}
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, dict):
            continue
        scope = entry.get("set") if isinstance(entry.get("set"), dict) else entry
        value = next((scope[k] for k in _LPIPS_KEYS if isinstance(scope.get(k), int | float)), None)
        if value is None:
            continue
        for key in ("arm", "label", "arm_hash"):
            if isinstance(entry.get(key), str) and entry[key]:
                out[entry[key]] = float(value)
    return out


def arm_lpips(arm: ArmResult, lpips: dict[str, float]) -> float | None:
    """The gate's mean LPIPS for a bench arm: by name, by file name or stem, then by arm hash."""
    for key in (arm.arm, Path(arm.arm).name, Path(arm.arm).stem, *sorted(arm.hashes)):
        if key in lpips:
            return lpips[key]
    return None


def _session_lpips(record: SessionRecord, arms: dict[str, ArmResult]) -> dict[str, float]:
    gate: dict[str, float] = {}
    for path in record.gate_reports:
        gate.update(gate_lpips(json.loads(path.read_text(encoding="utf-8"))))
    return {a.arm: v for a in arms.values() if (v := arm_lpips(a, gate)) is not None}


def session_table(record: SessionRecord, link_prefix: str = "sessions") -> str:
    """The Markdown section of one session; links point to `link_prefix/<session>/`."""
    plan = record.session.get("plan", {})
    arms, notes = collect(record)
    control = arms.get(plan.get("control", ""))
    peer = arms.get(plan.get("peer") or "")
    component = plan.get("component", "?")
    per_step = component == "pipeline"  # for dit and block, one request is one step's worth already
    gpu = next((r["environment"].get("gpu_name") for r in record.visits if r.get("environment")), None)
    folder = f"{link_prefix}/{record.name}"
    lines = [
        f"### {record.name}",
        "",
        f"{component} · {plan.get('geometry', '?')} · {plan.get('steps', '?')} steps · "
        f"model `{plan.get('model', '?')}` · {gpu or 'no GPU'} · order {plan.get('order', '?')} × "
        f"{plan.get('repeats', '?')} · status {record.session.get('status', '?')} · [session folder]({folder}/)"
        + "".join(f" · {name}={value}" for name, value in (plan.get("switches") or {}).items()),
        "",
        f"`{record.session.get('command', '')}`",
        "",
    ]
    header = ["arm", "n", f"median ({_UNITS.get(component, 's')})", "spread (min–max)"]
    header += ["s per step (median)"] if per_step else []
    header += [f"vs {display_name(control.arm) if control else 'control'}", f"vs {peer.arm if peer else 'peer'}"]
    header += ["per step vs control"] if per_step else []
    streamed = any(a.copy_s > 0 for a in arms.values())
    header += ["copies hidden"] if streamed else []
    header += ["warm-up s", "load s", "peak VRAM GiB", "peak RssAnon GiB", "contaminated visits"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for arm in arms.values():
        s = arm.summary()
        role = " (control)" if arm is control else " (peer)" if arm is peer else ""
        row = [f"`{display_name(arm.arm)}`{role}", str(s.n if s else 0), _fmt_s(s.median if s else None)]
        row.append(f"{_fmt_s(s.low)}–{_fmt_s(s.high)}" if s else "—")
        if per_step:
            step = arm.step_summary()
            row.append(_fmt_s(step.median if step else None))
        row += [_fmt_cmp(arm, control), _fmt_cmp(arm, peer)]
        if per_step:
            row.append(_fmt_cmp(arm, control, steps=True))
        if streamed:
            row.append(f"{100 * (1 - arm.exposed_s / arm.copy_s):.1f}%" if arm.copy_s > 0 else "—")
        row += [
            _fmt_s(median(arm.warmup) if arm.warmup else None),
            _fmt_s(median(arm.load) if arm.load else None),
            _fmt_gib(arm.peak_vram),
            _fmt_gib(arm.peak_rss_anon),
            ", ".join(str(v) for v in arm.contaminated) or "none",
        ]
        lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        "Speedup = baseline median / arm median (> 1: the arm is faster); in brackets the range from pairing the "
        "observed extremes; \"no difference\" when the arm's median lies inside the baseline's observed range.",
    ]
    lpips = _session_lpips(record, arms)
    if record.gate_reports:
        found = ", ".join(f"`{display_name(a)}` {v:.4f}" for a, v in lpips.items()) or "no arm of this session"
        names = ", ".join(f"`{p.relative_to(record.path)}`" for p in record.gate_reports)
        lines.append(f"\nGate report {names}: mean LPIPS {found}.")
    lines += [f"\nNote: {note}." for note in notes]
    if (record.path / PLOT_FILE).is_file():
        lines += ["", f"![{record.name}]({folder}/{PLOT_FILE})"]
    return "\n".join(lines) + "\n"


def plot_session(record: SessionRecord) -> bytes:
    """PNG bytes: time per arm (clean requests as dots, contaminated ones hollow red, warm-ups as grey crosses,
    medians as bars); with a gate report, a second panel of median time against mean LPIPS."""
    import matplotlib

    matplotlib.use("Agg")  # GPU hosts have no display; the plot is a file
    import matplotlib.pyplot as plt

    arms, _ = collect(record)
    lpips = _session_lpips(record, arms)
    fig, axes = plt.subplots(1, 2 if lpips else 1, figsize=(12 if lpips else 6.5, 3.8), squeeze=False)
    ax = axes[0][0]
    labelled: set[str] = set()

    def label(name: str) -> str | None:
        return None if name in labelled or labelled.add(name) else name

    for i, arm in enumerate(arms.values()):
        ax.scatter([i] * len(arm.seconds), arm.seconds, color="C0", zorder=3, label=label("timed request"))
        if arm.warmup:
            ax.scatter([i + 0.15] * len(arm.warmup), arm.warmup, marker="x", color="0.5", label=label("warm-up"))
        if arm.contaminated_seconds:
            x = [i - 0.15] * len(arm.contaminated_seconds)
            ax.scatter(x, arm.contaminated_seconds, facecolors="none", edgecolors="C3", label=label("contaminated"))
        s = arm.summary()
        if s:
            ax.hlines(s.median, i - 0.3, i + 0.3, color="C1", zorder=2, label=label("median"))
    ax.set_xticks(range(len(arms)), [display_name(a) for a in arms], rotation=15, ha="right")
    ax.set_ylabel(_UNITS.get(record.session.get("plan", {}).get("component", ""), "seconds"))
    ax.set_ylim(bottom=0)
    ax.set_title(record.name)
    ax.legend(loc="lower right", fontsize="small")
    if lpips:
        ax2 = axes[0][1]
        for name, value in lpips.items():
            s = arms[name].summary()
            if s:
                ax2.scatter(value, s.median, color="C0")
                ax2.annotate(display_name(name), (value, s.median), fontsize="small")
        ax2.set_xlabel("mean LPIPS against the reference")
        ax2.set_ylabel("median seconds")
        ax2.set_title("speed against quality")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def split_readme(text: str) -> str:
    """The preamble to keep: everything above the marker, or the whole file when it has no marker yet."""
    head, sep, _ = text.partition(MARKER)
    return head.rstrip("\n") + "\n" if sep else text.rstrip("\n") + "\n"


def render(sessions_root: Path, readme: Path, plots: bool = True) -> list[Path]:
    """Render the README below its marker (and a PNG per session); returns the files written."""
    records = load_sessions(sessions_root)  # first: a wrong folder is refused without matplotlib's import (0.3 s)
    if plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            raise RuntimeError(
                f"k6fast bench report draws a PNG per session with matplotlib, which cannot be imported ({exc}); "
                "install matplotlib or pass --no-plot"
            ) from exc
    readme = Path(readme)
    written = []
    if plots:
        for record in records:
            if any("error" not in row for row in record.visits):
                write_atomic(record.path / PLOT_FILE, plot_session(record))
                written.append(record.path / PLOT_FILE)
    link_prefix = Path(os.path.relpath(Path(sessions_root).resolve(), readme.resolve().parent)).as_posix()
    preamble = split_readme(readme.read_text(encoding="utf-8")) if readme.is_file() else DEFAULT_PREAMBLE
    body = "\n".join(session_table(r, link_prefix) for r in reversed(records)) or "No sessions recorded yet.\n"
    write_atomic(readme, f"{preamble}\n{MARKER}\n\n## Sessions (newest first)\n\n{body}".encode())
    written.append(readme)
    return written


def headline(record: SessionRecord) -> dict[str, Any]:
    """Machine-readable summary of a session: per arm its summary and its comparisons (for scripts and tests)."""
    plan = record.session.get("plan", {})
    arms, notes = collect(record)
    control, peer = arms.get(plan.get("control", "")), arms.get(plan.get("peer") or "")
    out: dict[str, Any] = {"session": record.name, "notes": notes, "arms": {}}
    for arm in arms.values():
        s = arm.summary()
        entry: dict[str, Any] = {"summary": s.as_dict() if s else None, "contaminated": arm.contaminated}
        for key, base in (("vs_control", control), ("vs_peer", peer)):
            if s and base is not None and base is not arm and base.summary():
                c = compare(s, base.summary())
                entry[key] = {"speedup": c.speedup, "range": [c.speedup_low, c.speedup_high], "same": c.no_difference}
        out["arms"][arm.arm] = entry
    return out
