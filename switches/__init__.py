"""k6fast switches: the typed `K6_*` registry, frozen Options, arms and provenance.

Only this package reads the environment (`load_options`); the rest of k6fast receives an `Options`.
"""

from .arms import list_arms, read_arm, resolve_arm
from .catalog import PIFLOW_CACHE_STEPS, SWITCHES, SWITCHES_BY_NAME, validate_cache_steps
from .options import Options, load_options
from .provenance import provenance
from .registry import Switch, SwitchError, UnknownSwitchWarning
from .table import README_MARKERS, check_readme, readme_table, render_table, replace_readme_block

__all__ = [
    "PIFLOW_CACHE_STEPS",
    "README_MARKERS",
    "SWITCHES",
    "SWITCHES_BY_NAME",
    "Options",
    "Switch",
    "SwitchError",
    "UnknownSwitchWarning",
    "check_readme",
    "list_arms",
    "load_options",
    "provenance",
    "read_arm",
    "readme_table",
    "render_table",
    "replace_readme_block",
    "resolve_arm",
    "validate_cache_steps",
]
