"""Typed environment switches: the `Switch` declaration, its parser and canonical formatter.

A switch is parsed strictly and fails loudly: `K6_X=true` for a boolean is an error, not a guess, because a
typo that silently selects the reference path would make a benchmark measure the wrong thing. Each value has
one canonical string form (`format`), and `parse(format(v)) == v`; snapshots and the arm hash are built from it.
"""

from __future__ import annotations

import difflib
import math
import re
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Kind = Literal["bool", "int", "float", "auto_float", "enum", "int_list", "str", "path"]
KINDS: tuple[str, ...] = ("bool", "int", "float", "auto_float", "enum", "int_list", "str", "path")
# An `auto_float` switch takes this word (parsed as itself) or a number: a size k6fast chooses unless one is given.
AUTO = "auto"

# The Python type each kind parses to; Options declares its attributes with these.
PYTHON_TYPES: dict[str, object] = {
    "bool": bool,
    "int": int,
    "float": float,
    "auto_float": float | str,
    "enum": str,
    "int_list": tuple[int, ...],
    "str": str,
    "path": Path | None,
}

SwitchValue = bool | int | float | str | tuple[int, ...] | Path | None

_NAME_RE = re.compile(r"K6_[A-Z0-9]+(?:_[A-Z0-9]+)*")
# int() alone would also take "1_000" and "٣" (Arabic-Indic digits); a switch takes plain ASCII decimals.
_INT_RE = re.compile(r"[+-]?[0-9]+")
_BOUNDED_KINDS = ("int", "float", "auto_float", "int_list")
SECRET_SET = "<set>"


class SwitchError(ValueError):
    """A switch value, declaration or arm file that cannot be used."""


class UnknownSwitchWarning(UserWarning):
    """A `K6_*` environment variable that no switch declares (usually a typo)."""


@dataclass(frozen=True)
class Switch:
    """One `K6_*` environment switch.

    `default` is the reference (off) value in its parsed form; a raw string is accepted and parsed. `secret`
    values are redacted wherever they are shown and never hashed; `affects_output=False` marks switches that
    cannot change the generated video or audio (a cache directory, an API key), which the arm hash leaves out.
    """

    name: str
    kind: Kind
    default: SwitchValue
    doc: str
    lossy: bool = False
    choices: tuple[str, ...] = ()
    min: int | float | None = None
    max: int | float | None = None
    secret: bool = False
    affects_output: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):
            raise SwitchError(f"Switch name must look like K6_UPPER_SNAKE, found {self.name!r}")
        if self.kind not in KINDS:
            raise SwitchError(f"{self.name}: kind must be one of {', '.join(KINDS)}, found {self.kind!r}")
        if not self.doc.strip() or "\n" in self.doc:
            raise SwitchError(f"{self.name}: doc must be one non-empty line, found {self.doc!r}")
        object.__setattr__(self, "choices", tuple(self.choices))
        if self.kind == "enum":
            if not self.choices:
                raise SwitchError(f"{self.name}: an enum switch needs choices, found none")
            if len(set(self.choices)) != len(self.choices):
                raise SwitchError(f"{self.name}: enum choices must be distinct, found {self.choices}")
            bad = [c for c in self.choices if not isinstance(c, str) or not c or c != c.strip() or "," in c]
            if bad:
                raise SwitchError(f"{self.name}: enum choices must be non-empty words, found {bad}")
        elif self.choices:
            raise SwitchError(f"{self.name}: only enum switches take choices, found {self.choices} on a {self.kind}")
        if (self.min is not None or self.max is not None) and self.kind not in _BOUNDED_KINDS:
            raise SwitchError(f"{self.name}: bounds apply to {', '.join(_BOUNDED_KINDS)} switches, not {self.kind}")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise SwitchError(f"{self.name}: min must be <= max, found min={self.min} max={self.max}")
        if self.secret and (self.affects_output or self.lossy):
            # A secret is excluded from the arm hash, so it must not be able to change the output.
            raise SwitchError(f"{self.name}: a secret switch must have affects_output=False and lossy=False")
        if self.lossy and not self.affects_output:
            raise SwitchError(f"{self.name}: a lossy switch changes the output, so affects_output must be True")
        object.__setattr__(self, "default", self.coerce(self.default))

    @property
    def attr(self) -> str:
        """The Options attribute name: `K6_PIFLOW_CACHE_STEPS` -> `piflow_cache_steps`."""
        return self.name.removeprefix("K6_").lower()

    @property
    def python_type(self) -> object:
        return PYTHON_TYPES[self.kind]

    @property
    def accepts(self) -> str:
        """What a valid raw value looks like, for error messages and tables."""
        if self.kind == "bool":
            return "0 or 1"
        if self.kind == "int":
            return "an integer" + self._bounds_text()
        if self.kind == "float":
            return "a finite number" + self._bounds_text()
        if self.kind == "auto_float":
            return f"{AUTO}, or a finite number" + self._bounds_text()
        if self.kind == "enum":
            return "one of " + ", ".join(self.choices)
        if self.kind == "int_list":
            return "comma-separated distinct integers" + self._bounds_text() + ", or empty"
        if self.kind == "path":
            return "a filesystem path, or empty"
        return "any string"

    def _bounds_text(self) -> str:
        if self.min is not None and self.max is not None:
            return f" in [{self.min}, {self.max}]"
        if self.min is not None:
            return f" >= {self.min}"
        if self.max is not None:
            return f" <= {self.max}"
        return ""

    def _error(self, raw: object, why: str = "") -> SwitchError:
        shown = SECRET_SET if self.secret else repr(raw)
        detail = f" ({why})" if why else ""
        return SwitchError(f"Unable to use {self.name}={shown}: expected {self.accepts}{detail}")

    def _in_bounds(self, value: int | float) -> bool:
        return (self.min is None or value >= self.min) and (self.max is None or value <= self.max)

    def parse(self, raw: str) -> SwitchValue:
        """Parse a raw environment/arm-file string; raises SwitchError naming the variable and what it accepts."""
        if not isinstance(raw, str):
            raise self._error(raw, f"a raw value must be a string, found {type(raw).__name__}")
        if self.kind == "bool":
            if raw not in ("0", "1"):
                raise self._error(raw)
            return raw == "1"
        if self.kind == "int":
            text = raw.strip()
            if not _INT_RE.fullmatch(text) or not self._in_bounds(int(text)):
                raise self._error(raw)
            return int(text)
        if self.kind == "auto_float" and raw == AUTO:
            return AUTO
        if self.kind in ("float", "auto_float"):
            try:
                value = float(raw)
            except ValueError:
                raise self._error(raw) from None
            if "_" in raw or not math.isfinite(value) or not self._in_bounds(value):
                raise self._error(raw)
            return value
        if self.kind == "enum":
            if raw not in self.choices:
                raise self._error(raw)
            return raw
        if self.kind == "int_list":
            return self._parse_int_list(raw)
        if self.kind == "path":
            if "\x00" in raw:
                raise self._error(raw, "contains a NUL byte")
            return Path(raw) if raw else None
        return raw

    def _parse_int_list(self, raw: str) -> tuple[int, ...]:
        if not raw.strip():
            return ()
        items = [item.strip() for item in raw.split(",")]
        for item in items:
            if not _INT_RE.fullmatch(item):
                raise self._error(raw, f"{item!r} is not an integer" if item else "empty item")
        values = [int(item) for item in items]
        out_of_bounds = [v for v in values if not self._in_bounds(v)]
        if out_of_bounds:
            raise self._error(raw, f"out of range: {', '.join(map(str, out_of_bounds))}")
        duplicates = sorted({v for v in values if values.count(v) > 1})
        if duplicates:
            raise self._error(raw, f"repeated: {', '.join(map(str, duplicates))}")
        return tuple(sorted(values))

    def format(self, value: SwitchValue) -> str:
        """The canonical string of a parsed value (what an arm file or the environment would hold)."""
        if self.kind == "bool":
            if not isinstance(value, bool):
                raise self._type_error(value, "a bool")
            return "1" if value else "0"
        if self.kind == "int":
            if not isinstance(value, int) or isinstance(value, bool):
                raise self._type_error(value, "an int")
            return str(value)
        if self.kind == "auto_float" and value == AUTO:
            return AUTO
        if self.kind in ("float", "auto_float"):
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise self._type_error(value, f"a float or {AUTO!r}" if self.kind == "auto_float" else "a float")
            return repr(float(value))
        if self.kind == "int_list":
            if not isinstance(value, tuple | list) or any(not isinstance(v, int) or isinstance(v, bool) for v in value):
                raise self._type_error(value, "a tuple of ints")
            return ",".join(str(v) for v in value)
        if self.kind == "path":
            if value is None:
                return ""
            if not isinstance(value, str | Path):
                raise self._type_error(value, "a Path, a str or None")
            return str(value)
        if not isinstance(value, str):
            raise self._type_error(value, "a str")
        return value

    def _type_error(self, value: object, expected: str) -> SwitchError:
        shown = SECRET_SET if self.secret else repr(value)
        return SwitchError(f"Unable to use {self.name}={shown}: expected {expected}, found {type(value).__name__}")

    def coerce(self, value: SwitchValue) -> SwitchValue:
        """Check a parsed value and return its canonical form (an int list comes back sorted, a str path as Path)."""
        return self.parse(self.format(value))

    def display(self, value: SwitchValue) -> str:
        """The canonical string with secrets redacted: `<set>` when set, empty when not."""
        text = self.format(value)
        if self.secret:
            return SECRET_SET if text else ""
        return text


