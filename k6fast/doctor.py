"""`k6fast doctor`: what a user runs before downloading 56 GB. The machine (GPU, compute capability, VRAM, host
RAM, free disk), the checkpoint's disk read speed when one is given, and the arm, budget and residency k6fast would
choose, each with its reason.

It imports no model code and not even PyTorch (the GPU is read through nvidia-smi), so it answers in well under a
second; the residency plan comes from the safetensors headers alone, the same arithmetic the runtime uses.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import bytecode
from .fit import largest_frames
from .memory import PROCESS_HOST_BYTES, CgroupLimit, HostMemory, cgroup_limit, meminfo
from .request import W1, dit_tokens
from .stream.plan import (
    GiB,
    HostCacheError,
    ResidencyError,
    activation_estimate,
    activation_profile,
    disk_bytes_per_step,
    index_footprint,
    plan_host_cache,
    plan_residency,
    stored_block_bytes,
)
from .switches.catalog import SWITCHES_BY_NAME
from .switches.registry import AUTO, SECRET_SET, SwitchError
from .vae_geometry import AudioRate, audio_rate

GB = 1e9
# The Pro DiT in BF16 (60 fused blocks, text blocks, embeddings): the size a user would download.
PRO_DIT_BF16_BYTES = int(56.14 * GiB)
# Stored size against BF16: a DF11 checkpoint (lossless) and an fp8 one (lossy). DF11's 0.70 is its paper's figure on
# released models (arXiv 2504.11651); Gaussian synthetic weights measured 0.667-0.673
# (measurements/sessions/2026-12-02_df11-h200). fp8: e4m3 weights with their scales, the rest as stored.
DF11_RATIO = 0.70
FP8_RATIO = 0.58


@dataclass
class Gpu:
    name: str
    compute_capability: str
    memory_bytes: int
    driver: str

    @property
    def geforce(self) -> bool:
        return "GeForce" in self.name  # the rule `k6fast.dit.arch` applies to the auto choices


@dataclass
class Report:
    gpus: list[Gpu]
    host_ram_bytes: int
    host_available_bytes: int
    disk_free_bytes: int
    disk_path: str
    read_gb_s: float | None = None
    read_note: str = ""
    advice: list[str] = field(default_factory=list)
    plan: dict | None = None
    disk_per_step: dict | None = None  # `predict_disk_per_step`: what a later run's disk_read_bytes is held against
    cgroup: CgroupLimit | None = None  # the memory limit of the cgroup doctor runs in, where one applies
    switches: dict[str, str] = field(default_factory=dict)  # the K6_* variables set where doctor ran, which it used

    def as_dict(self) -> dict:
        return asdict(self)


def read_gpus(smi: str | None = None) -> list[Gpu]:
    smi = smi or shutil.which("nvidia-smi")
    if smi is None:
        return []
    query = "--query-gpu=name,compute_cap,memory.total,driver_version"
    try:
        out = subprocess.run([smi, query, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=10, check=True).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4 and parts[2].isdigit():
            gpus.append(Gpu(parts[0], parts[1], int(parts[2]) * 2**20, parts[3]))
    return gpus


def measure_read(path: Path, nbytes: int = 512 << 20) -> tuple[float, str]:
    """Sequential read speed of `path` (GB/s) after asking the kernel to drop its cached pages of the range, so the
    figure is the disk's rather than the page cache's (a range another process keeps mapped may still be cached)."""
    size = min(nbytes, path.stat().st_size)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)
        buf, done, start = bytearray(16 << 20), 0, time.perf_counter()
        view = memoryview(buf)
        while done < size:
            n = os.readv(fd, [view[: min(len(buf), size - done)]])
            if n <= 0:
                break
            done += n
        seconds = time.perf_counter() - start
    finally:
        os.close(fd)
    return done / seconds / GB, f"{done / 2**20:.3g} MiB of {path.name}, cached pages dropped first"


def checkpoint_read_speed(model: str | Path) -> tuple[float, str]:
    """`measure_read` of the checkpoint's largest transformer file: (GB/s, what was read)."""
    from .checkpoint import open_checkpoint

    largest = max(open_checkpoint(model).transformer_files, key=lambda f: f.stat().st_size)
    return measure_read(largest)


