"""What the gate generates and where it keeps it: the prompt set, the arms, and a cache of clips on disk.

A clip is written by `output.generate_to_mp4` (MP4 encoded beside the decode + sidecar JSON, both atomic) to
`<out>/clips/<prompt id>/s<seed>-<arm hash>-<key>.mp4`. The key hashes everything that decides the clip's bytes:
the checkpoint (resolved path; a Hub snapshot path names its revision), the prompt text, seed, geometry, steps,
guidance, the arm hash, the k6fast commit plus a digest of the runtime's source files (so a dirty tree does not
reuse clips made by other code), the device type and dtype, and the torch and diffusers versions. A clip whose MP4
and sidecar both exist is reused; the sidecar is written last, so its presence means the clip is complete.

Arms are read from their file alone (`load_options(environ={}, arm=...)`): a `K6_*` variable in the gate's own
environment must not leak into every arm, or the gate would compare the environment with itself.
"""

from __future__ import annotations

import gc
import hashlib
import importlib.util
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint import Checkpoint, open_checkpoint
from ..step_cache import fixed_cache_steps
from ..switches import Options, load_options, provenance, validate_cache_steps
from . import GateError

_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# The runtime's packages: their source decides the pixels. The gate itself (k6fast.quality_gate) does not.
_RUNTIME_PACKAGES = ("k6fast", "k6fast.kernels", "k6fast.switches")


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str


@dataclass(frozen=True)
class Arm:
    """One configuration under test. `spec`: the arm as given (a name or an .env path); `label`: a short name unique
    within the run, safe in file names; `exact`: the arm must reproduce the reference bit for bit."""

    spec: str
    label: str
    options: Options
    exact: bool = False

    @property
    def hash(self) -> str:
        return self.options.arm_hash()


@dataclass(frozen=True)
class Geometry:
    width: int
    height: int
    frames: int
    steps: int
    guidance: float

    def describe(self) -> str:
        return f"{self.width}x{self.height}, {self.frames} frames, {self.steps} steps, guidance {self.guidance:g}"


def load_prompts(path: str | Path) -> list[Prompt]:
    """Read a prompt set: a JSON object whose "prompts" list holds objects with a unique "id" and a "text"."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GateError(f"prompt set {path}: expected a readable JSON file, {exc}") from exc
    items = data.get("prompts") if isinstance(data, dict) else None
    if not isinstance(items, list) or not items:
        raise GateError(f'prompt set {path}: expected an object with a non-empty "prompts" list, found none')
    prompts: list[Prompt] = []
    for i, item in enumerate(items):
        pid = item.get("id") if isinstance(item, dict) else None
        text = item.get("text") if isinstance(item, dict) else None
        if not isinstance(pid, str) or not _ID_RE.fullmatch(pid):
            raise GateError(
                f"prompt set {path}: prompt {i} needs an id of letters, digits, '.', '_', '-'; found {pid!r}"
            )
        if not isinstance(text, str) or not text.strip():
            raise GateError(f"prompt set {path}: prompt {pid!r} needs a non-empty text, found {text!r}")
        if any(p.id == pid for p in prompts):
            raise GateError(f"prompt set {path}: prompt id {pid!r} appears twice; ids name the clip files")
        prompts.append(Prompt(pid, text))
    return prompts


def load_arm(spec: str, label: str, exact: bool = False) -> Arm:
    """An arm from its file alone: the environment of the gate process is deliberately not consulted."""
    return Arm(spec=spec, label=label, options=load_options(environ={}, arm=spec), exact=exact)


def arm_label(spec: str, taken: set[str]) -> str:
    """A file-name-safe label for an arm spec (`switches/arms/x.env` → `x`), made unique against `taken`."""
    stem = Path(spec).name.removesuffix(".env") if spec.endswith(".env") or "/" in spec else spec
    base = re.sub(r"[^A-Za-z0-9._-]+", "_", stem).strip("._") or "arm"
    label, n = base, 2
    while label in taken:
        label, n = f"{base}-{n}", n + 1
    taken.add(label)
    return label


def check_arms_fit(arms: list[Arm], steps: int, ckpt: Checkpoint) -> None:
    """Fail before any generation if an arm cannot run at this step count on `ckpt` (e.g. a cached step past the
    end)."""
    for arm in arms:
        try:
            validate_cache_steps(fixed_cache_steps(ckpt, arm.options), steps)
        except ValueError as exc:
            raise GateError(f"arm {arm.spec}: {exc}") from exc


def source_digest() -> str:
    """SHA-256 (16 hex) over the runtime's .py files, by relative path and content."""
    digest = hashlib.sha256()
    for package in _RUNTIME_PACKAGES:
        spec = importlib.util.find_spec(package)
        roots = list(spec.submodule_search_locations or []) if spec else []
        if not roots:
            raise GateError(f"cannot locate the {package} package to fingerprint its source")
        for root in roots:
            for file in sorted(Path(root).rglob("*.py")):
                digest.update(f"{package}/{file.relative_to(root)}\n".encode())
                digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


