"""Where one request's time goes under an arm: wall seconds per phase of a whole request, then one DiT denoising step
under torch.profiler with device time per kernel, grouped into attention, GEMM, fused elementwise (k6fast's Triton
kernels and Inductor's), other elementwise/normalisation, host<->device copies and other.

Why: the bench says how fast an arm is; this says what the rest of the time is made of, so the next optimisation
goes where the time is. The step's kernel sum is set against its wall time: the gap is launch overhead, idle device
and copies the compute did not hide. The streaming copies (H2D, D2H) run beside the compute on their own stream, so
they are reported apart, with the part of them no compute kernel overlapped ("exposed").

How: the arm's Pipeline serves warm-up requests first (torch.compile and autotuning happen there), then one measured
request (its own phase telemetry, MP4 mux included, no profiler), then a third request whose profiled step (default:
the first DiT step on the path most steps take) runs under the profiler through the sampler's hooks; that request
is cancelled right after it. `--smoke` does the same on the CPU with a tiny checkpoint and the 64x64x9 geometry;
without CUDA kernels it groups the CPU ops' self time by the same rules, which checks the plumbing, not the numbers.

Run (GPU):  python measurements/profile_step.py --model /tmp/syn --arm final --geometry 864x480x121 --out prof.json
            [--budget-gb 32 --max-resident-blocks 4] [--step N] [--steps N] [--warmup-requests 1] [--trace t.json]
Run (CPU):  python measurements/profile_step.py --smoke [--model DIR] [--arm final] [--out prof.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from bench_common import environment
from torch.autograd import DeviceType

from k6fast.bench.runner import DEFAULT_PROMPT
from k6fast.bench.workload import Geometry, parse_geometry
from k6fast.dit.model import K6DiT
from k6fast.pipeline import Pipeline, Request, Result
from k6fast.sampler import Cancelled, StepEvent
from k6fast.step_cache import fixed_cache_steps
from k6fast.switches import Options, load_options, provenance
from k6fast.telemetry import Telemetry

ATTENTION = "attention"
GEMM = "gemm"
FUSED = "fused_elementwise"  # k6fast's Triton kernels and Inductor's
ELEMENTWISE = "elementwise"  # the other elementwise, normalisation and device-to-device copy kernels
HOST_COPY = "memcpy_h2d_d2h"  # the streaming copies: beside the compute, not part of its sum
OTHER = "other"
CATEGORIES = (ATTENTION, GEMM, FUSED, ELEMENTWISE, HOST_COPY, OTHER)
TOP_KERNELS = 15
# Kineto's activity types of device work; its GPU-side copies of record_function ranges ("gpu_user_annotation")
# span many kernels and would count them twice.
DEVICE_ACTIVITY_TYPES = ("kernel", "gpu_memcpy", "gpu_memset")

# k6fast's own Triton kernels (k6fast/kernels/); a Triton kernel's CUDA name is its function's name. The quantization
# kernels count with the operation they feed, so an arm's attention or GEMM figure is the whole cost of that path.
K6_KERNELS = {
    "_layernorm_modulate_kernel": FUSED,
    "_gated_residual_kernel": FUSED,
    "_gated_residual_modulate_kernel": FUSED,
    "_groupnorm_silu_kernel": FUSED,
    "_channel_moments_kernel": FUSED,  # the video decode's GroupNorm statistics
    "_rms_norm_rope_kernel": FUSED,
    "_quantize_q_kernel": ATTENTION,
    "_kv_stats_kernel": ATTENTION,
    "_kv_quantize_kernel": ATTENTION,
    "_quant_attention_kernel": ATTENTION,
    "_quantize_rows_fp8_kernel": GEMM,
    "_sampled_column_absmax_kernel": GEMM,  # the fp8 layer's outlier-channel choice
    "_select_top_channels_kernel": GEMM,
    "_fp16acc_linear_kernel": GEMM,
    "_fp8_fp16acc_kernel": GEMM,  # the GeForce fp8 GEMM (FP16 chunks)
    "_nvfp4_linear_kernel": GEMM,
    "_sparse_attention_kernel": ATTENTION,  # the block-sparse video self-attention (Triton, where fa4's does not run)
    "_df11_decode_kernel": GEMM,  # a DF11 checkpoint's weights decoded on the device, for the GEMMs that read them
}
# Substrings of lower-cased names. Attention is tested before GEMM: cuDNN's and FlashAttention-3's kernels carry
# GEMM-ish words (wgmma, cutlass). "quant_per_block" is SageAttention's Q/K quantization.
ATTENTION_MARKS = ("flash", "fmha", "sdpa", "attention", "attn", "quant_per_block")
GEMM_MARKS = ("gemm", "gemv", "cutlass", "cublas", "scaled_mm", "xmma", "nvjet", "matmul")
ELEMENTWISE_MARKS = ("at::native", "elementwise", "reduce", "norm", "softmax", "memcpy dtod", "memset")
# CPU ops (the --smoke path): GEMM-like aten ops, and the ones that only allocate or re-view memory (no arithmetic).
GEMM_OPS = {"mm", "addmm", "bmm", "baddbmm", "linear", "addmv", "mv"}
NO_MATH_OPS = {
    "empty", "empty_like", "empty_strided", "view", "reshape", "_reshape_alias", "_unsafe_view", "as_strided",
    "expand", "transpose", "permute", "t", "slice", "select", "unsqueeze", "squeeze", "flatten", "unflatten", "chunk",
    "split", "split_with_sizes", "narrow", "unbind", "detach", "alias", "lift_fresh", "resolve_conj", "resolve_neg",
    "to", "contiguous", "result_type", "item", "_local_scalar_dense",
}  # fmt: skip


def categorise(name: str) -> str:
    """The category of a CUDA kernel (or memcpy/memset) name as torch.profiler reports it, or of a CPU op name."""
    n = name.lower()
    if n.startswith("## "):  # Inductor's "## Call CompiledFxGraph <hash> ##" range (CPU): the hash is random text
        return OTHER
    if n.startswith(("memcpy htod", "memcpy dtoh")):
        return HOST_COPY
    if name in K6_KERNELS:
        return K6_KERNELS[name]
    if n.startswith("triton_"):  # Inductor: triton_{poi,red,per}_fused_* elementwise/reductions, triton_tem_* templates
        if n.startswith("triton_tem_"):
            return ATTENTION if "attention" in n else GEMM
        return FUSED
    if any(mark in n for mark in ATTENTION_MARKS):
        return ATTENTION
    if any(mark in n for mark in GEMM_MARKS):
        return GEMM
    if n.startswith("aten::"):
        op = n.removeprefix("aten::")
        if op in GEMM_OPS:
            return GEMM
        return OTHER if op in NO_MATH_OPS else ELEMENTWISE
    if any(mark in n for mark in ELEMENTWISE_MARKS):
        return ELEMENTWISE
    return OTHER


@dataclass(frozen=True)
class Activity:
    """One profiled kernel or op: its name, its interval on the profiler's clock (µs) and the time it counts for
    (a kernel: its duration; a CPU op: its self time, so that nested ops are not counted twice)."""

    name: str
    start_us: float
    end_us: float
    time_us: float


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of intervals as sorted, disjoint intervals."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def length(merged: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in merged)


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two merged interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def breakdown(activities: list[Activity], wall_s: float) -> dict:
    """Per-category and per-name time of one step's activities, against the step's wall time.

    kernel_s is the sum over every category; compute_s leaves out the host copies (they overlap compute); busy_s is
    the time at least one compute activity ran (concurrent kernels counted once); gap_s = wall_s - busy_s."""
    per_name: dict[str, list[float]] = {}
    for a in activities:
        entry = per_name.setdefault(a.name, [0.0, 0])
        entry[0] += a.time_us
        entry[1] += 1
    categories = {c: {"s": 0.0, "count": 0} for c in CATEGORIES}
    kernels = []
    for name, (us, count) in sorted(per_name.items(), key=lambda kv: -kv[1][0]):
        category = categorise(name)
        categories[category]["s"] += us / 1e6
        categories[category]["count"] += count
        kernels.append({"name": name, "category": category, "s": us / 1e6, "count": count})
    kernel_s = sum(c["s"] for c in categories.values())
    compute_s = kernel_s - categories[HOST_COPY]["s"]
    for c in categories.values():
        c["share_of_compute"] = c["s"] / compute_s if compute_s else 0.0
    categories[HOST_COPY]["share_of_compute"] = None  # not part of the compute sum
    compute = merge([(a.start_us, a.end_us) for a in activities if categorise(a.name) != HOST_COPY])
    copies = merge([(a.start_us, a.end_us) for a in activities if categorise(a.name) == HOST_COPY])
    busy_s = length(compute) / 1e6
    return {
        "wall_s": wall_s,
        "categories": categories,
        "kernel_s": kernel_s,
        "compute_s": compute_s,
        "busy_s": busy_s,
        "gap_s": wall_s - busy_s,
        "copy_s": categories[HOST_COPY]["s"],
        "copy_exposed_s": (length(copies) - overlap(copies, compute)) / 1e6,
        "top_kernels": kernels[:TOP_KERNELS],
        "kernels": kernels,
    }


# The device side is read from the Chrome trace torch exports (categories "kernel", "gpu_memcpy", "gpu_memset",
# "cuda_runtime", "cuda_driver"): its format is stable across torch releases, unlike FunctionEvent's attributes
# (torch 2.11's have no `activity_type`).
def trace_events(trace: dict) -> list[dict]:
    """The complete ("X") events of an exported Chrome trace."""
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]


def device_activities(events: list[dict]) -> list[Activity]:
    """CUDA kernels, memcpys and memsets, on every stream."""
    return [
        Activity(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"]), float(e["dur"]))
        for e in events
        if e.get("cat") in DEVICE_ACTIVITY_TYPES
    ]


def device_event_types(events: list[dict]) -> dict[str, int]:
    """How many trace events of each category were recorded (what device_activities kept or left)."""
    return dict(Counter(e.get("cat", "?") for e in events))


def launch_calls(events: list[dict]) -> dict:
    """CPU time in kernel-launch API calls (cudaLaunchKernel, cuLaunchKernelEx, ...): what launch-bound gaps cost."""
    launches = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and "Launch" in e["name"]]
    return {"count": len(launches), "s": sum(float(e["dur"]) for e in launches) / 1e6}


def cpu_op_activities(events) -> list[Activity]:
    """CPU ops with their self time (the --smoke path, where no CUDA kernel runs)."""
    return [
        Activity(e.name, e.time_range.start, e.time_range.end, e.self_cpu_time_total)
        for e in events
        if e.device_type == DeviceType.CPU and e.activity_type == "cpu_op" and not e.is_user_annotation
    ]


class OneStepProfiler:
    """Profiles exactly one denoising step: the profiler moves along at the start of each step's first DiT call
    (`before_dit_call`, hooked into K6DiT by `hooked`), stops in `on_step` after the step's device sync (keeping
    the sampler's own wall time of the step), and `should_stop` then cancels the request. `should_stop` is checked
    at many points of a request (phases, steps, blocks, decode ops), so it cannot itself mark step starts.

    The step before the target is the profiler's warm-up (its start-up cost lands there, not in the step measured);
    step 0 has none."""

    def __init__(self, step: int, cuda: bool):
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        warmup = 1 if step > 0 else 0
        with warnings.catch_warnings():  # step 0 goes without a warm-up knowingly; the record says which step it was
            warnings.filterwarnings("ignore", "Profiler won't be using warmup")
            schedule = torch.profiler.schedule(wait=0, warmup=warmup, active=1, repeat=1)
        self.step, self.first = step, step - warmup
        self.profiler = torch.profiler.profile(activities=activities, schedule=schedule)
        self.wall_s: float | None = None
        self._steps_done = 0
        self._marked = -1  # the last step whose first DiT call moved the profiler

    def before_dit_call(self) -> None:
        index = self._steps_done
        if index == self._marked:  # a second call in the same step (CFG)
            return
        self._marked = index
        if index == self.first:
            self.profiler.start()
        elif self.first < index <= self.step:
            self.profiler.step()

    def on_step(self, event: StepEvent) -> None:
        self._steps_done = event.index + 1
        if event.index == self.step:
            self.profiler.stop()
            self.wall_s = event.seconds

    def should_stop(self) -> bool:
        return self.wall_s is not None

    @contextlib.contextmanager
    def hooked(self):
        """K6DiT's forward announces itself to this profiler while the block runs (restored after)."""
        original = K6DiT.__call__

        def call(dit, *args, **kwargs):
            self.before_dit_call()
            return original(dit, *args, **kwargs)

        K6DiT.__call__ = call
        try:
            yield
        finally:
            K6DiT.__call__ = original


