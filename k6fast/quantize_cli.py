"""`k6fast quantize`'s command line: its arguments, checked before anything heavy loads (the command itself,
`quantize.py`, imports PyTorch)."""

from __future__ import annotations

import argparse

from .cli_args import no_gpu_device_files
from .df11_header import COMPRESSION_FORMATS
from .dit.config import QUANT_FORMATS


def _device_arg(text: str) -> str:
    """--device: cpu, cuda or cuda:N, refused at parse time where CUDA is missing (the command line's own error).
    Imports torch only for a CUDA device, the one answer that needs it."""
    if not text.startswith("cuda"):
        return text
    unavailable = no_gpu_device_files()  # no GPU device files: no driver can find one, and PyTorch need not load
    if not unavailable:
        import torch

        unavailable = not torch.cuda.is_available()
    if unavailable:
        raise argparse.ArgumentTypeError(f"{text}: CUDA is not available here; use --device cpu")
    return text


def cmd_quantize(args: argparse.Namespace) -> int:
    if args.format in COMPRESSION_FORMATS:
        from .df11_checkpoint import check_compress, compress_checkpoint

        check_compress(args.src, args.dst)  # before PyTorch loads: a bad SRC or DST fails at once
        compress_checkpoint(args.src, args.dst, device=args.device)
        return 0
    from .quantize_check import check_quantize

    check_quantize(args.src, args.dst, args.format)  # before PyTorch loads: a bad SRC or DST fails at once
    from .quantize import quantize_checkpoint

    quantize_checkpoint(args.src, args.dst, args.format, device=args.device)
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    """Add `quantize` to the k6fast command line."""
    p = subparsers.add_parser(
        "quantize",
        help="copy a checkpoint with its fused-block linear weights stored fp8, mxfp8 or nvfp4 (lossy; fewer "
        "streamed bytes)",
        description="Write DST, a copy of the Diffusers-layout checkpoint SRC whose fused-block linear weights are "
        "stored quantized (fp8: e4m3 + per-channel scale, 0.5x the bytes; mxfp8: e4m3 + an e8m0 scale per 32, "
        "0.52x; nvfp4: E2M1 + e4m3 per-16 scales + a global scale, 0.28x). Other files are hard-linked. The runtime "
        "runs those layers from the stored format whatever K6_GEMM says (fp8: an FP8 GEMM on sm_89+; mxfp8: the "
        "block-scaled MXFP8 GEMM on sm_100/sm_120; nvfp4: the block-scaled NVFP4 GEMM there with K6_GEMM=nvfp4); "
        "elsewhere they are dequantized on the GPU, then bf16.",
    )
    p.add_argument(
        "--format",
        required=True,
        choices=QUANT_FORMATS + COMPRESSION_FORMATS,
        help="fp8 (FP8 GEMM on sm_89+), mxfp8 (block-scaled GEMM on sm_100/sm_120; needs torchao) or nvfp4, each "
        "dequantized where its GEMM does not run; or df11: lossless, the BF16 transformer's exponents Huffman-coded "
        "(decoded on the GPU)",
    )
    p.add_argument("src", help="source checkpoint directory (bf16, Diffusers layout)")
    p.add_argument("dst", help="output directory (must be missing or empty)")
    p.add_argument(
        "--device",
        default="cpu",
        type=_device_arg,
        help="where to quantize or compress: cpu (default) or cuda (faster, same bits)",
    )
    p.set_defaults(func=cmd_quantize)
    return p
