"""Writing a result: the MP4 (with what made it in its metadata) and a sidecar JSON, both atomically."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from .atomic import write_json_atomic
from .cancel import StopCheck
from .media import prepare_audio, write_mp4
from .pipeline import Request, Result
from .switches import Options, provenance


def frames_to_uint8(frames: np.ndarray) -> np.ndarray:
    """float [F, H, W, 3] in [0, 1] → uint8, rounded."""
    return np.clip(np.rint(frames * 255.0), 0, 255).astype(np.uint8)


def mp4_metadata(options: Options) -> dict[str, str]:
    """What made the clip, stored in the MP4. The arm's *name* stays in the sidecar: two runs with the same
    switches (e.g. `--arm reference` and every switch explicitly off) must write identical files."""
    prov = provenance(options)
    return {
        "k6fast_version": str(prov["k6fast_version"]),
        "k6fast_commit": str(prov["git_commit"]),
        "k6fast_arm_hash": str(prov["arm_hash"]),
        "k6fast_switches": json.dumps(prov["switches"], sort_keys=True),
    }


def sidecar_path(out: Path) -> Path:
    return out.with_name(out.name + ".json")


def write_result(
    result: Result,
    out: Path,
    options: Options,
    request: Request,
    model: str,
    variant: str,
    should_stop: StopCheck | None = None,
    *,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write `out` (MP4) and `out.json` (provenance, request, telemetry, and `extra`: what the caller knows of the
    run, such as the load time and the residency plan). Returns the sidecar's content.
    `should_stop`: checked between the MP4's frames (`write_mp4`); a stop leaves neither file behind."""
    out = Path(out)
    audio = None if result.audio is None else prepare_audio(result.audio, options.audio_norm)
    with result.telemetry.phase("mux"):
        write_mp4(
            out,
            frames_to_uint8(result.frames),
            result.fps,
            audio,
            result.sample_rate,
            mp4_metadata(options),
            should_stop=should_stop,
        )
    record = {
        "provenance": provenance(options),
        "model": model,
        "variant": variant,
        "request": {
            "prompt": request.prompt,
            "negative_prompt": request.negative_prompt,
            "width": request.width,
            "height": request.height,
            "frames": request.frames,
            "fps": request.fps,
            "steps": result.steps,
            "guidance": result.guidance,
            "seed": request.seed,
            "audio": request.audio,
            "image": request.image is not None,
        },
        "telemetry": result.telemetry.as_dict(),
        **(extra or {}),
    }
    write_json_atomic(sidecar_path(out), record)
    return record
