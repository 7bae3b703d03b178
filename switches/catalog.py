"""Every k6fast switch, declared once.

Rules for adding one: a switch lands together with the code it controls; its default is the BF16 reference
(off, empty, or the reference choice), so an empty environment runs the reference path; `lossy=True` when it
trades accuracy for speed; `affects_output=False` only when it cannot change a single output sample.
"""

from __future__ import annotations

from .registry import Switch, SwitchError, index_switches

PIFLOW_CACHE_STEPS = Switch(
    name="K6_PIFLOW_CACHE_STEPS",
    kind="int_list",
    default=(),
    doc="denoising steps whose DiT call is skipped, reusing the previous step's prediction",
    lossy=True,
    min=0,
)
AUDIO_NORM = Switch(
    name="K6_AUDIO_NORM",
    kind="enum",
    default="peak",
    choices=("peak", "clip"),
    doc="how the decoded waveform is brought into [-1, 1]: peak-normalise or clip",
)
API_KEY = Switch(
    name="K6_API_KEY",
    kind="str",
    default="",
    doc="bearer token the server requires; empty = no authentication",
    secret=True,
    affects_output=False,
)
DATA_DIR = Switch(
    name="K6_DATA_DIR",
    kind="path",
    default="",
    doc="where `k6fast serve` keeps jobs and videos (empty = ./k6fast-data)",
    affects_output=False,
)

VRAM_BUDGET_GB = Switch(
    name="K6_VRAM_BUDGET_GB",
    kind="float",
    default=0.0,
    doc="GPU memory k6fast may use, in GiB (enforced on bigger cards); 0 = the whole card",
    min=0.0,
    affects_output=False,
)
PREFETCH_BLOCKS = Switch(
    name="K6_PREFETCH_BLOCKS",
    kind="int",
    default=1,
    doc="how many streamed DiT blocks are copied ahead of the one computing",
    min=1,
    max=8,
    affects_output=False,
)
MAX_RESIDENT_BLOCKS = Switch(
    name="K6_MAX_RESIDENT_BLOCKS",
    kind="int",
    default=-1,
    doc="cap on fused blocks kept resident (-1 = as many as the budget holds); lets a shallow model stream",
    min=-1,
    affects_output=False,
)
LPIPS_BACKBONE = Switch(
    name="K6_LPIPS_BACKBONE",
    kind="path",
    default="",
    doc="AlexNet weights for the quality gate's LPIPS (empty = the torch hub cache)",
    affects_output=False,
)

SWITCHES: tuple[Switch, ...] = (
    PIFLOW_CACHE_STEPS,
    AUDIO_NORM,
    VRAM_BUDGET_GB,
    PREFETCH_BLOCKS,
    MAX_RESIDENT_BLOCKS,
    API_KEY,
    DATA_DIR,
    LPIPS_BACKBONE,
)
SWITCHES_BY_NAME: dict[str, Switch] = index_switches(SWITCHES)


def validate_cache_steps(steps: tuple[int, ...], num_steps: int) -> None:
    """Check K6_PIFLOW_CACHE_STEPS against a `num_steps`-step schedule; raises SwitchError when it does not fit.

    Step 0 has no previous prediction to reuse, so the cacheable steps are 1..num_steps-1.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, found {num_steps}")
    problems: list[str] = []
    if 0 in steps:
        problems.append("step 0 cannot be cached (it has no previous prediction)")
    outside = sorted({s for s in steps if s < 0 or s >= num_steps})
    if outside:
        noun = "step" if len(outside) == 1 else "steps"
        problems.append(f"{noun} {', '.join(map(str, outside))} outside the schedule")
    repeated = sorted({s for s in steps if steps.count(s) > 1})
    if repeated:
        problems.append(f"repeated: {', '.join(map(str, repeated))}")
    if not problems:
        return
    if num_steps == 1:
        valid = "no step can be cached in a 1-step schedule"
    elif num_steps == 2:
        valid = "the only valid step is 1 for a 2-step schedule"
    else:
        valid = f"valid steps are 1..{num_steps - 1} for a {num_steps}-step schedule"
    shown = ",".join(map(str, steps))
    raise SwitchError(f"{PIFLOW_CACHE_STEPS.name}={shown}: {'; '.join(problems)}; {valid}")