# The sizes whose longest clip `k6fast doctor` reports per arm: the headline size and the largest the server takes.
CAPACITY_SIZES = ((864, 480), (1280, 720))


def dit_plan(
    model: Path,
    budget_bytes: int,
    gpu: Gpu | None = None,
    *,
    arm: str | None = None,
    geometry: tuple[int, int, int] = W1,
    environ: dict[str, str] | None = None,
) -> dict:
    """The residency plan the runtime would make at `geometry` (W1) for this checkpoint and budget (bf16 compute; the
    exact arm's activations, or `arm`'s kernels as resolved for `gpu`), and per arm the longest clip whose DiT phase
    fits at each of CAPACITY_SIZES (the runtime's own check; the exact video decode is checked per request on
    top). `environ`: K6_* variables over each arm's file, as `generate` applies them (default none)."""
    from .checkpoint import open_checkpoint
    from .safetensors_index import index_safetensors
    from .text_plan import text_footprint, text_weights

    ckpt = open_checkpoint(model)
    rate = audio_rate(ckpt.root)  # the checkpoint's, as the runtime plans with
    cfg = ckpt.dit
    index = index_safetensors(ckpt.transformer_files)
    fixed, block = index_footprint(index, cfg.num_visual_blocks, 2)
    text = text_footprint(text_weights(ckpt.root), "BF16")

    def planner(tokens: tuple[int, int], profile: dict[str, bool] | None = None):
        activations = activation_estimate(*tokens, cfg.model_dim, cfg.model_dim_a, ff_dim=cfg.ff_dim, **(profile or {}))
        return plan_residency(budget_bytes=budget_bytes, fixed_bytes=fixed, block_bytes=block,
                              num_blocks=cfg.num_visual_blocks, activation_bytes=activations,
                              text_bytes=text.device_bytes)  # fmt: skip

    stored_fp8 = any(loc.dtype == "F8_E4M3" for loc in index.values())
    capacity = {name: _arm_capacity(name, planner, stored_fp8, gpu, rate, environ) for name in _arm_names()}
    stored = sum(f.stat().st_size for f in ckpt.transformer_files)
    stored_as = ckpt.quantization or ckpt.compression  # None: BF16 as released
    profile = None if arm is None else arm_profile(arm, stored_fp8, gpu, environ)
    try:
        plan = planner(dit_tokens(*geometry, rate), profile)
    except ResidencyError as exc:
        where = "W1" if geometry == W1 else "x".join(map(str, geometry))
        return {"variant": ckpt.variant, "dit_file_bytes": stored, "describe": f"at {where}: {exc}",
                "capacity": capacity, "text": text.as_dict(), "text_describe": text.describe(),
                "stored_as": stored_as}  # fmt: skip
    stored_blocks = stored_block_bytes(index, cfg.num_visual_blocks)  # what one read of each block takes
    return {"variant": ckpt.variant, "dit_file_bytes": stored, **plan.as_dict(), "describe": plan.describe(),
            "capacity": capacity, "text": text.as_dict(), "text_describe": text.describe(), "stored_as": stored_as,
            "streamed_stored_bytes": stored_blocks[plan.resident_blocks :]}  # fmt: skip


def _arm_names() -> list[str]:
    from .switches.arms import list_arms

    return list_arms()


def arm_profile(arm: str, stored_fp8: bool, gpu: Gpu | None, environ: dict[str, str] | None = None) -> dict[str, bool]:
    """`activation_profile` of `arm`'s GEMM and attention as resolved for `gpu` (None: the CPU), with the K6_*
    variables of `environ` over the arm's file (default none): what `k6fast generate --arm ARM` plans with there."""
    from .dit.arch import Target, resolve_for
    from .switches import load_options

    if gpu is None:
        target = Target("cpu", None)
    else:
        major, _, minor = gpu.compute_capability.partition(".")
        target = Target(gpu.name, (int(major), int(minor or 0)), gpu.geforce)
    options = resolve_for(load_options(environ or {}, arm=arm), target)
    return activation_profile(options.gemm, options.attn, stored_fp8)


