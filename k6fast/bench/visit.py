"""One bench visit, run as a fresh process: `python -m k6fast.bench.visit --spec SPEC.json --out ROW.json`.

A visit loads one arm, runs one warm-up (kept in the record, apart: users meet cold starts too), then the timed
requests, and writes one JSON record: per-request wall time and the request's whole `Telemetry.as_dict()` (phases,
per-step times and whatever per-block fields the runtime adds), peak VRAM, peak anonymous host RSS (a sampler of
/proc/self/status RssAnon plus the value at the end), the environment (GPU, driver, library versions, host) and the
provenance of the arm. The session adds the GPU-idle wait and the contamination verdict to the row.

What a "request" is depends on the component: a whole clip (`pipeline`, text to muxed MP4), one DiT forward
(`dit`), or one fused block (`block`). Its `seconds` is the figure the session compares.
"""

from __future__ import annotations

import time

_STARTED = time.perf_counter()  # before the heavy imports, so the record can say what importing cost

import argparse  # noqa: E402 - after the clock above on purpose
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from ..entry import cap_device_memory, configure_allocator_environment, prepare_pipeline_process  # noqa: E402
from ..telemetry import anon_rss_bytes  # noqa: E402
from .records import SCHEMA, write_json  # noqa: E402
from .runner import Runner, VisitSpec, peak_vram, sync, time_call  # noqa: E402
from .workload import audio_tokens, block_inputs, dit_inputs  # noqa: E402

VERSIONED = ("torch", "triton", "diffusers", "transformers", "safetensors", "av", "numpy", "k6fast")


class RssSampler:
    """Samples RssAnon (anonymous memory: heap, pinned buffers, private copies of mapped pages; what the kernel
    cannot drop, unlike page cache behind a read-only mapping) in a background thread. `peak` is the largest value
    seen; short spikes between samples can be missed, so the record also keeps ru_maxrss through Telemetry."""

    def __init__(self, interval_s: float = 0.05):
        self.interval_s = interval_s
        self.peak = anon_rss_bytes()
        self.end = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="k6fast-bench-rss", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, anon_rss_bytes())

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.end = anon_rss_bytes()
        self.peak = max(self.peak, self.end)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: torch.device) -> dict[str, Any]:
    from .gpu import gpu_inventory

    gpus = gpu_inventory()
    gpu_name = None
    if device.type == "cuda":
        gpu_name = torch.cuda.get_device_name(device)
    return {
        "device": str(device),
        "gpu_name": gpu_name,
        "gpus": gpus,
        "driver": gpus[0]["driver"] if gpus else None,
        "cuda": torch.version.cuda,
        "versions": {name: _version(name) for name in VERSIONED},
        "python": platform.python_version(),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "pid": os.getpid(),
    }


class _K6Runner:
    """What every k6fast runner shares: the arm's options, the device and dtype, and its provenance."""

    def __init__(self, spec: VisitSpec, options):
        self.spec, self.options = spec, options
        self.device, self.dtype = spec.resolved_device(), spec.resolved_dtype()

    def _pipeline(self):
        """The Pipeline a request runs, planned for the visit's geometry."""
        from ..pipeline import Pipeline

        g = self.spec.geometry
        prepare_pipeline_process(self.options, self.device)  # the visit's process, as `k6fast generate` sets its own
        return Pipeline(self.spec.model, self.options, device=self.device, dtype=self.dtype,
                        plan_geometry=(g.width, g.height, g.frames))  # fmt: skip

    def describe(self) -> dict[str, Any]:
        from ..switches import provenance

        return provenance(self.options)


class K6Pipeline(_K6Runner):
    """k6fast's Pipeline: text to MP4. The MP4 goes to a temporary folder and is deleted (muxing is timed)."""

    def __init__(self, spec: VisitSpec, options):
        super().__init__(spec, options)
        self._tmp = tempfile.TemporaryDirectory(prefix="k6fast-bench-")
        self._count = 0

    def load(self) -> None:
        self.pipe = self._pipeline()

    def run(self) -> dict[str, Any]:
        spec, request = self.spec, self.spec.request
        start = time.perf_counter()
        if spec.mux:  # the MP4 encoded beside the video decode
            from ..output import generate_to_mp4

            self._count += 1
            out = Path(self._tmp.name) / f"request{self._count}.mp4"
            result = generate_to_mp4(self.pipe, request, out, spec.model, stop_after_steps=spec.stop_after_steps)
        else:
            result = self.pipe.generate(request, stop_after_steps=spec.stop_after_steps)
        sync(self.device)
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "telemetry": result.telemetry.as_dict()}


class K6DiTRunner(_K6Runner):
    """The DiT exactly as the Pipeline builds it (so whatever runtime the Pipeline uses is what is timed), fed
    synthetic inputs of the request's shapes."""

    def load(self) -> None:
        g = self.spec.geometry
        # The decoders load too (they take no part in a DiT forward): building the Pipeline is what guarantees
        # the DiT timed is the one a request runs, residency plan and weight streaming included.
        self.pipe = self._pipeline()
        audio_len = audio_tokens(self.pipe.ckpt.root, g)
        self.inputs = dit_inputs(self.pipe.ckpt.dit, g, audio_len, self.device, self.dtype, self.spec.seed)

    def _stream_timings(self, telemetry) -> None:
        streamer = self.pipe.runtime.streamer
        if streamer is not None:
            telemetry.add_stream_step(streamer.collect_timings())

    def run(self) -> dict[str, Any]:
        return time_call(self.device, "dit_forward", lambda: self.pipe.dit(**self.inputs), self._stream_timings)


