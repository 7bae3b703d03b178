"""One gate run: generate (or reuse) the reference's and each arm's clips, score them, write the report.

`run_gate(GateConfig(...))` is what `k6fast gate` (command.py) calls. The LPIPS backbone is loaded before anything
is generated, so missing weights cost seconds, not a night of GPU time.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

from ..checkpoint import open_checkpoint
from ..step_cache import fixed_cache_note
from ..switches import SWITCHES_BY_NAME, SwitchError, load_options
from . import GateError
from .clips import Arm, ClipCache, Geometry, Job, arm_label, check_arms_fit, load_arm, load_prompts, run_jobs
from .config import GateConfig, validate_config
from .figures import contact_sheet, lpips_plot
from .lpips_metric import LpipsScorer
from .report import GateRun, plot_path, sheet_path, write_report
from .scoring import ArmResult, ClipScore, judge, read_clip, score_clip

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _stderr(message: str) -> None:
    print(f"gate: {message}", file=sys.stderr, flush=True)


def _arm_result(arm: Arm, reference: Arm, clips: list[ClipScore], floor: bool = False) -> ArmResult:
    changed = arm.options.non_default()
    return ArmResult(
        label="floor" if floor else arm.label,
        spec=arm.spec,
        arm_hash=arm.hash,
        switches=changed,
        lossy=[name for name in changed if SWITCHES_BY_NAME[name].lossy],
        exact=arm.exact,
        shares_reference=arm.hash == reference.hash and not floor,
        clips=clips,
        floor=floor,
    )


def _note_ignored_environment(log: Callable[[str], None]) -> None:
    """Say so when the gate's own environment sets switches: arms are built from their files alone."""
    try:
        changed = load_options().non_default()
    except SwitchError as exc:
        log(f"note: the environment holds invalid K6_* values, ignored by the gate ({exc})")
        return
    if changed:
        shown = ", ".join(f"{name}={value}" for name, value in changed.items())
        log(f"note: {shown} set in the environment; ignored, each arm comes from its file alone")


def run_gate(config: GateConfig, log: Callable[[str], None] = _stderr, prepare: Callable | None = None) -> GateRun:
    """Generate what is missing, score every arm against the reference, write the report and figures. prepare: see
    `clips.run_jobs` (a command passes its entry point's `prepare_pipeline_process`)."""
    validate_config(config)
    _note_ignored_environment(log)
    prompts = load_prompts(config.prompts)
    taken: set[str] = {"floor"}
    reference = load_arm(config.reference, arm_label(config.reference, taken))
    arms = [load_arm(spec, arm_label(spec, taken)) for spec in config.arms]
    arms += [load_arm(spec, arm_label(spec, taken), exact=True) for spec in config.exact]
    ckpt = open_checkpoint(config.model)
    steps = config.steps if config.steps is not None else ckpt.default_steps
    if steps < 1:
        raise GateError(f"--steps must be >= 1, found {steps}")
    check_arms_fit([reference, *arms], steps, ckpt)
    for arm in (reference, *arms):
        if note := fixed_cache_note(ckpt, arm.options):
            log(f"arm {arm.spec}: {note}")
    geometry = Geometry(config.width, config.height, config.frames, steps, ckpt.default_guidance)
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[config.dtype] if config.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)

    scorer = LpipsScorer(config.backbone, device=device)
    log(scorer.label)
    out = Path(config.out)
    cache = ClipCache(out, config.model, device, dtype, geometry)
    pairs = [(prompt, seed) for prompt in prompts for seed in config.seeds]
    jobs = [Job(reference, p, s, cache.path(p, s, reference), fresh=config.regenerate) for p, s in pairs]
    if config.floor:
        jobs += [
            Job(reference, p, s, cache.path(p, s, reference, floor=True), fresh=True, note="floor") for p, s in pairs
        ]
    jobs += [Job(arm, p, s, cache.path(p, s, arm), fresh=config.regenerate) for arm in arms for p, s in pairs]
    status = run_jobs(jobs, cache, log, prepare)

    banner = scorer.label if scorer.random else None
    floor_clips: list[ClipScore] = []
    arm_clips: dict[str, list[ClipScore]] = {arm.label: [] for arm in arms}
    for prompt, seed in pairs:
        ref_path = cache.path(prompt, seed, reference)
        ref = read_clip(ref_path)
        if config.floor:
            floor_path = cache.path(prompt, seed, reference, floor=True)
            rerun = read_clip(floor_path)
            clip = score_clip(scorer, ref, rerun, prompt.id, seed)
            clip.reference, clip.test = ref_path, floor_path
            floor_clips.append(clip)
            # The floor gets pictures too: a re-run that moves (a recompiled kernel, a nondeterministic reduction)
            # shows where it moved, which is what one needs to judge the arms against it.
            contact_sheet(
                ref[0], rerun[0], clip, "floor", reference.label, sheet_path(out, "floor", prompt.id, seed), banner
            )
        for arm in arms:
            test_path = cache.path(prompt, seed, arm)
            test = read_clip(test_path)
            clip = score_clip(scorer, ref, test, prompt.id, seed)
            clip.reference, clip.test = ref_path, test_path
            arm_clips[arm.label].append(clip)
            contact_sheet(
                ref[0], test[0], clip, arm.label, reference.label, sheet_path(out, arm.label, prompt.id, seed), banner
            )
        log(f"scored     {prompt.id} s{seed}")

    floor = _arm_result(reference, reference, floor_clips, floor=True) if config.floor else None
    floor_agg = floor.aggregates if floor else None
    if floor is not None:
        lpips_plot(floor, plot_path(out, "floor"), banner=banner)
    results = []
    for arm in arms:
        result = _arm_result(arm, reference, arm_clips[arm.label])
        result.checks = judge(result, config.thresholds, floor_agg)
        worst_limit = next(c.limit for c in result.checks if c.metric == "lpips_worst")
        lpips_plot(result, plot_path(out, arm.label), floor=floor, worst_limit=worst_limit, banner=banner)
        results.append(result)
    run = GateRun(
        model=config.model,
        variant=ckpt.variant,
        geometry=geometry,
        seeds=list(config.seeds),
        prompts_file=str(config.prompts),
        prompts=prompts,
        reference=reference,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        commit=cache.commit,
        lpips_label=scorer.label,
        random_backbone=scorer.random,
        thresholds=config.thresholds,
        arms=results,
        floor=floor,
        clip_status={str(path.relative_to(out)): text for path, text in status.items()},
    )
    write_report(run, out)
    return run