class ClipCache:
    """Paths and keys of generated clips under `<root>/clips`, for one checkpoint, device and dtype."""

    def __init__(self, root: Path, model: str, device: torch.device, dtype: torch.dtype, geometry: Geometry):
        import diffusers

        self.root = Path(root) / "clips"
        self.model = model
        self.device, self.dtype, self.geometry = device, dtype, geometry
        self.model_root = str(open_checkpoint(model).root)
        self.commit = str(provenance(Options())["git_commit"])
        self._base = {
            "model": self.model_root,
            "width": geometry.width,
            "height": geometry.height,
            "frames": geometry.frames,
            "steps": geometry.steps,
            "guidance": geometry.guidance,
            "audio": True,
            "k6fast_commit": self.commit,
            "k6fast_source": source_digest(),
            "device": device.type,
            "dtype": str(dtype).removeprefix("torch."),
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
        }

    def key(self, prompt: Prompt, seed: int, arm: Arm) -> str:
        payload = dict(self._base, prompt=prompt.text, seed=seed, arm_hash=arm.hash)
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()[:16]

    def path(self, prompt: Prompt, seed: int, arm: Arm, floor: bool = False) -> Path:
        name = f"s{seed}-{arm.hash}-{self.key(prompt, seed, arm)}{'-floor' if floor else ''}.mp4"
        return self.root / prompt.id / name

    @staticmethod
    def complete(path: Path) -> bool:
        return path.is_file() and path.with_name(path.name + ".json").is_file()


@dataclass(frozen=True)
class Job:
    """One clip to have on disk: generate it unless it is cached (a `fresh` job is always generated)."""

    arm: Arm
    prompt: Prompt
    seed: int
    path: Path
    fresh: bool = False
    note: str = ""  # shown in the progress log, e.g. "floor"


def run_jobs(
    jobs: list[Job],
    cache: ClipCache,
    log: Callable[[str], None],
    prepare: Callable[[Options, torch.device], None] | None = None,
) -> dict[Path, str]:
    """Generate every job that is not cached, one pipeline per arm hash, loaded only if that arm has work.
    prepare(options, device): what the command's process does before each pipeline is built (the entry point's
    `prepare_pipeline_process`: the arm's VRAM cap and compile caches); None for a library caller.

    Returns {path: "generated in N s" | "cached"} for the report. Jobs for equal arm hashes share a pipeline.
    """
    from ..output import generate_to_mp4
    from ..pipeline import Pipeline, Request

    status: dict[Path, str] = {}
    todo: dict[str, list[Job]] = {}
    for job in jobs:
        if job.path in status or any(j.path == job.path for j in todo.get(job.arm.hash, [])):
            continue
        if not job.fresh and cache.complete(job.path):
            status[job.path] = "cached"
            log(f"cached     {job.arm.label:<16} {job.prompt.id} s{job.seed}")
        else:
            todo.setdefault(job.arm.hash, []).append(job)
    geometry = cache.geometry
    for group in todo.values():
        options = group[0].arm.options
        log(f"loading {cache.model} for arm {group[0].arm.label} [{options.arm_hash()}]")
        if prepare is not None:
            prepare(options, cache.device)
        pipe = Pipeline(cache.model, options, device=cache.device, dtype=cache.dtype)
        try:
            for job in group:
                request = Request(
                    prompt=job.prompt.text,
                    width=geometry.width,
                    height=geometry.height,
                    frames=geometry.frames,
                    steps=geometry.steps,
                    guidance=geometry.guidance,
                    seed=job.seed,
                )
                start = time.perf_counter()
                job.path.parent.mkdir(parents=True, exist_ok=True)
                generate_to_mp4(pipe, request, job.path, cache.model)
                seconds = time.perf_counter() - start
                status[job.path] = f"generated in {seconds:.1f} s"
                what = f"{job.arm.label} ({job.note})" if job.note else job.arm.label
                log(f"generated  {what:<16} {job.prompt.id} s{job.seed} in {seconds:.1f} s")
        finally:
            # A real checkpoint's DiT is tens of GB: drop one arm's pipeline before the next one loads.
            del pipe
            gc.collect()
            if cache.device.type == "cuda":
                torch.cuda.empty_cache()
    return status
