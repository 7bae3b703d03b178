"""DF11's ratio on trained weights beside Gaussian weights of the same per-tensor scale (issue #38: how the synthetic
checkpoint's exponent statistics compare with trained weights', and what that means for the ratio).

Every tensor of a safetensors file of at least --min-elements (default: the size from which `k6fast quantize --format
df11` compresses; a float32 or float16 tensor rounded to bfloat16 first: the rounding keeps the exponents, which are
what DF11 codes) is
encoded with `df11.encode` (checked bit for bit by its own decode), beside its exponent entropy; its Gaussian twin
(the same shape, normal with the tensor's own standard deviation, seeded) the same way. The synthetic checkpoint's
weights are such Gaussians (`k6fast make-synthetic`). CPU only.

Run:  python measurements/df11_ratio_trained.py --safetensors MODEL.safetensors --out df11_trained.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from k6fast.df11 import MAX_DIMS, MIN_ELEMENTS, encode, exponent_entropy_bits


def measure(t: torch.Tensor) -> dict:
    blob = encode(t, check=True)
    return {
        "ratio": round(blob.nbytes / (t.numel() * 2), 4),
        "entropy_bits": round(exponent_entropy_bits(t), 3),
        "bytes": int(blob.nbytes),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--safetensors", type=Path, required=True)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--min-elements",
        type=int,
        default=MIN_ELEMENTS,
        help="the smallest tensor measured (default: "
        "the writer's, df11.MIN_ELEMENTS; a small model's layers may all be below it)",
    )
    args = ap.parse_args(argv)
    gen = torch.Generator().manual_seed(args.seed)
    rows, totals = [], {"bf16_bytes": 0, "trained_bytes": 0, "gaussian_bytes": 0}
    for name, tensor in sorted(load_file(args.safetensors).items()):
        if not tensor.is_floating_point():
            continue
        t = tensor.to(torch.bfloat16)
        if t.numel() < args.min_elements or t.ndim > MAX_DIMS:
            continue
        std = t.float().std().item()
        twin = (torch.randn(t.shape, generator=gen) * std).to(torch.bfloat16)
        trained, gaussian = measure(t), measure(twin)
        rows.append({"name": name, "shape": list(t.shape), "std": round(std, 5), "trained": trained,
                     "gaussian": gaussian})  # fmt: skip
        totals["bf16_bytes"] += t.numel() * 2
        totals["trained_bytes"] += trained["bytes"]
        totals["gaussian_bytes"] += gaussian["bytes"]
    summary = {
        "file": str(args.safetensors),
        "tensors": len(rows),
        "bf16_gb": round(totals["bf16_bytes"] / 1e9, 4),
        "ratio_trained": round(totals["trained_bytes"] / totals["bf16_bytes"], 4),
        "ratio_gaussian": round(totals["gaussian_bytes"] / totals["bf16_bytes"], 4),
        "torch": torch.__version__,
    }
    print(json.dumps(summary, indent=1))
    for r in rows:
        print(f"{r['name']:<60} {str(r['shape']):<14} trained {r['trained']['ratio']:.4f} "
              f"({r['trained']['entropy_bits']:.2f} b)  gaussian {r['gaussian']['ratio']:.4f} "
              f"({r['gaussian']['entropy_bits']:.2f} b)")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "tensors": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
