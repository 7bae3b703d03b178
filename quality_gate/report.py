"""The gate's report: `report.json` for machines, `report.md` (a table per arm, its checks, links to the contact
sheets and the per-frame plot) for people, both written atomically into the output directory.

Layout under the output directory: `report.json`, `report.md`, `sheets/<arm>/<prompt>-s<seed>.png`,
`plots/<arm>.png`, and the clip cache `clips/`. A run with the random LPIPS backbone checks the gate's plumbing only:
it gives no verdict (PLUMBING_VERDICT instead of PASS or FAIL) and says so at the top of every file it writes
(RANDOM_LABEL), so its numbers cannot be mistaken for a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..atomic import write_bytes_atomic, write_json_atomic
from .clips import Arm, Geometry, Prompt
from .lpips_metric import RANDOM_LABEL
from .scoring import ArmResult
from .thresholds import METRIC_NAMES, Thresholds

REPORT_JSON = "report.json"
REPORT_MD = "report.md"
# What a run with the random LPIPS backbone reports instead of PASS or FAIL: every stage ran, nothing was judged.
PLUMBING_VERDICT = "PLUMBING ONLY (random LPIPS backbone): no quality verdict"


def sheet_path(out: Path, arm_label: str, prompt_id: str, seed: int) -> Path:
    return out / "sheets" / arm_label / f"{prompt_id}-s{seed}.png"


def plot_path(out: Path, arm_label: str) -> Path:
    return out / "plots" / f"{arm_label}.png"


@dataclass
class GateRun:
    """Everything one gate run decided, in the form the report needs."""

    model: str
    variant: str
    geometry: Geometry
    seeds: list[int]
    prompts_file: str
    prompts: list[Prompt]
    reference: Arm
    device: str
    dtype: str
    commit: str
    lpips_label: str
    random_backbone: bool
    thresholds: Thresholds
    arms: list[ArmResult]
    floor: ArmResult | None = None
    clip_status: dict[str, str] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """Every arm within its limits. Meaningful only where `plumbing_only` is False."""
        return all(arm.passed for arm in self.arms)

    @property
    def plumbing_only(self) -> bool:
        """The LPIPS backbone was random: the run checked that every stage works and judged nothing."""
        return self.random_backbone

    @property
    def verdict(self) -> str:
        if self.plumbing_only:
            return PLUMBING_VERDICT
        return "PASS" if self.passed else "FAIL"

    @property
    def banner(self) -> str | None:
        return RANDOM_LABEL if self.random_backbone else None


def to_json(run: GateRun) -> dict[str, Any]:
    return {
        "verdict": run.verdict,
        "passed": None if run.plumbing_only else run.passed,
        "plumbing_only": run.plumbing_only,
        "warning": run.banner,
        "lpips_backbone": run.lpips_label,
        "random_backbone": run.random_backbone,
        "model": run.model,
        "variant": run.variant,
        "geometry": {
            "width": run.geometry.width,
            "height": run.geometry.height,
            "frames": run.geometry.frames,
            "steps": run.geometry.steps,
            "guidance": run.geometry.guidance,
        },
        "seeds": run.seeds,
        "prompts_file": run.prompts_file,
        "prompts": [p.id for p in run.prompts],
        "device": run.device,
        "dtype": run.dtype,
        "k6fast_commit": run.commit,
        "reference": {"arm": run.reference.spec, "arm_hash": run.reference.hash},
        "thresholds": {
            "rule": run.thresholds.describe(),
            **{m: getattr(run.thresholds, m) for m in METRIC_NAMES},
            "relative": run.thresholds.relative,
        },
        "floor": run.floor.as_dict() if run.floor else None,
        "arms": [arm.as_dict() for arm in run.arms],
        "clips": run.clip_status,
    }


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _clip_table(result: ArmResult) -> list[str]:
    lines = [
        _row(
            [
                "prompt",
                "seed",
                "LPIPS mean",
                "LPIPS worst (frame)",
                "log-mel dB",
                "log-mel worst 0.25 s dB (at)",
                "MR-STFT",
                "identical",
            ]
        ),
        _row(["---", "---:", "---:", "---:", "---:", "---:", "---:", ":---:"]),
    ]
    for c in result.clips:
        a = c.audio
        lines.append(
            _row(
                [
                    c.prompt_id,
                    str(c.seed),
                    f"{c.lpips_mean:.4f}",
                    f"{c.lpips_worst:.4f} ({c.worst_frame if c.lpips_worst > 0 else '—'})",
                    f"{a.log_mel_db:.2f}",
                    f"{a.log_mel_worst_db:.2f} ({a.log_mel_worst_at_s:.2f} s)",
                    f"{a.mrstft:.3f}",
                    "yes" if c.identical else "no",
                ]
            )
        )
    agg = result.aggregates
    at, audio_at = agg["lpips_worst_at"], agg["log_mel_worst_at"]
    lines.append(
        _row(
            [
                "**set**",
                "",
                f"**{agg['lpips_mean']:.4f}**",
                f"**{agg['lpips_worst']:.4f}** "
                + (f"({at['prompt']} s{at['seed']} f{at['frame']})" if agg["lpips_worst"] > 0 else "(—)"),
                f"**{agg['log_mel_db']:.2f}**",
                f"**{agg['log_mel_worst_db']:.2f}** "
                f"({audio_at['prompt']} s{audio_at['seed']} {audio_at['start_s']:.2f} s)",
                f"**{agg['mrstft']:.3f}**",
                f"{agg['identical_clips']}/{agg['clips']}",
            ]
        )
    )
    return lines


def _arm_verdict(run: GateRun, result: ArmResult) -> str:
    if result.floor:
        return "noise floor"
    if run.plumbing_only:
        return "no verdict"
    return "PASS" if result.passed else "**FAIL**"


def _arm_section(run: GateRun, result: ArmResult, out: Path) -> list[str]:
    verdict = _arm_verdict(run, result)
    switches = ", ".join(f"`{k}={v}`" for k, v in result.switches.items()) or "all switches at their defaults"
    lines = [f"## {result.label} [`{result.arm_hash}`]: {verdict}", ""]
    if result.floor:
        lines.append(
            f"The reference arm generated a second time (not read from the cache), scored against its first run. "
            f"Switches: {switches}."
        )
    else:
        lines.append(f"Arm `{result.spec}`; non-default switches: {switches}.")
        if result.lossy:
            lines.append(f"Lossy switches: {', '.join(f'`{s}`' for s in result.lossy)}.")
        if result.exact:
            lines.append("Must be exact: every decoded frame and audio sample equal to the reference's.")
        if result.shares_reference:
            lines.append(
                "Same arm hash as the reference: the switches that affect output are identical, so this arm reuses "
                "the reference's clips and scores zero by construction (`--floor` checks that a re-run reproduces)."
            )
    lines += ["", *_clip_table(result), ""]
    if result.checks:
        lines += [_row(["check", "value", "limit", "rule", "result"]), _row(["---", "---:", "---:", "---", ":---:"])]
        for check in result.checks:
            name = METRIC_NAMES.get(check.metric, "clips not bit-identical")
            lines.append(
                _row([name, f"{check.value:.4g}", f"{check.limit:.4g}", check.rule, "pass" if check.passed else "FAIL"])
            )
        lines.append("")
    sheets = [
        f"[{c.prompt_id} s{c.seed}]({sheet_path(out, result.label, c.prompt_id, c.seed).relative_to(out)})"
        for c in result.clips
    ]
    lines += [f"Contact sheets: {', '.join(sheets)}", ""]
    lines += [f"![LPIPS per frame, {result.label}]({plot_path(out, result.label).relative_to(out)})", ""]
    return lines


def to_markdown(run: GateRun, out: Path) -> str:
    lines = [f"# k6fast quality gate: {run.verdict}", ""]
    if run.banner:
        lines += [
            f"> **{run.banner}.** This run checks the gate's plumbing; its LPIPS numbers mean nothing, and the "
            "checks below are shown only to prove they run.",
            "",
        ]
    generated = sum(s.startswith("generated") for s in run.clip_status.values())
    lines += [
        _row(["run", ""]),
        _row(["---", "---"]),
        _row(["model", f"`{run.model}` ({run.variant})"]),
        _row(["geometry", run.geometry.describe()]),
        _row(["prompts", f"{len(run.prompts)} from `{run.prompts_file}`: {', '.join(p.id for p in run.prompts)}"]),
        _row(["seeds", ", ".join(map(str, run.seeds))]),
        _row(["device", f"{run.device}, {run.dtype}"]),
        _row(["k6fast commit", f"`{run.commit}`"]),
        _row(["reference", f"`{run.reference.spec}` [`{run.reference.hash}`]"]),
        _row(["LPIPS", run.lpips_label]),
        _row(["thresholds", run.thresholds.describe()]),
        _row(["clips", f"{generated} generated, {len(run.clip_status) - generated} reused from the cache"]),
        "",
    ]
    summary = [
        _row(["arm", "hash", "LPIPS mean", "LPIPS worst", "log-mel dB", "log-mel worst dB", "MR-STFT", "verdict"]),
        _row(["---", "---", "---:", "---:", "---:", "---:", "---:", ":---:"]),
    ]
    for result in ([run.floor] if run.floor else []) + run.arms:
        agg = result.aggregates
        if result.floor:
            verdict_cell = "floor"
        else:
            verdict_cell = "no verdict" if run.plumbing_only else ("pass" if result.passed else "**FAIL**")
        summary.append(
            _row(
                [
                    result.label,
                    f"`{result.arm_hash}`",
                    f"{agg['lpips_mean']:.4f}",
                    f"{agg['lpips_worst']:.4f}",
                    f"{agg['log_mel_db']:.2f}",
                    f"{agg['log_mel_worst_db']:.2f}",
                    f"{agg['mrstft']:.3f}",
                    verdict_cell,
                ]
            )
        )
    lines += summary + [""]
    if run.floor is None:
        lines += [
            "Noise floor: not measured (run with `--floor` to re-run the reference and score it against itself).",
            "",
        ]
    for result in ([run.floor] if run.floor else []) + run.arms:
        lines += _arm_section(run, result, out)
    return "\n".join(lines)


def write_report(run: GateRun, out: Path) -> tuple[Path, Path]:
    """Write report.json and report.md into `out`; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / REPORT_JSON, out / REPORT_MD
    write_json_atomic(json_path, to_json(run))
    write_bytes_atomic(md_path, to_markdown(run, out).encode("utf-8"))
    return json_path, md_path
