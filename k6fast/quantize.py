"""`k6fast quantize --format fp8|mxfp8|nvfp4 SRC DST`: a copy of a checkpoint whose fused-block linear weights are
stored quantized, so that streaming a block moves 0.5x (fp8), 0.52x (mxfp8) or 0.28x (nvfp4) of its bf16 bytes over
PCIe. Lossy.

What DST holds: every file of SRC outside the transformer's weights and config, hard-linked (copied where SRC and DST
are on different filesystems; hard links share the source's inode, so nothing in DST is modified after linking), and
a transformer whose shards (one per source shard, same names) store, for every quantized layer (M = E4M3_MAX, e4m3's
largest value, `k6fast/kernels/formats.py`):
  fp8    <layer>.weight        F8_E4M3 [N, K]      e4m3 of w / weight_scale, per output channel (`quantize_weight_fp8`)
         <layer>.weight_scale  F32 [N]             absmax(w[n]) / M
  mxfp8  <layer>.weight        F8_E4M3 [N, K]      e4m3 of w / 2^(scale - 127), per 32 elements along K
         <layer>.weight_scale  U8 [N, K/32]        e8m0 biased exponents, 127 + ceil(log2(block amax / M))
                                                   (torchao's MX quantization, `k6fast/kernels/blockscaled.py`)
  nvfp4  <layer>.weight        U8 [N, K/2]         two E2M1 codes a byte, element 2i in the low nibble
         <layer>.weight_scale  F8_E4M3 [N, K/16]   per 16 elements along K (`k6fast/kernels/nvfp4.py` has the recipe)
         <layer>.weight_scale_2 F32 []             amax(|w|) / (M · 6)
and `transformer/config.json` gains `"k6fast_quantization": {"format": ..., "version": 1}`. diffusers ignores that
key with a warning (it cannot load the quantized tensors anyway); k6fast's `open_checkpoint` validates shapes and
dtypes against it and the runtime streams the stored bytes as they are.

Quantized layers: the fused blocks' linear weights that `LinearDispatch` would hand a fast GEMM (not modulation,
time or pooled-text layers; N and K multiples of 16, and K of 32 for mxfp8 and nvfp4). Scales are stored row-major;
the block-scaled GEMM swizzles them per call (see `k6fast/dit/config.py`). Biases, norms, modulation, the text
blocks, embeddings and heads stay as stored: a fraction of a percent of the streamed bytes.

How: tensor by tensor (one weight in memory at a time, read with pread), each shard's header planned first and every
tensor written at its offset; DST is built in a hidden folder beside it and renamed into place, so an interrupted run
leaves nothing behind. A non-empty DST is refused before any work.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from .dit.config import BLOCK_PREFIX, QUANT_CONFIG_KEY, QUANT_VERSION, quantized_layer, quantized_tensors
from .memory import GiB
from .safetensors_index import ITEMSIZE, TensorLocation, file_tensors

WEIGHT_STEM = "diffusion_pytorch_model"
_TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
COPY_CHUNK = 16 << 20


@dataclass
class QuantizeReport:
    """Bytes of the transformer's weights before and after; `block_*` counts every fused-block tensor (what a
    streamed block moves), `quantized_*` only the layers that were quantized (with their scales after)."""

    fmt: str
    layers: int = 0
    block_before: int = 0
    block_after: int = 0
    quantized_before: int = 0
    quantized_after: int = 0
    total_before: int = 0
    total_after: int = 0
    shards: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        def ratio(after: int, before: int) -> str:
            return f"{after / before:.3f}x" if before else "n/a"

        return [
            f"quantized {self.layers} fused-block linear weights to {self.fmt}: {_gib(self.quantized_before)} -> "
            f"{_gib(self.quantized_after)} ({ratio(self.quantized_after, self.quantized_before)})",
            f"fused blocks (what a streamed block moves): {_gib(self.block_before)} -> {_gib(self.block_after)} "
            f"({ratio(self.block_after, self.block_before)})",
            f"transformer weights: {_gib(self.total_before)} -> {_gib(self.total_after)} "
            f"({ratio(self.total_after, self.total_before)})",
        ]


def _gib(n: int) -> str:
    return f"{n / GiB:.3f} GiB" if n >= 2**24 else f"{n / 2**20:.3f} MiB"


def _sources(path: Path) -> list[TensorLocation]:
    return sorted(file_tensors(path), key=lambda s: s.offset)  # sequential reads


def _pread_exact(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise OSError(f"short read at byte {offset + done}")
        done += n


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def _tensor_bytes(t: Tensor) -> memoryview:
    """The little-endian bytes of a CPU tensor (0-d included)."""
    return memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def quantize_weight(w: Tensor, fmt: str) -> dict[str, Tensor]:
    """w: [N, K] bf16/fp16/fp32 → the stored tensors by suffix ("" = the weight, "_scale", "_scale_2")."""
    if fmt == "fp8":
        from .kernels.fp8_linear import quantize_weight_fp8

        wq, scale = quantize_weight_fp8(w.contiguous())
        return {"": wq, "_scale": scale.reshape(-1)}
    if fmt == "mxfp8":
        from .kernels.blockscaled import quantize_weight as quantize_blockscaled

        wq, scale, _ = quantize_blockscaled(w.contiguous(), "mxfp8")
        return {"": wq, "_scale": scale}
    from .kernels.nvfp4 import quantize_nvfp4

    packed, block_scales, global_scale = quantize_nvfp4(w)
    return {"": packed, "_scale": block_scales, "_scale_2": global_scale}


def _write_shard(src: Path, dst: Path, fmt: str, device: torch.device, report: QuantizeReport) -> dict[str, str]:
    """Write the quantized copy of one shard; returns its weight map (tensor name → file name)."""
    sources = _sources(src)
    # Plan: every output tensor with its dtype and shape, laid out by descending item size (then name) as the
    # safetensors serializer does, so each tensor starts aligned to its item size once the header is padded to 8.
    planned: dict[str, tuple[str, tuple[int, ...]]] = {}
    quantize = set()
    for s in sources:
        if s.dtype in _TORCH_DTYPES and quantized_layer(s.name, s.shape, fmt):
            quantize.add(s.name)
            for name, (shape, dtype) in quantized_tensors(s.name, s.shape, fmt).items():
                planned[name] = (dtype, shape)
        else:
            planned[s.name] = (s.dtype, s.shape)
    offsets, at = {}, 0
    for name in sorted(planned, key=lambda n: (-ITEMSIZE[planned[n][0]], n)):
        dtype, shape = planned[name]
        size = ITEMSIZE[dtype] * int(torch.Size(shape).numel())
        offsets[name] = (at, at + size)
        at += size
    header = {"__metadata__": {"format": "pt", QUANT_CONFIG_KEY: fmt}}
    header.update({n: {"dtype": planned[n][0], "shape": list(planned[n][1]), "data_offsets": list(offsets[n])}
                   for n in sorted(planned)})  # fmt: skip
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    base = 8 + len(raw)

    src_fd = os.open(src, os.O_RDONLY)
    dst_fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        _pwrite_all(dst_fd, memoryview(struct.pack("<Q", len(raw)) + raw), 0)
        os.ftruncate(dst_fd, base + at)
        for s in sources:
            in_block = s.name.startswith(BLOCK_PREFIX)
            report.total_before += s.nbytes
            report.block_before += s.nbytes if in_block else 0
            if s.name in quantize:
                buf = bytearray(s.nbytes)
                _pread_exact(src_fd, memoryview(buf), s.offset)
                w = torch.frombuffer(buf, dtype=torch.uint8).view(_TORCH_DTYPES[s.dtype]).view(s.shape)
                after = 0
                for suffix, t in quantize_weight(w.to(device), fmt).items():
                    start, end = offsets[s.name + suffix]
                    data = _tensor_bytes(t)
                    if len(data) != end - start:
                        raise RuntimeError(f"{s.name}{suffix}: quantized to {len(data)} bytes, planned {end - start}")
                    _pwrite_all(dst_fd, data, base + start)
                    after += len(data)
                report.layers += 1
                report.quantized_before += s.nbytes
                report.quantized_after += after
            else:
                after = s.nbytes
                start = offsets[s.name][0]
                buf = bytearray(min(COPY_CHUNK, max(s.nbytes, 1)))
                for pos in range(0, s.nbytes, COPY_CHUNK):
                    chunk = memoryview(buf)[: min(COPY_CHUNK, s.nbytes - pos)]
                    _pread_exact(src_fd, chunk, s.offset + pos)
                    _pwrite_all(dst_fd, chunk, base + start + pos)
            report.total_after += after
            report.block_after += after if in_block else 0
        os.fsync(dst_fd)
    finally:
        os.close(src_fd)
        os.close(dst_fd)
    report.shards.append(dst.name)
    return dict.fromkeys(planned, dst.name)


def _link_or_copy(src: Path, dst: Path) -> None:
    real = src.resolve()  # Hub snapshots hold symlinks into a blob store: link the blob, not the symlink
    try:
        os.link(real, dst)
    except OSError:
        shutil.copy2(real, dst)


def _build_beside(dst: Path, build: Callable[[Path], None]) -> None:
    """Run `build(tmp)` in a hidden folder beside `dst`, then rename it to `dst` (missing or empty). Unlike
    `atomic.build_dir_atomically`, file modes are left alone: a chmod through a hard link would change SRC's file."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        build(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700; a checkpoint is shared data
        os.replace(tmp, dst)  # replaces an empty directory atomically; one filled meanwhile makes it fail
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_transformer_copy(
    root: Path,
    dst: Path,
    write_shard: Callable[[Path, Path], dict[str, str]],
    config_entry: tuple[str, dict],
    total_after: Callable[[], int],
    log: Callable[[str], None],
) -> None:
    """DST = the checkpoint at `root` with its transformer's weight shards rewritten: every other file hard-linked (or
    copied), `write_shard(src_shard, dst_shard)` writing each shard and returning its {tensor name: file name}, the
    shard index's total size from `total_after()` once all are written, `config_entry` (key, value) added to the
    transformer's config.json. Built beside DST, opened (it must validate), then renamed into place."""
    from .checkpoint import COMPONENTS, CheckpointError, open_checkpoint, weight_files

    transformer = root / "transformer"
    weights = set(weight_files(transformer, WEIGHT_STEM))
    index_name = f"{WEIGHT_STEM}.safetensors.index.json"
    rewritten = weights | {transformer / "config.json", transformer / index_name}

    def build(tmp: Path) -> None:
        # followlinks: a component folder may be a link (text encoders kept on another disk); a link to a folder
        # above it (a loop) is left out.
        for folder, dirs, files in os.walk(root, followlinks=True):
            rel = Path(folder).relative_to(root)
            if Path(folder).resolve() in {(root / up).resolve() for up in rel.parents}:
                dirs[:] = []
                continue
            dirs[:] = [d for d in dirs if not (rel == Path() and d == ".cache")]  # huggingface-cli's download cache
            (tmp / rel).mkdir(exist_ok=True)
            for name in files:
                if Path(folder) / name not in rewritten:
                    _link_or_copy(Path(folder) / name, tmp / rel / name)
        lost = [name for name in COMPONENTS if (root / name).is_dir() and not (tmp / name).is_dir()]
        if lost:  # before the shards' minutes of work, not at the copy's validation after them
            raise CheckpointError(f"could not copy the component folders {lost} of {root}")
        weight_map: dict[str, str] = {}
        for shard in sorted(weights):
            weight_map.update(write_shard(shard, tmp / "transformer" / shard.name))
            log(f"wrote transformer/{shard.name}")
        if (transformer / index_name).is_file():
            index = {"metadata": {"total_size": total_after()}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / "transformer" / index_name).write_text(json.dumps(index, indent=2) + "\n")
        config = json.loads((transformer / "config.json").read_text())
        config[config_entry[0]] = config_entry[1]
        (tmp / "transformer" / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        open_checkpoint(tmp)  # the copy must validate (each compressed blob against its length) before it is published

    _build_beside(dst, build)


def quantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    fmt: str,
    *,
    device: str | torch.device = "cpu",
    log: Callable[[str], None] = print,
) -> QuantizeReport:
    """Write DST = SRC with its fused-block linear weights quantized to `fmt` ("fp8", "mxfp8" or "nvfp4"); see the
    module docstring for the stored names. `device` runs the quantization (cuda is faster; the bits are the same).

    Raises ValueError for an unknown format, CheckpointError for a missing, invalid or already quantized SRC, and
    FileExistsError for a DST that is a file or a non-empty directory."""
    from .quantize_check import check_quantize

    ckpt, dst = check_quantize(src, dst, fmt)
    device = torch.device(device)
    report = QuantizeReport(fmt)
    write_transformer_copy(
        ckpt.root, dst, lambda shard, out: _write_shard(shard, out, fmt, device, report),
        (QUANT_CONFIG_KEY, {"format": fmt, "version": QUANT_VERSION}), lambda: report.total_after, log,
    )  # fmt: skip
    for line in report.lines():
        log(line)
    log(f"wrote {dst}")
    return report
