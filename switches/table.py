"""The switch table: for a terminal (current values) and for README.md (defaults, kept in sync by a check)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from .catalog import SWITCHES
from .options import Options
from .registry import Switch, SwitchValue

README_MARKERS = ("<!-- switches:start -->", "<!-- switches:end -->")
_EMPTY = "(empty)"


def _shown(switch: Switch, value: SwitchValue, markdown: bool) -> str:
    text = switch.display(value)
    if not text:
        return _EMPTY
    # Code spans keep `<set>` from being read as an HTML tag and make whitespace in values visible.
    return f"`{text}`" if markdown else text


def _markdown(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    return "\n".join([line(headers), "|" + "|".join("---" for _ in headers) + "|", *map(line, rows)])


def _plain(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def render_table(options: Options, markdown: bool = False) -> str:
    """One row per switch: name, current value, default, lossy, doc. Secrets are redacted."""
    headers = ("Switch", "Value", "Default", "Lossy", "Description")
    rows = [
        (
            switch.name,
            _shown(switch, getattr(options, switch.attr), markdown),
            _shown(switch, switch.default, markdown),
            "yes" if switch.lossy else "no",
            switch.doc,
        )
        for switch in SWITCHES
    ]
    return _markdown(headers, rows) if markdown else _plain(headers, rows)


def readme_table() -> str:
    """The markdown table README.md carries between README_MARKERS.

    The README documents defaults, so a "current value" column would only repeat the default; it shows what
    each switch accepts instead.
    """
    headers = ("Switch", "Default", "Accepts", "Lossy", "Description")
    rows = [
        (switch.name, _shown(switch, switch.default, True), switch.accepts, "yes" if switch.lossy else "no", switch.doc)
        for switch in SWITCHES
    ]
    return _markdown(headers, rows)


def marked_span(text: str, markers: tuple[str, str], what: str) -> tuple[int, int] | str:
    """(start, end) of the text between one pair of marker lines, in order, or a message saying what is wrong
    (`what` names the block, e.g. "the switches table"). README.md's generated blocks are found with it."""
    start, end = markers
    expected = f"README.md must hold {what} between one {start} line and one {end} line"
    counts = (text.count(start), text.count(end))
    if counts != (1, 1):
        return f"{expected}; found {counts[0]} and {counts[1]}"
    begin, finish = text.index(start) + len(start), text.index(end)
    if finish < begin:
        return f"{expected} after it; found {end} before {start}"
    return begin, finish


def check_readme(readme_text: str) -> str | None:
    """None when README.md's switches block equals readme_table(); otherwise what is wrong."""
    span = marked_span(readme_text, README_MARKERS, "the switches table")
    if isinstance(span, str):
        return span
    found = readme_text[span[0] : span[1]].strip().splitlines()
    expected = readme_table().splitlines()
    if found == expected:
        return None
    pairs = itertools.zip_longest(found, expected, fillvalue="<end of table>")
    line, (have, want) = next((i, pair) for i, pair in enumerate(pairs, start=1) if pair[0] != pair[1])
    return (
        f"README.md's switches table is out of date; first difference on table line {line}: "
        f"found {have!r}, expected {want!r}. Regenerate the block with replace_readme_block()"
    )


def replace_readme_block(readme_text: str) -> str:
    """README text with the block between README_MARKERS replaced by the current readme_table()."""
    span = marked_span(readme_text, README_MARKERS, "the switches table")
    if isinstance(span, str):
        raise ValueError(span)
    return readme_text[: span[0]] + "\n" + readme_table() + "\n" + readme_text[span[1] :]
