"""Arms: named sets of switch values kept as `.env` files, so a measured result names its configuration.

An arm file holds `KEY=VALUE` lines, `#` comment lines and blank lines. Every key must be a declared `K6_*`
switch, set at most once, to a valid value; anything else is an error naming the file and line. There is no
quoting and no inline comment: `K6_AUDIO_NORM=clip  # fast` is the value `clip  # fast`, which is rejected.
Secrets cannot be set in an arm: arm files are committed and shared.
"""

from __future__ import annotations

import re
from pathlib import Path

from .catalog import SWITCHES_BY_NAME
from .registry import SwitchError, unknown_switch_hint

ARMS_DIR = Path(__file__).resolve().parent / "arms"
ARM_SUFFIX = ".env"
_ARM_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def list_arms() -> list[str]:
    """Names of the arms packaged with k6fast (the `arms/*.env` files), sorted."""
    return sorted(p.name.removesuffix(ARM_SUFFIX) for p in ARMS_DIR.glob(f"*{ARM_SUFFIX}") if p.is_file())


def is_arm_path(name_or_path: str | Path) -> bool:
    """True when the argument names a file (a Path, a path with a separator, or `*.env`) rather than an arm."""
    if isinstance(name_or_path, Path):
        return True
    return "/" in name_or_path or "\\" in name_or_path or name_or_path.endswith(ARM_SUFFIX)


def resolve_arm(name_or_path: str | Path) -> Path:
    """The arm file for a packaged arm name (`reference`) or an explicit path (`arms/mine.env`, `./x.env`)."""
    if is_arm_path(name_or_path):
        path = Path(name_or_path)
        if not path.is_file():
            raise SwitchError(f"Arm file {str(path)!r} does not exist (or is not a file)")
        return path
    available = list_arms()
    if _ARM_NAME_RE.fullmatch(name_or_path) and name_or_path in available:
        return ARMS_DIR / f"{name_or_path}{ARM_SUFFIX}"
    raise SwitchError(
        f"Unknown arm {name_or_path!r}: expected one of {', '.join(available) or '(none packaged)'}, "
        f"or a path to a {ARM_SUFFIX} file"
    )


def read_arm(path: str | Path) -> dict[str, str]:
    """Read and validate an arm file; returns its raw `K6_*` values in file order."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SwitchError(f"Unable to read arm file {str(path)!r}: {exc}") from exc
    values: dict[str, str] = {}
    first_line: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        where = f"{path}:{lineno}"
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        key, sep, raw = stripped.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or not _KEY_RE.fullmatch(key):
            raise SwitchError(f"{where}: expected KEY=VALUE, a # comment or a blank line, found {stripped!r}")
        if not key.startswith("K6_"):
            raise SwitchError(f"{where}: expected a K6_* switch, found {key!r}")
        switch = SWITCHES_BY_NAME.get(key)
        if switch is None:
            raise SwitchError(f"{where}: unknown switch {key}; {unknown_switch_hint(key, SWITCHES_BY_NAME)}")
        if switch.secret:
            raise SwitchError(f"{where}: {key} is a secret and cannot be set in an arm file; set it in the environment")
        if key in values:
            raise SwitchError(f"{where}: {key} is set twice (first on line {first_line[key]})")
        try:
            switch.parse(raw)
        except SwitchError as exc:
            raise SwitchError(f"{where}: {exc}") from None
        values[key] = raw
        first_line[key] = lineno
    return values