def _arm_capacity(arm: str, planner, stored_fp8: bool, gpu: Gpu | None, rate: AudioRate,
                  environ: dict[str, str] | None) -> dict[str, int | None]:  # fmt: skip
    """{"WxH": the most frames of a clip at that size whose DiT phase fits, None when none does} for `arm` on `gpu`."""
    profile = arm_profile(arm, stored_fp8, gpu, environ)

    def fits(w: int, h: int, f: int) -> bool:
        try:
            planner(dit_tokens(w, h, f, rate), profile)
        except ResidencyError:
            return False
        return True

    return {f"{w}x{h}": largest_frames(fits, w, h) for w, h in CAPACITY_SIZES}


def advise(report: Report, dit_bytes: int, plan: dict | None, compressed: bool = False) -> list[str]:
    """The choices k6fast would make on this machine, each with its reason. compressed: the checkpoint is already
    stored smaller than BF16 (DF11, fp8, nvfp4), so no other format is suggested."""
    out = []
    if not report.gpus:
        out.append("no NVIDIA GPU found (nvidia-smi absent or silent): k6fast would run on the CPU, for tests only")
        return out
    gpu = report.gpus[0]
    arm = "final"
    why = ("GeForce card: `final`'s auto choices take the GeForce GEMM and attention kernels on the middle blocks, "
           "shown by `k6fast switches --arm final`; what was measured on which card is in README's Results") if (
            gpu.geforce) else (
           "datacenter card: `final`'s auto choices keep BF16 GEMMs and exact attention")  # fmt: skip
    out.append(f"arm: {arm} ({why}); `fast` is the lossy mode - judge it with `k6fast gate` on your prompts")
    budget = gpu.memory_bytes
    out.append(f"budget: the whole card, {budget / GiB:.1f} GiB (K6_VRAM_BUDGET_GB=0); lower it by what the display "
               "and other programs hold")  # fmt: skip
    if plan is not None and "resident_blocks" in plan:
        out.append(f"residency at W1: {plan['resident_blocks']} of {plan['num_blocks']} blocks resident, the rest "
                   f"streamed through {plan['slots']} slots")  # fmt: skip
    for arm, sizes in (plan or {}).get("capacity", {}).items():
        longest = ", ".join(
            f"{size} up to {frames} frames" if frames else f"{size} none" for size, frames in sizes.items()
        )
        out.append(f"largest clip, arm {arm}: {longest} (a larger request is refused before any work)")
    cache_room = report.host_ram_bytes - PROCESS_HOST_BYTES
    df11_bytes, fp8_bytes = int(dit_bytes * DF11_RATIO), int(dit_bytes * FP8_RATIO)
    if dit_bytes > cache_room and compressed:
        out.append(f"page cache: the DiT's {dit_bytes / GB:.0f} GB do not fit beside {report.host_ram_bytes / GB:.0f} "
                   "GB of RAM: expect disk reads every denoising step; more RAM would help")  # fmt: skip
    elif dit_bytes > cache_room:
        if df11_bytes <= cache_room:  # lossless: every arm's output unchanged, `reference` and `final` included
            hint = (f"a DF11 checkpoint (`k6fast quantize --format df11 --device cuda`, lossless, "
                    f"~{df11_bytes / GB:.0f} GB) would fit")  # fmt: skip
        elif fp8_bytes <= cache_room:
            hint = f"an fp8 checkpoint (`k6fast quantize --format fp8`, lossy, ~{fp8_bytes / GB:.0f} GB) would fit"
        else:
            hint = "a smaller (fp8/nvfp4) checkpoint or more RAM would help"
        out.append(f"page cache: the DiT's {dit_bytes / GB:.0f} GB do not fit beside {report.host_ram_bytes / GB:.0f} "
                   f"GB of RAM: expect disk reads every denoising step; {hint}")  # fmt: skip
    else:
        out.append(f"page cache: the DiT's {dit_bytes / GB:.0f} GB fit in {report.host_ram_bytes / GB:.0f} GB of RAM "
                   "after the first request")  # fmt: skip
    if report.read_gb_s is not None and plan is not None and "resident_blocks" in plan:
        streamed = sum(_streamed_sizes(plan))
        out.append(f"disk: {report.read_gb_s:.2f} GB/s; a step that misses the page cache reads "
                   f"{streamed / GB:.0f} GB: {streamed / GB / report.read_gb_s:.1f} s of reading per step")  # fmt: skip
    if report.disk_free_bytes < dit_bytes:
        out.append(f"disk space: {report.disk_free_bytes / GB:.0f} GB free at {report.disk_path}, the DiT alone is "
                   f"{dit_bytes / GB:.0f} GB")  # fmt: skip
    return out