def default_step(options: Options, steps: int, cached: tuple[int, ...]) -> int:
    """The first step on the path most steps take: after step 0 (and after the exact-attention steps of a quantized
    attention arm), skipping the `cached` steps (`fixed_cache_steps`: those the PiFlow cache serves without the DiT)."""
    called = [i for i in range(steps) if i not in cached]
    typical = [i for i in called if i >= max(1, options.exact_attn_steps)]
    return (typical or called)[0]


def request_record(telemetry: Telemetry, wall_s: float, load_s: float) -> dict:
    """The measured request from the pipeline's own telemetry; per-block streaming detail left out."""
    t = telemetry.as_dict()
    copy = sum(s["copy_s"] for s in t["stream_steps"])
    exposed = sum(s["exposed_s"] for s in t["stream_steps"])
    return {
        "load_s": load_s,
        "wall_s": wall_s,
        "phases_s": t["phases_s"],
        "unaccounted_s": wall_s - sum(t["phases_s"].values()),
        "step_s": t["step_s"],
        "dit_calls": t["dit_calls"],
        "cached_steps": t["cached_steps"],
        "peak_vram_bytes": t["peak_vram_bytes"],
        "stream": {"copy_s": copy, "exposed_s": exposed, "hidden_share": 1 - exposed / copy if copy else None},
    }