class K6BlockRunner(_K6Runner):
    """Fused block 0's weights through `k6fast.dit.blocks.fused_block` with the arm's backend (the switches'
    attention and GEMM dispatch). Per-block and per-step policies (exact attention on the first blocks and steps)
    are told this is a middle block of step 1, so the block is timed on the path most blocks take."""

    def load(self) -> None:
        from ..checkpoint import open_checkpoint
        from ..dit.backend import SwitchedBackend
        from ..dit.config import block_prefix
        from ..dit.weights import PrefixView
        from ..safetensors_index import index_safetensors
        from ..stream.reader import FileReader, upload

        prepare_pipeline_process(self.options, self.device)  # before the backend imports flash-attn-4
        ckpt = open_checkpoint(self.spec.model)
        prefix = block_prefix(0)
        index = index_safetensors(ckpt.transformer_files)
        reader = FileReader({loc.file for loc in index.values()})
        try:
            # The runtime's own read path: quantized checkpoints come back with their scales bound.
            locations = [loc for name, loc in sorted(index.items()) if name.startswith(prefix)]
            tensors = upload(reader, locations, self.device, self.dtype)
        finally:
            reader.close()
        self.cfg, self.weights = ckpt.dit, PrefixView(tensors, prefix)
        self.backend = SwitchedBackend(self.options, self.device)
        self.policy_position = {"step": 1, "block": ckpt.dit.num_visual_blocks // 2}
        audio_len = audio_tokens(ckpt.root, self.spec.geometry)
        self.inputs = block_inputs(ckpt.dit, self.spec.geometry, audio_len, self.device, self.dtype, self.spec.seed)

    def run(self) -> dict[str, Any]:
        from ..dit.blocks import fused_block

        inp = self.inputs
        self.backend.begin_step(self.policy_position["step"])
        self.backend.begin_block(self.policy_position["block"], self.cfg.num_visual_blocks)
        args = (self.backend, self.cfg, self.weights, inp.vis, inp.aud, inp.shared)
        result = time_call(self.device, "block", lambda: fused_block(*args))
        result["policy_position"] = self.policy_position
        return result


def make_runner(spec: VisitSpec) -> Runner:
    from .peers import is_peer, peer_runner

    if is_peer(spec.arm):
        runner = peer_runner(spec)
        if runner.budget_gb:  # the same allocator cap the k6fast arms run under
            cap_device_memory(runner.device, runner.budget_gb)
        return runner
    from ..switches import load_options

    options = load_options(environ=spec.switches, arm=spec.arm)
    cls = {"pipeline": K6Pipeline, "dit": K6DiTRunner, "block": K6BlockRunner}[spec.component]
    return cls(spec, options)


def run_visit(spec: VisitSpec) -> dict[str, Any]:
    """Load the arm, warm up, time the requests; returns the visit's record."""
    device = spec.resolved_device()
    ready = time.perf_counter()
    with RssSampler() as rss:
        runner = make_runner(spec)
        load_start = time.perf_counter()
        runner.load()
        sync(device)
        load_s = time.perf_counter() - load_start
        load_vram = peak_vram(device)
        warmups = [runner.run() for _ in range(spec.warmup)]
        requests = [runner.run() for _ in range(spec.requests)]
    runs = [r["telemetry"] for r in warmups + requests]
    vram = [load_vram["allocated"]] + [t.get("peak_vram_bytes", 0) for t in runs]
    reserved = [load_vram["reserved"]] + [t.get("peak_vram_reserved_bytes", 0) for t in runs]
    return {
        "schema": SCHEMA,
        "session": spec.session,
        "visit": spec.visit,
        "position": spec.position,
        "repeat": spec.repeat,
        "arm": spec.arm,
        "component": spec.component,
        "geometry": spec.geometry.label(),
        "steps": spec.steps,
        "guidance": spec.guidance,
        "seed": spec.seed,
        "dtype": str(spec.resolved_dtype()).removeprefix("torch."),
        "import_s": ready - _STARTED,
        "load_s": load_s,
        "warmup": warmups,
        "requests": requests,
        "seconds": [r["seconds"] for r in requests],
        "peak_vram_bytes": max(vram),
        "peak_vram_reserved_bytes": max(reserved),
        "peak_rss_anon_bytes": rss.peak,
        "rss_anon_end_bytes": rss.end,
        "environment": environment(device),
        "provenance": runner.describe(),
        "argv": sys.argv,
        "command": spec.command,
        "spec": spec.as_dict(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k6fast.bench.visit", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="visit spec JSON written by `k6fast bench`")
    parser.add_argument("--out", required=True, help="where to write this visit's JSON record")
    args = parser.parse_args(argv)
    configure_allocator_environment()  # as `k6fast generate` does, before CUDA starts
    spec = VisitSpec.from_dict(json.loads(Path(args.spec).read_text()))
    try:
        record = run_visit(spec)
    except Exception as exc:
        write_json(
            Path(args.out),
            {
                "schema": SCHEMA,
                "visit": spec.visit,
                "arm": spec.arm,
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
                "argv": sys.argv,
            },
        )
        traceback.print_exc()
        return 1
    write_json(Path(args.out), record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