def _streamed_sizes(plan: dict) -> list[int]:
    """Stored bytes of each streamed block in streaming order: the checkpoint's own where the plan has them (a plan
    from `dit_plan`), else each block at its device size."""
    if "streamed_stored_bytes" in plan:
        return list(plan["streamed_stored_bytes"])
    return [plan["block_bytes"]] * (plan["num_blocks"] - plan["resident_blocks"])


def predict_disk_per_step(
    plan: dict,
    available_bytes: int,
    read_gb_s: float | None,
    cgroup: CgroupLimit | None = None,
    setting: str | float = AUTO,
) -> dict | None:
    """Bytes a steady denoising step reads from disk (at W1, under `plan`) on a host with `available_bytes`
    MemAvailable before k6fast starts, without the host tier and with it as K6_HOST_CACHE_GB `setting` gives it
    (auto, 0 or GiB), and the step time their reading alone takes at `read_gb_s`: a lower bound, what a run's
    disk_read_bytes per step is held against. `cgroup`: the limit the run will be under, when tighter than the host.
    None when nothing streams. A size the host cannot spare leaves the tier's figures None and says why
    (`tier_refused`): the run would refuse to start."""
    sizes = _streamed_sizes(plan)
    if not sizes:
        return None
    host = HostMemory(0, available_bytes, cgroup=cgroup)  # the process not started yet: its whole size is to come
    streamed = list(enumerate(sizes))
    seconds = (lambda n: n / GB / read_gb_s) if read_gb_s else (lambda n: None)  # noqa: E731
    without = disk_bytes_per_step(sum(sizes), 0, host)
    out = {"streamed_blocks": len(sizes), "streamed_bytes": sum(sizes), "available_bytes": available_bytes,
           "cache_room_bytes": host.cache_room_bytes, "read_gb_s": read_gb_s, "host_cache_setting": setting,
           "without_tier_bytes": without, "without_tier_min_s": seconds(without), "tier_refused": None}  # fmt: skip
    try:
        blocks = plan_host_cache(setting, streamed, host)
    except HostCacheError as exc:
        return {**out, "host_blocks": None, "host_bytes": None, "with_tier_bytes": None, "with_tier_min_s": None,
                "tier_refused": str(exc)}  # fmt: skip
    tier = sum(sizes[i] for i in blocks)
    with_tier = disk_bytes_per_step(sum(sizes), tier, host)
    return {**out, "host_blocks": len(blocks), "host_bytes": tier, "with_tier_bytes": with_tier,
            "with_tier_min_s": seconds(with_tier)}  # fmt: skip


