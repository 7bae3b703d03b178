"""The DiT's load apart from the rest of the pipeline: the arguments it is built with, its build with the fallback to
the smallest request's residency, and `DiTAhead`, that build on a thread of its own.

`k6fast generate` starts `DiTAhead` as soon as PyTorch and the CUDA context are up and hands it to
`Pipeline(dit_ahead=...)`, so that the DiT's resident weights cross to the device while diffusers' and transformers'
modules are imported: seconds of Python holding the GIL, beside reads and copies that release it. Nothing here imports
diffusers or transformers: the text phase's device footprint, which the residency plan keeps room for, comes from the
text encoders' config and safetensors headers (`text_plan`), as `TextPhase.device_bytes` computes it.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
import time
from pathlib import Path

import torch

from .allocator import device_budget, resolve_device
from .checkpoint import Checkpoint
from .dit.backend import SwitchedBackend
from .request import SPATIAL_MULTIPLE, W1, dit_tokens
from .stream.host_cache import HostBlockCache
from .stream.plan import ResidencyError
from .stream.reader import COMPUTE_DTYPES
from .stream.runtime import DiTRuntime, build_dit
from .switches import Options
from .text_plan import TEXT_SLOTS, text_footprint, text_weights
from .vae_geometry import AudioRate, audio_rate

logger = logging.getLogger(__name__)

# What Triton imports on a kernel's first compile in a process (triton/runtime/jit.py, compiler/compiler.py,
# backends/nvidia/compiler.py; `triton` itself comes with k6fast's kernels): a DF11 checkpoint's decode kernel
# compiles in the build's thread, so on a GPU these are imported before it starts (see `DiTAhead`).
TRITON_COMPILE_MODULES = ("triton.compiler.code_generator", "triton.language.extra.cuda", "triton.runtime.build")


def import_triton_compiler() -> None:
    """Import `TRITON_COMPILE_MODULES`; a Triton without one of them imports it under another name, on first use."""
    for name in TRITON_COMPILE_MODULES:
        with contextlib.suppress(ModuleNotFoundError):
            importlib.import_module(name)


def compute_dtype(device: torch.device, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a pipeline on `device` computes in: `dtype`, else BF16 on a GPU and FP32 on the CPU."""
    return dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)


def text_device_bytes(root: Path, dtype: torch.dtype) -> int:
    """What `TextPhase(root, device, dtype).device_bytes()` returns (the text phase's peak, planned beside the DiT's
    weights), from the text encoders' config.json and safetensors headers alone; a dtype the text phase refuses is
    refused with its message. tests/test_dit_load.py holds the two equal."""
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"the text phase computes in one of {list(COMPUTE_DTYPES)}, found {dtype}")
    return text_footprint(text_weights(root), COMPUTE_DTYPES[dtype], slots=TEXT_SLOTS).device_bytes


def dit_build_args(
    options: Options, device: torch.device, *, budget_bytes: int, tokens: tuple[int, int], text_bytes: int
) -> dict:
    """`build_dit`'s keyword arguments for a pipeline with `options` on `device` (its kernels resolved for it):
    planned for `tokens` (video, audio) inside `budget_bytes`, with `text_bytes` of room for the text phase."""
    return dict(
        text_bytes=text_bytes,
        budget_bytes=budget_bytes,
        tokens=tokens,
        prefetch=options.prefetch_blocks,
        max_resident=None if options.max_resident_blocks < 0 else options.max_resident_blocks,
        host_cache=options.host_cache_gb,
        backend=SwitchedBackend(options, device),
        compile_blocks=options.compile,
    )


def build_planned_dit(
    ckpt: Checkpoint,
    device: torch.device,
    dtype: torch.dtype,
    args: dict,
    rate: AudioRate,
    host_tier: HostBlockCache | None = None,
    compile_blocks: bool | None = None,
) -> DiTRuntime:
    """`build_dit` of `ckpt`'s transformer with `args` (`dit_build_args`). Where the planned geometry does not fit
    the budget, the residency is planned for the smallest request instead, so that what does fit can run (a
    pipeline's `resolve` refuses the rest, naming what fits): `args`' tokens become that request's, for every later
    build too. compile_blocks: overrides `args`' (None: as they say)."""
    files, cfg = ckpt.transformer_files, ckpt.dit
    chosen = {} if compile_blocks is None else {"compile_blocks": compile_blocks}
    try:
        return build_dit(files, cfg, device, dtype, host_tier=host_tier, **(args | chosen))
    except ResidencyError as exc:
        logger.warning("%s; planning residency for the smallest request instead", exc)
        args["tokens"] = dit_tokens(SPATIAL_MULTIPLE, SPATIAL_MULTIPLE, 1, rate)
        return build_dit(files, cfg, device, dtype, host_tier=host_tier, **(args | chosen))


