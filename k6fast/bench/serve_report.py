"""The `k6fast serve` section of an acceptance record's README (and of README's results): the records of
`measurements/bench_serve_defaults.py`, a line per server and a row per job."""

from __future__ import annotations

from typing import Any

from .table_cells import PHASES_HEADER, gb, gib, phase_split, secs

SERVE_COLUMNS = ("serve run", "job", "size", "outcome", "submit → done s", "run s", PHASES_HEADER,
                 "text source", "disk read GB", "peak RSS GiB")  # fmt: skip


def _serve_name(record: dict[str, Any]) -> str:
    return f"{record.get('arm') or 'env'} @ {record.get('budget_gb', 0):g} GiB"


def _serve_summary(record: dict[str, Any]) -> str:
    start = record.get("startup") or {}
    parts = [f"ready in {secs(start.get('ready_s'))} s (read {gb(start.get('disk_read_bytes'))} GB)",
             f"peak host RSS {gib(record.get('peak_rss_bytes'))} GiB",
             f"nvidia-smi peak {gib((record.get('peak_smi_used_mib') or 0) * 2**20)} GiB",
             f"disk read {gb(record.get('disk_read_bytes'))} GB in all"]  # fmt: skip
    if record.get("jobs_set") == "first":
        parts.insert(0, "the first job only (`--jobs first`)")
    deleted = next((j for j in record.get("jobs", []) if j.get("plan") == "delete"), None)
    if deleted and deleted.get("delete"):
        d = deleted["delete"]
        parts.append(f"DELETE at {d.get('progress')} % took effect in {secs(d.get('took_effect_s'), 2)} s "
                     f"({d.get('phase') or 'phase not logged'})")  # fmt: skip
    over = record.get("oversize") or {}
    if over:
        queued = "queued" if over.get("queued") else "not queued"
        message = str(over.get("message", "")).replace("|", "/")[:200]
        parts.append(f"oversize {over.get('geometry')}: {over.get('status')}, {queued}: {message!r}")
    result = "PASS" if record.get("passed") else "**FAIL**: " + "; ".join(record.get("problems", []))[:300]
    client = record.get("client", "never ready")
    return f"- `{_serve_name(record)}` ({client}): {result}; " + "; ".join(parts)


def serve_lines(records: list[dict[str, Any]], heading: str = "##") -> list[str]:
    """The section of `measurements/bench_serve_defaults.py`'s records: a line per server, a row per job."""
    lines = [
        f"{heading} `k6fast serve` at its defaults",
        "",
        "`measurements/bench_serve_defaults.py`: `k6fast serve --model M --arm ARM` with no size options under "
        "`K6_VRAM_BUDGET_GB`, four queued jobs of two sizes through the openai SDK (one prompt repeated, a second "
        "prompt last, one job deleted part-way; with `--jobs first` only the first) and one request larger than "
        "the budget holds.",
        "",
        *(_serve_summary(r) for r in records),
        "",
        "| " + " | ".join(SERVE_COLUMNS) + " |",
        "|" + "---|" * len(SERVE_COLUMNS),
    ]
    for record in records:
        for job in record.get("jobs", []):
            telemetry = job.get("telemetry") or {}
            phases = telemetry.get("phases_s") or {}
            cells = [_serve_name(record), job.get("name"), job.get("geometry"), job.get("outcome"),
                     secs(job.get("done_after_s")), secs(job.get("run_s")), phase_split(phases) if phases else "—",
                     telemetry.get("text_source") or "—", gb(job.get("disk_read_bytes")),
                     gib(job.get("peak_rss_bytes"))]  # fmt: skip
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return [*lines, ""]