def _disk_per_step_line(p: dict) -> str:
    def part(n: int, s: float | None) -> str:
        return f"{n / GB:.1f} GB" + (f" (>= {s:.1f} s a step at {p['read_gb_s']:.2f} GB/s)" if s is not None else "")

    head = (f"disk reads per denoising step, {p['streamed_blocks']} streamed blocks of {p['streamed_bytes'] / GB:.1f} "
            f"GB with {p['available_bytes'] / GB:.1f} GB available ({p['cache_room_bytes'] / GB:.1f} GB for the page "
            f"cache and the host tier beside the process and the OS): ")  # fmt: skip
    setting = p.get("host_cache_setting", AUTO)
    named = f"K6_HOST_CACHE_GB={setting if setting == AUTO else f'{float(setting):g}'}"
    if p.get("tier_refused"):
        return (
            head + f"without the host tier {part(p['without_tier_bytes'], p['without_tier_min_s'])}; {named} "
            f"would be refused at start: {p['tier_refused']}"
        )
    if not p["without_tier_bytes"]:
        pins = "pins nothing" if setting == AUTO else "is not needed"
        return head + f"none after the first step, the page cache holds them all ({named} {pins})"
    if setting != AUTO and float(setting) == 0:
        return (
            head + f"{part(p['without_tier_bytes'], p['without_tier_min_s'])} ({named}: the host tier is off; "
            "auto would keep part of them in host memory)"
        )
    return (head + f"without the host tier {part(p['without_tier_bytes'], p['without_tier_min_s'])}; with "
            f"{named} {p['host_blocks']} blocks ({p['host_bytes'] / GB:.1f} GB) in host memory, "
            f"{part(p['with_tier_bytes'], p['with_tier_min_s'])}")  # fmt: skip


def run_doctor(
    model: str | None = None,
    budget_gb: float = 0.0,
    measure: bool = True,
    *,
    available_bytes: int | None = None,
    read_gb_s: float | None = None,
    environ: dict[str, str] | None = None,
) -> Report:
    """The report for this machine; `available_bytes` and `read_gb_s` stand in for its MemAvailable and its measured
    disk speed, to predict another host's disk reads per step. `environ`: the K6_* variables a `generate` here would
    run with (default none): K6_VRAM_BUDGET_GB where `budget_gb` is 0, K6_HOST_CACHE_GB for the disk prediction, and
    every switch over each arm's file for the largest clips. An invalid value raises SwitchError."""
    from .switches import load_options

    options = load_options({k: v for k, v in (environ or {}).items() if k.startswith("K6_")})  # warns of unknown ones
    # The switches doctor knows from here on: each arm's plan reads them again, and the report shows them (a secret
    # as "<set>").
    environ = {k: v for k, v in (environ or {}).items() if k in SWITCHES_BY_NAME}
    shown = {k: SECRET_SET if SWITCHES_BY_NAME[k].secret else v for k, v in environ.items()}
    budget_gb = budget_gb if budget_gb > 0 else options.vram_budget_gb
    total, available = meminfo()
    where = Path(model) if model and Path(model).exists() else Path.cwd()
    available = available if available_bytes is None else available_bytes
    report = Report(read_gpus(), total, available, shutil.disk_usage(where).free, str(where), cgroup=cgroup_limit(),
                    switches=shown)  # fmt: skip
    dit_bytes = PRO_DIT_BF16_BYTES
    if model and Path(model).is_dir():
        budget = int(budget_gb * GiB) if budget_gb > 0 else (report.gpus[0].memory_bytes if report.gpus else 32 * GiB)
        report.plan = dit_plan(Path(model), budget, report.gpus[0] if report.gpus else None, environ=environ)
        dit_bytes = report.plan["dit_file_bytes"]
        if read_gb_s is not None:
            report.read_gb_s, report.read_note = read_gb_s, "given with --read-gb-s"
        elif measure:
            report.read_gb_s, report.read_note = checkpoint_read_speed(model)
        if "resident_blocks" in report.plan:
            cgroup = report.cgroup if available_bytes is None else None  # --available-gb: another host's figure
            report.disk_per_step = predict_disk_per_step(report.plan, report.host_available_bytes, report.read_gb_s,
                                                         cgroup, options.host_cache_gb)  # fmt: skip
    compressed = bool(report.plan and report.plan.get("stored_as"))
    report.advice = advise(report, dit_bytes, report.plan, compressed)
    slow_start = bytecode.check()  # this interpreter's packages: the start-up every command pays
    if slow_start:
        report.advice.append(slow_start)
    return report