def run_request(pipe: Pipeline, request: Request, mp4: Path) -> tuple[Result, float]:
    """One whole request as `k6fast generate` runs it, the MP4 mux included (timed as the "mux" phase)."""
    from k6fast.output import write_result

    start = time.perf_counter()
    result = pipe.generate(request)
    write_result(result, mp4, pipe.options, request, str(pipe.ckpt.root), pipe.ckpt.variant)
    return result, time.perf_counter() - start


def profile(args: argparse.Namespace, model: Path, geometry: Geometry, device: torch.device, work: Path) -> dict:
    options = load_options(arm=args.arm)
    if args.budget_gb is not None:
        options = options.replace(vram_budget_gb=args.budget_gb)
    if args.max_resident_blocks is not None:
        options = options.replace(max_resident_blocks=args.max_resident_blocks)
    pipe = Pipeline(model, options, device=device, plan_geometry=(geometry.width, geometry.height, geometry.frames))
    try:
        plan = pipe.runtime.plan
        width, height, frames = geometry.width, geometry.height, geometry.frames
        request = Request(prompt=DEFAULT_PROMPT, width=width, height=height, frames=frames, steps=args.steps)
        steps, _ = pipe.resolve(request)
        cached = fixed_cache_steps(pipe.ckpt, options)
        step = default_step(options, steps, cached) if args.step is None else args.step
        if not 0 <= step < steps or step in cached:
            raise SystemExit(f"--step {step}: expected a step in 0..{steps - 1} that calls the DiT (not cached)")
        for i in range(args.warmup_requests):
            run_request(pipe, request, work / f"warmup{i}.mp4")
        result, wall_s = run_request(pipe, request, work / "measured.mp4")
        measured = request_record(result.telemetry, wall_s, pipe.load_seconds)
        if args.out:  # kept if the profiled step fails: the measured request is the costly part of a GPU run
            write_record(args.out, {"script": "profile_step", "arm": options.arm_name, "request": measured,
                                    "step": None, "note": "partial: the profiled step did not finish"})  # fmt: skip

        profiler = OneStepProfiler(step, cuda=device.type == "cuda")
        with contextlib.suppress(Cancelled), profiler.hooked():  # cancelled after the profiled step
            pipe.generate(request, on_step=profiler.on_step, should_stop=profiler.should_stop)
        if profiler.wall_s is None:
            raise RuntimeError(f"step {step} never ran under the profiler")
        trace_path = args.trace or work / "step_trace.json"
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        profiler.profiler.export_chrome_trace(str(trace_path))
        if device.type == "cuda":
            events = trace_events(json.loads(trace_path.read_text()))
            kernels = device_activities(events)
            if not kernels:  # an all-zero table would look like a result
                raise RuntimeError(f"no CUDA kernel was recorded; device events by type: {device_event_types(events)}")
            step_record = {"measure": "cuda_kernels", **breakdown(kernels, profiler.wall_s)}
            step_record["launch_calls"] = launch_calls(events)
            step_record["device_event_types"] = device_event_types(events)
        else:
            cpu_ops = cpu_op_activities(profiler.profiler.events())
            step_record = {"measure": "cpu_op_self_time", **breakdown(cpu_ops, profiler.wall_s)}
        step_record["index"] = step
        step_record["unprofiled_wall_s"] = measured["step_s"][step]
        return {
            "script": "profile_step",
            "arm": options.arm_name,
            "provenance": provenance(options),
            "model": str(model),
            "variant": pipe.ckpt.variant,
            "fused_blocks": pipe.ckpt.dit.num_visual_blocks,
            "geometry": geometry.label(),
            "steps": steps,
            "dtype": str(pipe.dtype).removeprefix("torch."),
            "plan": {
                "resident_blocks": plan.resident_blocks,
                "streamed_blocks": plan.streamed_blocks,
                "describe": plan.describe(),
            },
            "environment": environment(pipe.device),
            "warmup_requests": args.warmup_requests,
            "request": measured,
            "step": step_record,
        }
    finally:
        pipe.close()


