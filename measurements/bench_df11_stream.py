"""DF11 in the weight stream: a DiT forward with every fused block streamed, from a BF16 transformer and from its DF11
copy (blobs decoded on the GPU as each block's views are made), same weights, same inputs.

The transformer: the synthetic Pro-distill one (`k6fast make-synthetic`'s initialiser) with `--blocks` fused blocks,
written as one safetensors file under --dir (about 2.2 GB + 0.96 GB a block), and its DF11 copy written by the
checkpoint writer's shard function on the GPU (its GB/s is reported: the write path). Both files are read from the
page cache (just written: the free-host case). Outputs are compared bit for bit first, then the forward is timed
(wall, synchronised, p20/p50/p80 over --repeats after one warm-up) at W1's token counts.

Run:  python measurements/bench_df11_stream.py --out df11_stream.json --dir /tmp/df11-stream [--blocks 4]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_common import environment, wall_seconds  # noqa: E402

from k6fast import df11  # noqa: E402
from k6fast.df11_checkpoint import CompressReport, _write_shard  # noqa: E402
from k6fast.dit.config import DiTConfig, expected_shapes  # noqa: E402
from k6fast.stream.runtime import build_dit  # noqa: E402

W1_LATENT = (31, 60, 108)  # latent frames, height, width of 864x480, 121 frames
W1_AUDIO = 218
TEXT_TOKENS = 128


def write_transformer(folder: Path, blocks: int, seed: int) -> tuple[DiTConfig, Path]:
    from safetensors.torch import save_file

    from k6fast.testing.synthetic import _init_tensor, transformer_config

    cfg = DiTConfig.from_dict(transformer_config("pro-distill", blocks))
    g = torch.Generator().manual_seed(seed)
    tensors = {name: _init_tensor(name, shape, g, "cpu") for name, shape in expected_shapes(cfg).items()}
    path = folder / "bf16.safetensors"
    save_file(tensors, path)
    return cfg, path


def inputs(cfg: DiTConfig, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    b = torch.bfloat16
    return dict(
        hidden_states=torch.randn(1, *W1_LATENT, cfg.visual_in_channels, generator=g, device="cuda", dtype=b),
        encoder_hidden_states=torch.randn(1, TEXT_TOKENS, cfg.in_text_dim, generator=g, device="cuda", dtype=b),
        pooled_projections=torch.randn(1, cfg.in_text_dim2, generator=g, device="cuda", dtype=b),
        timestep=torch.tensor([500.0], device="cuda"),
        audio_hidden_states=torch.randn(1, W1_AUDIO, cfg.in_audio_dim, generator=g, device="cuda", dtype=b),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dir", required=True, help="a folder for the two transformer files (removed afterwards)")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA device; none found", file=sys.stderr)
        return 2
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=False)
    try:
        cfg, bf16_file = write_transformer(folder, args.blocks, args.seed)
        report = CompressReport()
        start = time.perf_counter()
        _write_shard(bf16_file, folder / "df11.safetensors", "cuda", df11.MIN_ELEMENTS, report)
        write_s = time.perf_counter() - start
        tokens = (W1_LATENT[0] * W1_LATENT[1] * W1_LATENT[2] // 4, W1_AUDIO)
        x = inputs(cfg, args.seed)
        results, outputs = {}, {}
        for name, file in (("bf16", bf16_file), ("df11", folder / "df11.safetensors")):
            rt = build_dit([file], cfg, torch.device("cuda"), torch.bfloat16, budget_bytes=1 << 40, tokens=tokens,
                           max_resident=0, prefetch=1)  # fmt: skip
            try:
                with torch.no_grad():
                    outputs[name] = [t.clone() for t in rt.dit(**x)]
                    samples = wall_seconds(lambda rt=rt: rt.dit(**x), args.repeats)
            finally:
                rt.close()
            p20, p50, p80 = np.percentile(samples, [20, 50, 80])
            results[name] = {"file_bytes": file.stat().st_size, "p20_s": p20, "p50_s": p50, "p80_s": p80}
            print(f"{name}: forward p50 {p50:.3f} s ({file.stat().st_size / 1e9:.2f} GB file)", flush=True)
        exact = all(torch.equal(a, b) for a, b in zip(outputs["bf16"], outputs["df11"], strict=True))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result = {
        "blocks": args.blocks,
        "streamed_blocks": args.blocks,
        "tokens": list(tokens),
        "bit_identical": exact,
        "write_gbps": report.total_before / write_s / 1e9,
        "ratio_file": results["df11"]["file_bytes"] / results["bf16"]["file_bytes"],
        "forward": results,
        "df11_over_bf16": results["df11"]["p50_s"] / results["bf16"]["p50_s"],
    }
    Path(args.out).write_text(json.dumps({"environment": environment(), "results": result}, indent=2) + "\n")
    print(f"bit-identical {exact}; df11/bf16 forward {result['df11_over_bf16']:.4f}; file ratio "
          f"{result['ratio_file']:.4f}; write {result['write_gbps']:.3f} GB/s; wrote {args.out}")  # fmt: skip
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