def render(report: Report) -> str:
    lines = []
    for i, g in enumerate(report.gpus):
        lines.append(f"GPU {i}: {g.name}, sm_{g.compute_capability.replace('.', '')}, {g.memory_bytes / GiB:.1f} GiB, "
                     f"driver {g.driver}")  # fmt: skip
    if not report.gpus:
        lines.append("GPU: none found")
    lines.append(f"host RAM: {report.host_ram_bytes / GB:.1f} GB ({report.host_available_bytes / GB:.1f} GB available)")
    if (c := report.cgroup) is not None:
        lines.append(f"cgroup memory limit: {c.limit_bytes / GB:.1f} GB at {c.path} ({c.available_bytes / GB:.1f} GB "
                     "available in it): host memory is planned within it; past it the kernel kills")  # fmt: skip
    lines.append(f"free disk at {report.disk_path}: {report.disk_free_bytes / GB:.1f} GB")
    if report.switches:
        named = ", ".join(f"{k}={v}" for k, v in sorted(report.switches.items()))
        lines.append(f"switches from the environment: {named} (the plan, the largest clips and the disk reads below "
                     "use them, as `k6fast generate` would; --budget-gb overrides K6_VRAM_BUDGET_GB)")  # fmt: skip
    if report.read_gb_s is not None:
        lines.append(f"checkpoint read speed: {report.read_gb_s:.2f} GB/s ({report.read_note})")
    if report.plan is not None:
        lines.append(f"checkpoint: {report.plan['variant']}, DiT {report.plan['dit_file_bytes'] / GB:.1f} GB")
        lines.append(report.plan["describe"])
        lines.append(report.plan["text_describe"])
        if report.disk_per_step is not None:
            lines.append(_disk_per_step_line(report.disk_per_step))
        for arm, sizes in report.plan.get("capacity", {}).items():
            longest = ", ".join(f"{size} up to {n} frames" if n else f"{size} none" for size, n in sizes.items())
            lines.append(f"largest clip, arm {arm}: {longest} (a larger request is refused before any work)")
    lines += [f"- {a}" for a in report.advice]
    return "\n".join(lines)


def register(subparsers):
    p = subparsers.add_parser("doctor", help="check this machine before downloading a checkpoint: GPU, RAM, disk, plan")
    p.add_argument("--model", help="a local checkpoint directory: its disk speed and the residency plan for it")
    p.add_argument("--budget-gb", type=float, default=0.0, help="VRAM budget to plan for (default: the whole card)")
    p.add_argument("--no-read-test", action="store_true", help="skip the disk read measurement")
    p.add_argument("--available-gb", type=float, help="plan the disk reads per step for this MemAvailable (GB)")
    p.add_argument("--read-gb-s", type=float, help="plan with this disk read speed (GB/s) instead of measuring it")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_doctor)
    return p


def cmd_doctor(args) -> int:
    problem = None
    if args.model and not Path(args.model).is_dir():  # run_doctor would report the machine alone, silently
        problem = (f"--model {args.model}: no such directory; expected a local checkpoint directory (doctor downloads "
                   "nothing: fetch a Hub id first, `hf download ID --local-dir DIR`)")  # fmt: skip
    elif not (math.isfinite(args.budget_gb) and args.budget_gb >= 0):
        problem = f"--budget-gb: expected a number of GiB >= 0 (0 = the whole card), found {args.budget_gb}"
    elif args.available_gb is not None and not (math.isfinite(args.available_gb) and args.available_gb >= 0):
        problem = f"--available-gb: expected a number of GB >= 0, found {args.available_gb}"
    elif args.read_gb_s is not None and not (math.isfinite(args.read_gb_s) and args.read_gb_s > 0):
        problem = f"--read-gb-s: expected a number of GB/s > 0, found {args.read_gb_s}"
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    available = None if args.available_gb is None else int(args.available_gb * GB)
    try:
        report = run_doctor(args.model, args.budget_gb, measure=not args.no_read_test, available_bytes=available,
                            read_gb_s=args.read_gb_s, environ=dict(os.environ))  # fmt: skip
    except SwitchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.as_dict(), indent=2) if args.json else render(report))
    return 0
