"""The lossy knobs `k6fast tune` searches, built from the switch registry for one checkpoint and schedule.

Every knob sets declared `K6_*` switches only, and each level is checked against the registry when the space is
built. Levels run from the base arm's setting (off) to the most lossy one searched:

Level 0 of every knob is the reference (off) value, so the base arm must leave these switches off.

- `gemm`: K6_GEMM=auto-lossy (8-bit GEMMs: MXFP8 on Blackwell, FP8 from sm_89; the outlier columns at their default).
- `quant_attn`: k6fast's quantized attention (K6_ATTN=k6) on video self-attention, both self-attentions, all sites.
- `sparse`: block-sparse video self-attention, K6_SPARSE_ATTN from dense down to DENSITIES' last.
- `exact_blocks`, `exact_first_steps`, `exact_last_steps`: where lossy attention does not run (K6_EXACT_ATTN_BLOCKS,
  K6_EXACT_ATTN_STEPS, K6_EXACT_ATTN_LAST_STEPS), from more protection to less; at least the first and the last step
  always stay dense. They matter only with `quant_attn` or `sparse` on.
- `cache`: cached steps. Distilled checkpoints: K6_PIFLOW_CACHE_STEPS (the step two before the end, then also the
  middle one; the steps `final` and `fast` cache on a 10-step schedule). Base checkpoints: MagCache
  (K6_STEP_CACHE=magcache at STEP_CACHE_THRESHOLDS), which needs the checkpoint's calibration first
  (K6_STEP_CACHE=calibrate).

A knob the checkpoint leaves no room for (no block outside the protected ones, a schedule too short to cache) is left
out, and the space says so. New switches join by adding a knob here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..switches import SWITCHES_BY_NAME, SwitchError
from .search import Knob, Space, TuneError

DENSITIES = (0.5, 0.375, 0.25)
QUANT_SITES = ("video_self", "self", "all")
EXACT_BLOCKS = (6, 4, 2, 1)
# MagCache's published threshold (also Kandinsky 5's) between half and twice it.
STEP_CACHE_THRESHOLDS = (0.06, 0.12, 0.24)
KNOBS = ("gemm", "quant_attn", "sparse", "exact_blocks", "exact_first_steps", "exact_last_steps", "cache")
ATTENTION_KNOBS = ("quant_attn", "sparse")


def _checked(values: dict[str, str], knob: str) -> dict[str, str]:
    for name, raw in values.items():
        switch = SWITCHES_BY_NAME.get(name)
        if switch is None:
            raise TuneError(f"knob {knob}: switch {name} is not declared in the registry")
        try:
            switch.parse(raw)
        except SwitchError as exc:
            raise TuneError(f"knob {knob}: {exc}") from None
    return values


def _knob(name: str, levels: Sequence[tuple[str, dict[str, str]]], needs: tuple[str, ...] = ()) -> Knob:
    return Knob(
        name=name,
        levels=tuple(_checked(values, name) for _, values in levels),
        labels=tuple(label for label, _ in levels),
        needs=needs,
    )


def _step_levels(steps: int) -> list[int]:
    """Dense steps at one end of the schedule, most protection first: a fifth, a tenth, then one step."""
    return sorted({max(1, math.ceil(steps / 5)), max(1, math.ceil(steps / 10)), 1}, reverse=True)


def _cache_levels(steps: int, distilled: bool) -> list[tuple[str, dict[str, str]]]:
    if not distilled:
        # K6_PIFLOW_CACHE_STEPS stays empty at every level: a base checkpoint does not apply it (`fixed_cache_steps`),
        # and the speed model would count its steps as skipped.
        off = {"K6_PIFLOW_CACHE_STEPS": "", "K6_STEP_CACHE": "off"}
        magcache = [
            (f"magcache-{t:g}", {**off, "K6_STEP_CACHE": "magcache", "K6_STEP_CACHE_THRESHOLD": str(t)})
            for t in STEP_CACHE_THRESHOLDS
        ]
        return [("off", off), *magcache]
    off = [("off", {"K6_PIFLOW_CACHE_STEPS": ""})]
    # Step 0 has no prediction to reuse and the last step sets the final detail: cache inside (0, steps - 1).
    late, middle = steps - 2, steps // 2
    sets: list[tuple[int, ...]] = []
    for chosen in ((late,), (middle, late)):
        steps_set = tuple(sorted({s for s in chosen if 0 < s < steps - 1}))
        if steps_set and steps_set not in sets:
            sets.append(steps_set)
    return off + [("steps-" + "-".join(map(str, s)), {"K6_PIFLOW_CACHE_STEPS": ",".join(map(str, s))}) for s in sets]


def build_space(
    base: dict[str, str], *, steps: int, num_blocks: int, distilled: bool, knobs: Sequence[str] = KNOBS
) -> tuple[Space, list[str]]:
    """The space over `base` (the base arm's raw switch values) for a `steps`-step schedule of a `num_blocks`-block
    DiT; `knobs` picks which of KNOBS to search. Returns the space and notes on knobs left out and why."""
    unknown = [k for k in knobs if k not in KNOBS]
    if unknown or not knobs:
        raise TuneError(f"--knobs: expected a comma-separated subset of {', '.join(KNOBS)}, found {list(knobs)}")
    notes: list[str] = []
    blocks = [n for n in EXACT_BLOCKS if 2 * n < num_blocks]
    wanted = set(knobs)
    if not blocks and wanted & set(ATTENTION_KNOBS):
        notes.append(f"quant_attn, sparse: a {num_blocks}-block DiT leaves no block outside the first and last one")
        wanted -= set(ATTENTION_KNOBS)
    if steps < 3 and wanted & set(ATTENTION_KNOBS):
        notes.append(f"quant_attn, sparse: a {steps}-step schedule leaves no step between a dense first and last one")
        wanted -= set(ATTENTION_KNOBS)
    attention_on = tuple(k for k in ATTENTION_KNOBS if k in wanted)
    out: list[Knob] = []
    if "gemm" in wanted:
        out.append(_knob("gemm", [("bf16", {"K6_GEMM": "bf16"}), ("8bit", {"K6_GEMM": "auto-lossy"})]))
    if "quant_attn" in wanted:
        levels = [("exact", {"K6_ATTN": "exact", "K6_QUANT_ATTN_SITES": "video_self"})]
        levels += [(f"k6-{site}", {"K6_ATTN": "k6", "K6_QUANT_ATTN_SITES": site}) for site in QUANT_SITES]
        out.append(_knob("quant_attn", levels))
    if "sparse" in wanted:
        levels = [("dense", {"K6_SPARSE_ATTN": "0.0"})] + [(f"{d:g}", {"K6_SPARSE_ATTN": str(d)}) for d in DENSITIES]
        out.append(_knob("sparse", levels))
    policy = {
        "exact_blocks": ("K6_EXACT_ATTN_BLOCKS", blocks),
        "exact_first_steps": ("K6_EXACT_ATTN_STEPS", _step_levels(steps)),
        "exact_last_steps": ("K6_EXACT_ATTN_LAST_STEPS", _step_levels(steps)),
    }
    fixed: dict[str, str] = {}
    for name, (switch, values) in policy.items():
        if not attention_on:
            continue
        if name not in wanted or len(values) < 2:
            # Not searched: the most protective level, so the first and last steps stay dense whatever is searched.
            fixed[switch] = str(values[0])
            continue
        out.append(_knob(name, [(str(v), {switch: str(v)}) for v in values], needs=attention_on))
    if "cache" in wanted:
        levels = _cache_levels(steps, distilled)
        if len(levels) > 1:
            out.append(_knob("cache", levels))
        else:
            notes.append(f"cache: a {steps}-step schedule has no step to cache between the first and the last")
    if not out:
        raise TuneError("nothing to search: " + ("; ".join(notes) or "no knob chosen"))
    _check_base(base, out)
    return Space(tuple(out), base=_checked({**base, **fixed}, "base")), notes


def _check_base(base: dict[str, str], knobs: list[Knob]) -> None:
    """A base arm must leave the searched lossy switches at their reference values: level 0 of every knob is off, and
    a lossy base would put the lattice's bottom above its off level."""
    owned = {name for knob in knobs for level in knob.levels for name in level}
    for name in sorted(owned & base.keys()):
        switch = SWITCHES_BY_NAME[name]
        if switch.lossy and switch.parse(base[name]) != switch.default:
            raise TuneError(
                f"--base-arm sets {name}={base[name]}, a lossy switch tune searches; expected a base arm whose "
                f"searched lossy switches are off (e.g. `reference`, or your own .env without {name})"
            )
