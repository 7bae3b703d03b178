"""What the entry points (`k6fast ...`, `python -m k6fast.server`, the server's start-up and a bench visit) set for
their whole process: which warnings reach the terminal, and in what form; the CUDA allocator's settings and its cap at
the VRAM budget; where the kernel compilers keep their caches. Only the entry points call these (a test holds it), so
importing k6fast as a library, or building two pipelines in one process, changes no filter, no logger, no environment
variable, no allocator setting and no `torch.backends` flag.

Deprecation warnings are about the libraries' own code (k6fast issues none), which a user of the command line cannot
act on; an unknown `K6_*` variable is one line naming the switch that was probably meant.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import NoReturn

from .allocator import ENV, SETTING, device_budget, resolve_device, user_chose, with_expandable
from .switches import UnknownSwitchWarning

log = logging.getLogger(__name__)
DEPRECATIONS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)
# Loggers whose warnings concern the libraries' internals at import, nothing k6fast runs: torchao registers enums with
# torch's pytree, which torch calls deprecated; diffusers' torchao quantizer (k6fast quantizes with its own code) says
# it cannot import the tensor types older torchao versions had ("Unable to import `torchao` Tensor objects").
QUIET_LOGGERS = ("torch.utils._pytree", "diffusers.quantizers.torchao.torchao_quantizer")
_DEFAULT_FORMAT = warnings.formatwarning


def _format_warning(message, category, filename, lineno, line=None) -> str:
    if issubclass(category, UnknownSwitchWarning):
        # The default format adds the file, line and source of the warn() call: two lines about k6fast's insides.
        return f"warning: {message}\n"
    return _DEFAULT_FORMAT(message, category, filename, lineno, line)


def quiet_warnings() -> None:
    """Hide deprecation warnings and the loggers above, and show an unknown switch as one `warning:` line. Call it
    first thing in an entry point, before PyTorch is imported; calling it again changes nothing."""
    for category in DEPRECATIONS:
        warnings.filterwarnings("ignore", category=category)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.formatwarning = _format_warning


def configure_allocator_environment() -> None:
    """Before anything touches CUDA: ask the caching allocator for expandable segments (k6fast/allocator.py says
    why), keeping the user's other allocator options and their own expandable-segments choice."""
    conf = with_expandable(os.environ.get(ENV))
    if conf is not None:
        os.environ[ENV] = conf


def configure_compile_caches(path: str | None) -> None:
    """Keep every kernel compiler's cache on disk, so a second start compiles nothing. With `path`
    (K6_INDUCTOR_CACHE_DIR): Inductor's there, Triton's for k6fast's own kernels in `path/triton` and flash-attn-4's
    CuTe DSL kernels in `path/fa4`; without it, each compiler's default place. A variable the user set is kept.
    flash-attn-4's disk cache is off unless asked for, so it is asked for here (its kernels otherwise compile again
    in every process, seconds per shape at W1). The compilers read these variables when they first compile,
    flash-attn-4 when it is imported (a `SwitchedBackend` with K6_EXACT_ATTN_KERNEL=fa4 imports it): call this first."""
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    if not path:
        return
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(path))
    os.environ.setdefault("TRITON_CACHE_DIR", str(Path(path) / "triton"))
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(Path(path) / "fa4"))


def cap_device_memory(device, budget_gb: float) -> None:
    """Cap the CUDA caching allocator on `device` (None: the default device) at the VRAM budget `budget_gb` means
    (`allocator.device_budget`: 0 = what the card has free), so that a larger card behaves like one of the budget's
    size (an H200 like a 32 GB card). Nothing on the CPU."""
    device = resolve_device(device)
    if device.type == "cuda":
        import torch

        total = torch.cuda.mem_get_info(device)[1]
        torch.cuda.set_per_process_memory_fraction(device_budget(device, budget_gb) / total, device)


def expandable_segments_now() -> None:
    """Where CUDA may already run (a server's or a bench's start-up after CUDA started): switch the allocator to
    expandable segments for the segments it creates from now on, unless the user chose otherwise."""
    import torch

    if user_chose(os.environ.get(ENV)) or not torch.cuda.is_available():
        return
    try:
        torch.cuda.memory._set_allocator_settings(SETTING)
    except (AttributeError, RuntimeError) as exc:  # fixed segments: slower to fit, not wrong
        log.warning("could not switch the CUDA allocator to expandable segments (%s); set %s=%s", exc, ENV, SETTING)


# Compiled graphs of the fused block one process may keep: one per geometry it is asked for (Dynamo's default, 8 per
# function, would leave a server's block uncompiled after its eighth size). The prompt's length is a symbol, not a
# graph (k6fast.dit.model).
RECOMPILE_LIMIT = 64


def allow_recompiles_per_geometry(options) -> None:
    """With K6_COMPILE: let Dynamo keep RECOMPILE_LIMIT graphs of a function (the fused block), not its default 8."""
    if options.compile:
        import torch._dynamo.config

        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)


def prepare_pipeline_process(options, device) -> None:
    """Before an entry point builds its `Pipeline` (or a `SwitchedBackend`) with `options` on `device`: the compile
    caches the options name, expandable segments from now on, the allocator capped at the options' VRAM budget
    (the budget the pipeline plans for), and room for a compiled block per geometry. cuDNN keeps its heuristics'
    algorithms (`torch.backends.cudnn.benchmark` off): timing them gained the W1 video decode nothing (4.49 s
    against 4.50 s a call) and cost a process's first audio decode 3-5 s
    (measurements/sessions/2026-12-02_acceptance-envelope2)."""
    configure_compile_caches(options.inductor_cache_dir)
    if resolve_device(device).type == "cuda":
        expandable_segments_now()
    cap_device_memory(device, options.vram_budget_gb)
    allow_recompiles_per_geometry(options)


def end_process(code: int) -> NoReturn:
    """End this process now with exit status `code`, without the interpreter's teardown: PyTorch freeing every pinned
    staging buffer and device tensor one by one, the CUDA context's destruction, the garbage collection of every
    module, the atexit handlers. The kernel releases the memory, the device and the files at exit anyway. Only for the
    very end of an entry point, once every file it wrote is closed (and fsynced, where a crash must not lose it):
    what Python still buffers is flushed here (logging's handlers, stdout, stderr), nothing else."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe: nothing more can reach it
            stream.flush()
    os._exit(code)
