"""Where a bench session's records live and how they are written: atomically, one JSON object per visit.

A session folder `measurements/sessions/<YYYY-MM-DD>_<topic>/` holds `session.json` (the plan and the command) and
`visits.jsonl` (one row per visit, appended as each visit ends, so an interrupted session keeps what it measured).
Optional extras a session folder may hold: a quality-gate report (`gate*.json`, or a gate output folder
`gate*/report.json`), plotted as speed against LPIPS, and the rendered `plot.png`.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..atomic import write_json_atomic

# The request every bench and acceptance session asks for unless told otherwise.
DEFAULT_PROMPT = (
    "A rain-slicked Tokyo alley at night, camera tracking forward past a glowing neon sign that reads OPEN in red "
    "letters, reflections rippling in puddles. Audio: steady rain on metal awnings, a distant train."
)

SESSION_FILE = "session.json"
VISITS_FILE = "visits.jsonl"
PLOT_FILE = "plot.png"
SCHEMA = "k6fast-bench-v1"
_TOPIC_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def write_json(path: Path, data: Any) -> None:
    write_json_atomic(path, data)


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    """Append one row as a single write of one line, fsynced: a crash leaves whole rows only (a torn last line at
    worst, which `read_jsonl` reports)."""
    line = (json.dumps(row, sort_keys=True) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not a JSON row ({exc}); expected one JSON object per line") from exc
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object, found {type(row).__name__}")
        rows.append(row)
    return rows


def check_topic(topic: str) -> str:
    if not _TOPIC_RE.fullmatch(topic):
        raise ValueError(f"--topic {topic!r}: expected letters, digits, '_', '.' or '-' (it names a folder)")
    return topic


def new_session_dir(root: Path, topic: str, today: dt.date | None = None) -> Path:
    """Create `root/<date>_<topic>`; a second session of the same topic on the same day gets `_2`, `_3`, ..."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    base = f"{(today or dt.date.today()).isoformat()}_{check_topic(topic)}"
    for n in range(1, 1000):
        path = root / (base if n == 1 else f"{base}_{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"{root}: 999 sessions named {base}_* already exist; choose another --topic")


@dataclass
class SessionRecord:
    """A session folder read back: its plan and its visit rows."""

    path: Path
    session: dict[str, Any]
    visits: list[dict[str, Any]]
    gate_reports: list[Path] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.path.name


def load_session(path: Path) -> SessionRecord:
    path = Path(path)
    session_file = path / SESSION_FILE
    if not session_file.is_file():
        raise ValueError(f"{path}: not a bench session folder (expected {SESSION_FILE})")
    session = json.loads(session_file.read_text(encoding="utf-8"))
    visits_file = path / VISITS_FILE
    visits = read_jsonl(visits_file) if visits_file.is_file() else []
    gates = sorted({*path.glob("gate*.json"), *path.glob("gate*/report.json")})
    return SessionRecord(path, session, visits, gates)


def load_sessions(root: Path) -> list[SessionRecord]:
    """Every session folder under `root`, oldest first (by start time, then folder name)."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"--sessions {root}: no such folder; expected the folder `k6fast bench` writes sessions to")
    records = [load_session(p) for p in root.iterdir() if (p / SESSION_FILE).is_file()]
    return sorted(records, key=lambda r: (str(r.session.get("started", "")), r.name))
