"""What the entry points (`k6fast ...` and `python -m k6fast.server`) set for their whole process: which warnings
reach the terminal, and in what form. Nothing else calls `quiet_warnings`, so importing k6fast as a library changes
no filter, no logger and no warning format.

Deprecation warnings are about the libraries' own code (k6fast issues none), which a user of the command line cannot
act on; an unknown `K6_*` variable is one line naming the switch that was probably meant.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from typing import NoReturn

from .switches import UnknownSwitchWarning

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