class DiTAhead:
    """The DiT of a pipeline not yet constructed, built on its own thread: what `Pipeline(ckpt, options, device,
    dtype, plan_geometry)` would build first, with the same arguments (the VRAM budget read now, before the build
    takes any of the card). `Pipeline(..., dit_ahead=...)` takes it (`take`); a caller that ends before it does
    calls `close`, which waits for the thread: it must not run CUDA work through the interpreter's shutdown.

    The thread imports nothing: every module its build needs is imported here, before it starts, and the compile
    wrapper (K6_COMPILE), whose first use imports Dynamo, is put on in `take`: the imports beside the thread import
    Dynamo too, and two threads importing one package's modules in different orders can deadlock (importlib then
    raises in one of them)."""

    def __init__(
        self,
        ckpt: Checkpoint,
        options: Options,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        plan_geometry: tuple[int, int, int] = W1,
    ):
        self.ckpt, self.options, self.plan_geometry = ckpt, options, plan_geometry
        self.device = resolve_device(device)
        self.dtype = compute_dtype(self.device, dtype)
        # In `Pipeline.__init__`'s order, so that a checkpoint with two faults names the same one first.
        self.budget_bytes = device_budget(self.device, options.vram_budget_gb)
        self.audio_rate = audio_rate(ckpt.root)
        tokens = dit_tokens(*plan_geometry, self.audio_rate)
        text_bytes = text_device_bytes(ckpt.root, self.dtype)
        self.args = dit_build_args(options, self.device, budget_bytes=self.budget_bytes, tokens=tokens,
                                   text_bytes=text_bytes)  # fmt: skip
        self._runtime: DiTRuntime | None = None
        self._error: BaseException | None = None
        self._began = self._ended = 0.0
        # A thread starts on CUDA's device 0: it takes this thread's current device, as the build here would.
        current = torch.cuda.current_device() if self.device.type == "cuda" else None
        if current is not None:
            import_triton_compiler()
        self._thread = threading.Thread(target=self._run, args=(current,), name="k6-dit-load", daemon=True)
        self._thread.start()

    def _run(self, cuda_device: int | None) -> None:
        self._began = time.perf_counter()
        try:
            with torch.cuda.device(cuda_device) if cuda_device is not None else contextlib.nullcontext():
                self._runtime = build_planned_dit(self.ckpt, self.device, self.dtype, self.args, self.audio_rate,
                                                  compile_blocks=False)  # fmt: skip
        except BaseException as exc:  # raised again in the caller's thread by `take`, its traceback kept
            self._error = exc
        finally:
            self._ended = time.perf_counter()

    def matches(self, ckpt: Checkpoint, options: Options, device: torch.device, dtype: torch.dtype,
                plan_geometry: tuple[int, int, int]) -> bool:  # fmt: skip
        """Whether this is the DiT a pipeline of these arguments would build."""
        return (ckpt.root, options, device, dtype, tuple(plan_geometry)) == (
            self.ckpt.root, self.options, self.device, self.dtype, tuple(self.plan_geometry)
        )  # fmt: skip

    def take(self) -> tuple[DiTRuntime, float]:
        """Wait for the build: (the runtime, compiled where the options say; the seconds of its build that ran before
        this wait began, beside the caller's own work, at most its parts' `load_s`). The build's error, if it failed,
        is raised here with its traceback."""
        waited = time.perf_counter()
        self._thread.join()
        error, runtime, self._error, self._runtime = self._error, self._runtime, None, None
        if error is not None:
            raise error
        if self.args["compile_blocks"]:
            runtime.dit.compile_blocks()
        beside = max(0.0, min(self._ended, waited) - self._began)
        return runtime, min(beside, sum(runtime.load_s.values()))

    def close(self) -> None:
        """Wait for the build and free what it made (the caller will not take it: it is ending on an error of its
        own, which is the one reported; the build's is dropped)."""
        self._thread.join()
        runtime, self._runtime, self._error = self._runtime, None, None
        if runtime is not None:
            runtime.close()