def print_report(record: dict) -> None:
    req, step = record["request"], record["step"]
    env, plan = record["environment"], record["plan"]
    print(f"arm {record['arm']} [{record['provenance']['arm_hash']}] on {env['gpu'] or env['device']}, "
          f"{record['geometry']}, {record['steps']} steps, {record['variant']} with {record['fused_blocks']} fused "
          f"blocks ({plan['resident_blocks']} resident, {plan['streamed_blocks']} streamed)")  # fmt: skip
    print(f"\n{'phase':<16}{'seconds':>10}{'share':>8}")
    print(f"{'load (once)':<16}{req['load_s']:>10.3f}")
    for name, seconds in [*req["phases_s"].items(), ("unaccounted", req["unaccounted_s"])]:
        print(f"{name:<16}{seconds:>10.3f}{seconds / req['wall_s']:>8.1%}")
    print(f"{'request':<16}{req['wall_s']:>10.3f}")
    if req["peak_vram_bytes"]:
        print(f"peak VRAM {req['peak_vram_bytes'] / 2**30:.2f} GiB")
    if req["stream"]["copy_s"]:
        stream = req["stream"]
        print(f"streaming: copies {stream['copy_s']:.3f} s, exposed {stream['exposed_s']:.3f} s")
    print(f"denoising: {len(req['step_s'])} steps, {req['dit_calls']} DiT calls, {req['cached_steps']} cached; "
          f"step seconds {', '.join(f'{s:.3f}' for s in req['step_s'])}")  # fmt: skip

    unit = "kernels" if step["measure"] == "cuda_kernels" else "CPU ops (self time)"
    print(f"\nstep {step['index']}: wall {step['wall_s'] * 1e3:.2f} ms under the profiler, "
          f"{step['unprofiled_wall_s'] * 1e3:.2f} ms without; time in {unit}")  # fmt: skip
    print(f"{'category':<20}{'ms':>10}{'count':>8}{'of compute':>12}")
    for name, c in step["categories"].items():
        share = "" if c["share_of_compute"] is None else f"{c['share_of_compute']:.1%}"
        print(f"{name:<20}{c['s'] * 1e3:>10.2f}{c['count']:>8}{share:>12}")
    print(f"{'compute sum':<20}{step['compute_s'] * 1e3:>10.2f}   (host copies left out: they overlap compute)")
    print(f"{'busy (union)':<20}{step['busy_s'] * 1e3:>10.2f}   ({step['busy_s'] / step['wall_s']:.1%} of the step)")
    gap = "launch, idle and exposed copies" if step["measure"] == "cuda_kernels" else "outside any op (Python, ...)"
    print(f"{'gap (wall - busy)':<20}{step['gap_s'] * 1e3:>10.2f}   {gap}")
    print(f"{'copies exposed':<20}{step['copy_exposed_s'] * 1e3:>10.2f}   of {step['copy_s'] * 1e3:.2f} ms H2D/D2H")
    if "launch_calls" in step:
        calls = step["launch_calls"]
        print(f"{'launch API (CPU)':<20}{calls['s'] * 1e3:>10.2f}   {calls['count']} launches")
    print(f"\ntop {len(step['top_kernels'])} by time\n{'ms':>10}{'count':>7}  {'category':<18}name")
    for k in step["top_kernels"]:
        name = k["name"] if len(k["name"]) <= 100 else k["name"][:97] + "..."
        print(f"{k['s'] * 1e3:>10.3f}{k['count']:>7}  {k['category']:<18}{name}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, help="checkpoint directory (--smoke: a tiny one is made if not given)")
    ap.add_argument("--arm", help="named arm (switches/arms/NAME.env) or .env path; K6_* variables override it")
    ap.add_argument("--geometry", help="WIDTHxHEIGHTxFRAMES, w1 or smoke (default w1; --smoke: smoke = 64x64x9)")
    ap.add_argument("--steps", type=int, help="denoising steps (default: the checkpoint's)")
    ap.add_argument("--step", type=int, help="the step to profile (default: the first typical DiT step)")
    ap.add_argument("--warmup-requests", type=int, default=1, help="whole requests before the measured one")
    ap.add_argument("--budget-gb", type=float, help="VRAM budget (K6_VRAM_BUDGET_GB); default: the arm's/env's")
    ap.add_argument("--max-resident-blocks", type=int, help="cap on resident fused blocks (K6_MAX_RESIDENT_BLOCKS)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny checkpoint and geometry: checks the plumbing")
    ap.add_argument("--trace", type=Path, help="also write the profiled step's Chrome trace here")
    ap.add_argument("--out", type=Path, help="write the record as JSON here (parent folders are created)")
    args = ap.parse_args(argv)
    if args.warmup_requests < 0:
        raise SystemExit("--warmup-requests must be >= 0")
    if args.smoke:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        raise SystemExit("profile_step.py profiles CUDA kernels and needs a GPU; --smoke runs it on the CPU")
    geometry = parse_geometry(args.geometry or ("smoke" if args.smoke else "w1"))
    with tempfile.TemporaryDirectory(prefix="k6fast-profile-") as tmp:
        work = Path(tmp)
        model = args.model
        if model is None:
            if not args.smoke:
                raise SystemExit("--model is required (only --smoke makes a tiny checkpoint)")
            from k6fast.testing.tiny import make_tiny

            model = make_tiny(work / "tiny", variant="distill", seed=0)
        record = profile(args, model, geometry, device, work)
    if args.out:
        write_record(args.out, record)
    print_report(record)
    return record


def write_record(path: Path, record: dict) -> None:
    """The record as JSON in its own key order (the categories' order is part of the report)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
