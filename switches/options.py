"""Options: the switch values of one process, read once from the environment (and an arm) and then frozen.

`load_options` is the only place in k6fast that reads `os.environ`; everything below it receives an Options.
The attributes are generated from the catalog (one per switch, `K6_AUDIO_NORM` -> `options.audio_norm`), so a
switch cannot be declared without its attribute or the other way round.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .arms import read_arm, resolve_arm
from .catalog import SWITCHES, SWITCHES_BY_NAME
from .registry import SECRET_SET, SwitchError, SwitchValue, warn_unknown_switches

# Bumped if the hashed payload's layout ever changes, so old and new hashes cannot collide.
_HASH_VERSION = "k6fast-arm-hash-v1"
_ATTRS = {switch.attr: switch for switch in SWITCHES}


def _check_and_canonicalise(self: Any) -> None:
    # Runs for Options(...), replace() and load_options() alike, so no path can build an unchecked Options.
    errors = []
    for switch in SWITCHES:
        try:
            object.__setattr__(self, switch.attr, switch.coerce(getattr(self, switch.attr)))
        except SwitchError as exc:
            errors.append(str(exc))
    if not isinstance(self.arm_name, str) or not self.arm_name:
        errors.append(f"arm_name must be a non-empty str, found {self.arm_name!r}")
    if errors:
        raise SwitchError("\n".join(errors))


_OptionsFields = dataclasses.make_dataclass(
    "_OptionsFields",
    [(s.attr, s.python_type, dataclasses.field(default=s.default)) for s in SWITCHES]
    # Equality and hashing mean "same switch values"; where they came from does not matter.
    + [("arm_name", str, dataclasses.field(default="env", compare=False))],
    frozen=True,
    kw_only=True,
    repr=False,
    # The generated __init__ calls __post_init__ only if the class has one when it is generated.
    namespace={"__post_init__": _check_and_canonicalise},
)
_OptionsFields.__module__ = __name__


class Options(_OptionsFields):  # type: ignore[misc, valid-type]
    """Frozen switch values: one attribute per switch plus `arm_name` (the arm they came from, or "env").

    Construct with `load_options()`; `Options()` is the all-defaults reference and `options.replace(...)` makes
    a changed copy (values are checked and canonicalised either way, e.g. cache steps come back sorted).
    """

    def __repr__(self) -> str:
        # Only what differs from the reference, secrets redacted: the dataclass repr would print an API key.
        changed = ", ".join(
            f"{switch.attr}={SECRET_SET if switch.secret else repr(getattr(self, switch.attr))}"
            for switch in SWITCHES
            if getattr(self, switch.attr) != switch.default
        )
        return f"Options(arm_name={self.arm_name!r}{', ' if changed else ''}{changed})"

    def replace(self, **changes: Any) -> Options:
        """A copy with some attributes changed (by attribute name, e.g. `audio_norm="clip"`)."""
        unknown = sorted(set(changes) - _ATTRS.keys() - {"arm_name"})
        if unknown:
            raise TypeError(f"Options has no attribute {', '.join(unknown)}; expected one of {', '.join(_ATTRS)}")
        return dataclasses.replace(self, **changes)

    def value(self, name: str) -> SwitchValue:
        """The value of a switch by its `K6_*` name."""
        if name not in SWITCHES_BY_NAME:
            raise KeyError(f"Unknown switch {name!r}; expected one of {', '.join(SWITCHES_BY_NAME)}")
        return getattr(self, SWITCHES_BY_NAME[name].attr)

    def snapshot(self) -> dict[str, str]:
        """Every switch's canonical string, by `K6_*` name, secrets shown as "<set>" or ""."""
        return {switch.name: switch.display(getattr(self, switch.attr)) for switch in SWITCHES}

    def non_default(self) -> dict[str, str]:
        """Like snapshot(), restricted to switches whose value differs from the default."""
        return {
            switch.name: switch.display(getattr(self, switch.attr))
            for switch in SWITCHES
            if getattr(self, switch.attr) != switch.default
        }

    def lossy_attention_at(self, step: int, num_steps: int | None, block: int, num_blocks: int) -> bool:
        """Whether the K6_EXACT_ATTN_* policy lets a lossy attention (quantized or block-sparse) run in fused block
        `block` of `num_blocks` at denoising step `step` of `num_steps`: the first K6_EXACT_ATTN_STEPS steps, the last
        K6_EXACT_ATTN_LAST_STEPS (where the schedule's length is known; None: not) and the first and last
        K6_EXACT_ATTN_BLOCKS blocks stay exact."""
        if step < self.exact_attn_steps:
            return False
        if num_steps is not None and step >= num_steps - self.exact_attn_last_steps:
            return False
        return self.exact_attn_blocks <= block < num_blocks - self.exact_attn_blocks

    def arm_hash(self) -> str:
        """16 hex digits identifying the output-affecting configuration: equal hashes, equal pixels.

        Only output-affecting switches that differ from their default enter the hash. Defaults are the reference
        path by rule, so leaving them out keeps every existing hash (the reference arm's included) unchanged when
        a new switch is added to the catalog, and recorded results stay comparable across versions.
        """
        lines = [_HASH_VERSION]
        for switch in sorted(SWITCHES, key=lambda s: s.name):
            value = getattr(self, switch.attr)
            if switch.affects_output and value != switch.default:
                lines.append(f"{switch.name}={switch.format(value)}")
        return hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest()[:16]


_CLASHES = sorted((_ATTRS.keys() | {"arm_name"}) & {name for name in vars(Options) if not name.startswith("_")})
if _CLASHES:
    raise SwitchError(f"Switch attribute names clash with Options members: {', '.join(_CLASHES)}")


def load_options(environ: Mapping[str, str] | None = None, arm: str | Path | None = None) -> Options:
    """Defaults, then the arm file's values, then any `K6_*` variable set in `environ` (default: os.environ).

    Unknown `K6_*` variables warn (UnknownSwitchWarning); every invalid value is reported in one SwitchError.
    `arm_name` is the arm as given, with "+env" appended when the environment changes an output-affecting
    value the arm set, and "env" without an arm.
    """
    if environ is None:
        environ = os.environ
    warn_unknown_switches(environ, SWITCHES, stacklevel=2)
    values: dict[str, SwitchValue] = {}
    arm_name = "env"
    if arm is not None:
        for name, raw in read_arm(resolve_arm(arm)).items():
            values[name] = SWITCHES_BY_NAME[name].parse(raw)
        arm_name = str(arm)
    errors: list[str] = []
    overridden = False
    for switch in SWITCHES:
        if switch.name not in environ:
            continue
        try:
            value = switch.parse(environ[switch.name])
        except SwitchError as exc:
            errors.append(str(exc))
            continue
        if arm is not None and switch.affects_output and value != values.get(switch.name, switch.default):
            overridden = True
        values[switch.name] = value
    if errors:
        raise SwitchError("\n".join(errors))
    if overridden:
        arm_name += "+env"
    return Options(arm_name=arm_name, **{SWITCHES_BY_NAME[name].attr: value for name, value in values.items()})
