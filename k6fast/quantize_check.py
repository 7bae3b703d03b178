"""What `k6fast quantize` checks before it reads a tensor: the format, SRC a checkpoint not yet converted, DST missing
or empty and outside SRC. Imports no PyTorch, so the command line refuses a bad call at once; `quantize.py` runs the
same check for its library callers, then the copy."""

from __future__ import annotations

from pathlib import Path

from .checkpoint import Checkpoint, CheckpointError, open_checkpoint
from .dit.config import QUANT_FORMATS


def check_source_and_destination(src: str | Path, dst: str | Path) -> tuple[Checkpoint, Path]:
    """(SRC opened, DST as a path) for every format `k6fast quantize` writes: SRC a BF16 checkpoint neither quantized
    nor compressed, DST missing or empty and outside SRC. Raises CheckpointError for a missing, invalid or already
    converted SRC or a DST inside it, and FileExistsError for a DST that is a file or a non-empty directory."""
    src, dst = Path(src).expanduser(), Path(dst).expanduser()
    if not src.is_dir():
        raise CheckpointError(f"quantize: SRC {src} is not a checkpoint directory")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        kind = "a non-empty directory" if dst.is_dir() else "a file"
        raise FileExistsError(f"quantize: expected a missing or empty directory for DST, found {kind}: {dst}")
    if dst.resolve().is_relative_to(src.resolve()):
        raise CheckpointError(f"quantize: DST {dst} lies inside SRC {src}; write it elsewhere")
    ckpt = open_checkpoint(src)
    stored = ckpt.quantization or ckpt.compression
    if stored is not None:
        raise CheckpointError(f"quantize: SRC {src} is already stored as {stored}; start from bf16")
    return ckpt, dst


def check_quantize(src: str | Path, dst: str | Path, fmt: str) -> tuple[Checkpoint, Path]:
    """`check_source_and_destination` for a quantized format; ValueError for an unknown one."""
    if fmt not in QUANT_FORMATS:
        raise ValueError(f"quantize: expected --format one of {', '.join(QUANT_FORMATS)}, found {fmt!r}")
    return check_source_and_destination(src, dst)