def index_switches(switches: Iterable[Switch]) -> dict[str, Switch]:
    """Map name -> switch, refusing duplicate names or attribute names."""
    by_name: dict[str, Switch] = {}
    attrs: set[str] = set()
    for switch in switches:
        if switch.name in by_name or switch.attr in attrs:
            raise SwitchError(f"Switch {switch.name} is declared twice")
        by_name[switch.name] = switch
        attrs.add(switch.attr)
    return by_name


def closest_switch(name: str, known: Iterable[str]) -> str | None:
    """The known switch name most similar to `name`, or None when nothing is close."""
    matches = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return matches[0] if matches else None


def unknown_switch_hint(name: str, known: Iterable[str]) -> str:
    """What to say about a `K6_*` name no switch declares: the closest switch, as a question when it is close and as
    the nearest one otherwise (a list of every switch would bury the one that was meant)."""
    known = list(known)
    guess = closest_switch(name, known)
    if guess:
        return f"did you mean {guess}?"
    nearest = difflib.get_close_matches(name, known, n=1, cutoff=0.0)
    return (
        f"the nearest switch is {nearest[0]} (`k6fast switches` lists them all)" if nearest else "no switch is declared"
    )


def warn_unknown_switches(environ: Mapping[str, str], switches: Iterable[Switch], stacklevel: int = 2) -> list[str]:
    """Warn (UnknownSwitchWarning) about each `K6_*` variable no switch declares; returns their names."""
    known = [s.name for s in switches]
    unknown = sorted(key for key in environ if key.startswith("K6_") and key not in known)
    for key in unknown:
        # The value is never shown: the variable may be a mistyped secret.
        message = f"Unknown switch {key} is ignored; {unknown_switch_hint(key, known)}"
        warnings.warn(message, UnknownSwitchWarning, stacklevel=stacklevel + 1)
    return unknown
