"""The gate's pictures: a contact sheet per clip (reference, arm and their difference at a few frames and at the
worst frame) and, per arm, a plot of LPIPS per frame for every prompt with the noise floor and the limit.

matplotlib is used through `Figure` + the Agg canvas directly, never pyplot: pyplot would pick a global backend
and keep figures alive in a process-wide registry, which a library must not do.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .report import write_bytes_atomic
from .scoring import ArmResult, ClipScore

SAMPLED_FRAMES = 4
DIFF_GAIN = 4.0  # |difference| x 4: a 16/255 error shows as a quarter of the colour scale
_WORST = "#d62728"
_TILE_INCHES = 2.4


def sample_frames(count: int, worst: int | None, samples: int = SAMPLED_FRAMES) -> list[int]:
    """Evenly spaced frame indices (first and last included), then the worst frame (if any) as the final column."""
    picked = sorted({int(round(i)) for i in np.linspace(0, count - 1, min(samples, count))})
    return picked if worst is None else [*picked, worst]


def _save(fig: Figure, path: Path) -> None:
    buffer = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buffer)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(path, buffer.getvalue())


def contact_sheet(
    reference: np.ndarray,
    test: np.ndarray,
    clip: ClipScore,
    arm_label: str,
    reference_label: str,
    path: Path,
    banner: str | None = None,
) -> list[int]:
    """Write a PNG: rows reference / arm / |difference| x DIFF_GAIN, columns sampled frames and the worst frame
    (outlined and titled in red). reference, test: uint8 [F, H, W, 3]. Returns the frame index of each column."""
    # A bit-identical clip has no worst frame: every frame scores exactly zero.
    worst = clip.worst_frame if clip.lpips_worst > 0 else None
    columns = sample_frames(reference.shape[0], worst)
    height, width = reference.shape[1:3]
    tile_h = _TILE_INCHES * height / width
    fig = Figure(figsize=(_TILE_INCHES * len(columns) + 0.6, tile_h * 3 + 1.3), dpi=100)
    axes = fig.subplots(3, len(columns), squeeze=False)
    rows = (reference_label, arm_label, f"|diff| x{DIFF_GAIN:g}")
    for col, frame in enumerate(columns):
        is_worst = worst is not None and col == len(columns) - 1
        diff = np.abs(reference[frame].astype(np.float32) - test[frame].astype(np.float32)).mean(axis=2)
        images = (reference[frame], test[frame], np.clip(diff / 255.0 * DIFF_GAIN, 0.0, 1.0))
        for row, image in enumerate(images):
            ax = axes[row, col]
            if row < 2:
                ax.imshow(image, interpolation="nearest")
            else:
                ax.imshow(image, cmap="magma", vmin=0.0, vmax=1.0, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if col == 0:
                ax.set_ylabel(rows[row], fontsize=9)
            for spine in ax.spines.values():
                spine.set_color(_WORST if is_worst else "#888888")
                spine.set_linewidth(3.0 if is_worst else 0.5)
        title = f"frame {frame}\nLPIPS {clip.lpips[frame]:.4f}"
        if is_worst:
            title = f"WORST frame {frame}\nLPIPS {clip.lpips[frame]:.4f}"
        axes[0, col].set_title(title, fontsize=9, color=_WORST if is_worst else "black")
    heading = f"{clip.prompt_id} · seed {clip.seed} · {arm_label} vs {reference_label}\n"
    if clip.identical:
        heading += "bit-identical: every decoded frame and audio sample equal (LPIPS 0 on every frame)"
    else:
        heading += (
            f"LPIPS mean {clip.lpips_mean:.4f}, worst {clip.lpips_worst:.4f} (frame {clip.worst_frame}); "
            f"log-mel {clip.audio.log_mel_db:.2f} dB, MR-STFT {clip.audio.mrstft:.3f}"
        )
    fig.suptitle(heading, fontsize=10)
    if banner:
        fig.text(0.5, 0.005, banner, ha="center", va="bottom", color=_WORST, fontsize=10, fontweight="bold")
    fig.tight_layout(rect=(0.0, 0.04 if banner else 0.0, 1.0, 1.0))
    _save(fig, path)
    return columns


def lpips_plot(
    result: ArmResult,
    path: Path,
    floor: ArmResult | None = None,
    worst_limit: float | None = None,
    banner: str | None = None,
) -> None:
    """Write a PNG with one panel per clip: the arm's LPIPS per frame, the noise floor's (dashed), the worst-frame
    limit (dotted) and the worst frame marked."""
    clips = result.clips
    cols = min(3, len(clips))
    rows = math.ceil(len(clips) / cols)
    fig = Figure(figsize=(4.2 * cols, 2.8 * rows + 0.9), dpi=100)
    axes = fig.subplots(rows, cols, squeeze=False, sharey=True)
    floors = {(c.prompt_id, c.seed): c for c in floor.clips} if floor else {}
    top = max([c.lpips_worst for c in clips] + [c.lpips_worst for c in floors.values()])
    # A limit far above the data would flatten every curve onto the axis: draw it only when the data come within
    # a quarter of it, and otherwise say in the title that it is off the scale.
    show_limit = worst_limit is not None and top >= 0.25 * worst_limit
    if show_limit:
        top = max(top, worst_limit)
    for ax, clip in zip(axes.flat, clips, strict=False):
        frames = np.arange(len(clip.lpips))
        ax.plot(frames, clip.lpips, color="#1f77b4", lw=1.5, label=result.label)
        ax.axhline(clip.lpips_mean, color="#1f77b4", lw=0.8, ls="--", alpha=0.6, label="mean")
        match = floors.get((clip.prompt_id, clip.seed))
        if match is not None:
            ax.plot(frames, match.lpips, color="#7f7f7f", lw=1.2, ls="--", label="noise floor")
        if show_limit:
            ax.axhline(worst_limit, color=_WORST, lw=1.0, ls=":", label=f"worst limit {worst_limit:.3g}")
        ax.set_xlabel("frame", fontsize=8)
        ax.set_ylim(0.0, max(top * 1.25, 1e-3))
        ax.set_xlim(-0.5, len(clip.lpips) - 0.5)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if clip.lpips_worst == 0:
            ax.set_title(f"{clip.prompt_id} s{clip.seed}: LPIPS 0 on every frame", fontsize=9)
            continue
        ax.set_title(f"{clip.prompt_id} s{clip.seed}: mean {clip.lpips_mean:.4f}", fontsize=9)
        ax.plot([clip.worst_frame], [clip.lpips_worst], "o", color=_WORST, ms=6, clip_on=False)
        # Keep the label inside the panel when the worst frame is near either end.
        position = clip.worst_frame / max(1, len(clip.lpips) - 1)
        align = "right" if position > 0.8 else "left" if position < 0.2 else "center"
        ax.annotate(
            f"worst {clip.lpips_worst:.4f} @ {clip.worst_frame}",
            (clip.worst_frame, clip.lpips_worst),
            textcoords="offset points",
            xytext=(0, 6),
            ha=align,
            fontsize=7,
            color=_WORST,
        )
    for ax in axes.flat[len(clips) :]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel("LPIPS", fontsize=8)
    axes.flat[0].legend(fontsize=7, loc="upper left")
    title = f"LPIPS per frame: {result.label} [{result.arm_hash}] vs reference"
    if result.floor:
        title = f"LPIPS per frame: the reference [{result.arm_hash}] re-run against its first run (noise floor)"
    if worst_limit is not None and not show_limit:
        title += f"\n(the worst-frame limit {worst_limit:.3g} is far above every frame and not drawn)"
    fig.suptitle(title, fontsize=11)
    if banner:
        fig.text(0.5, 0.005, banner, ha="center", va="bottom", color=_WORST, fontsize=10, fontweight="bold")
    fig.tight_layout(rect=(0.0, 0.04 if banner else 0.0, 1.0, 1.0))
    _save(fig, path)
