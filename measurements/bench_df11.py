"""DF11 on one Pro fused block: compression ratio, encode GB/s (CPU), decode GB/s on the GPU, nvCOMP beside it.

The block: every tensor of one Pro-distill fused block, Gaussian BF16 at the per-tensor scales of the synthetic
checkpoint (`k6fast make-synthetic`'s initialiser: std 1/sqrt(3·fan_in), zero biases, unit norms), or block
`--block` of a real checkpoint with `--checkpoint DIR`. Reported:
  ratio        compressed / BF16 bytes of the tensors the writer compresses (`df11.compressible`) and per tensor,
               beside the exponent-entropy bound (8 + H) / 16; and of the whole block with the small tensors raw
  encode       GB/s (BF16 bytes in) of the block's compressible tensors: encode alone on the CPU, encode + decode_ref
               check (the write path of `k6fast quantize`) on the CPU and on the GPU
  decode       every tensor decoded on the GPU by `kernels.df11_decode.decode` and compared with the original bit
               for bit first; then the whole block's decode timed (p20/p50/p80, GB/s of BF16 written), against the
               block's BF16 compute time from a record (see BLOCK_RECORD) and the pinned H2D copy of both forms
  nvcomp       if `from nvidia import nvcomp` imports: its ANS and Bitcomp codecs on the same block bytes (ratio,
               exactness, decode GB/s)
One JSON record (--out) and a printed table. About a minute on an H200 host.

Run:  python measurements/bench_df11.py --out df11.json [--checkpoint DIR --block 0] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_common import environment  # noqa: E402

from k6fast import df11  # noqa: E402
from k6fast.dit.config import DiTConfig, fused_block_shapes  # noqa: E402
from k6fast.kernels.df11_decode import decode  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# The block's BF16 compute time: one Pro fused block at W1, resident, the exact fused + compiled arm.
BLOCK_RECORD = ("measurements/sessions/2026-12-01_attention-benches/block_arms.json", "fused+compile")
NVCOMP_CODECS = [("ANS", {"data_type": "<f2"}), ("ANS", {"data_type": "|u1"}), ("Bitcomp", {"data_type": "<u2"}),
                 ("Bitcomp", {"data_type": "|u1"})]  # fmt: skip


def synthetic_block(seed: int) -> dict[str, torch.Tensor]:
    from k6fast.testing.synthetic import _init_tensor, transformer_config

    cfg = DiTConfig.from_dict(transformer_config("pro-distill", 1))
    g = torch.Generator().manual_seed(seed)
    return {name: _init_tensor(name, shape, g, "cpu") for name, shape in fused_block_shapes(cfg).items()}


def checkpoint_block(path: str, block: int) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    from k6fast.checkpoint import open_checkpoint

    ckpt = open_checkpoint(path)
    prefix = f"visual_transformer_blocks.{block}."
    out = {}
    for file in ckpt.transformer_files:
        with safe_open(file, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if name.startswith(prefix):
                    out[name[len(prefix) :]] = f.get_tensor(name)
    if not out:
        raise SystemExit(f"error: no tensors under {prefix} in {path}")
    return out


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def encode_all(tensors: dict[str, torch.Tensor], check: bool, device: str) -> tuple[dict, float]:
    """Every tensor's blob, encoded on `device` (with the decode_ref check there if `check`), and the seconds taken."""
    start = time.perf_counter()
    blobs = {k: df11.encode(t, check=check, device=device) for k, t in tensors.items()}
    if device == "cuda":
        torch.cuda.synchronize()
    return blobs, time.perf_counter() - start


def quantiles(samples_s: list[float]) -> dict[str, float]:
    p20, p50, p80 = np.percentile(np.asarray(samples_s) * 1e3, [20, 50, 80])
    return {"p20_ms": float(p20), "p50_ms": float(p50), "p80_ms": float(p80)}


def timed(fn, repeats: int) -> dict[str, float]:
    """CUDA-event times of fn() after one warm-up."""
    fn()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return quantiles(samples)


def bench_nvcomp(raw: torch.Tensor, repeats: int) -> list[dict]:
    """raw: uint8 [bytes] on the GPU (the block's BF16 bytes back to back)."""
    try:
        from nvidia import nvcomp
    except ImportError as exc:
        return [{"codec": "nvcomp", "error": f"not importable: {exc}"}]
    rows = []
    for algorithm, options in NVCOMP_CODECS:
        row = {"codec": f"nvcomp {algorithm} {options.get('data_type', '')}", "version": nvcomp.__version__}
        log(f"{row['codec']}")
        try:
            codec = nvcomp.Codec(algorithm=algorithm, **options)
            # The codec's data type says how it reads the bytes (BF16 bits as fp16 words, 16-bit or 8-bit integers).
            view = {"<f2": raw.view(torch.float16), "<u2": raw.view(torch.uint16)}.get(options["data_type"], raw)
            encoded = codec.encode(nvcomp.as_array(view))
            decoded = torch.utils.dlpack.from_dlpack(codec.decode(encoded))
            exact = bool(torch.equal(decoded.reshape(-1).view(torch.uint8), raw))
            row.update(ratio=encoded.buffer_size / raw.numel(), exact=exact)
            if exact:
                t = timed(lambda c=codec, e=encoded: c.decode(e), repeats)
                row.update(t, decode_gbps=raw.numel() / (t["p50_ms"] / 1e3) / 1e9)
        except Exception as exc:  # an unsupported option is a row of the table, not the end of the benchmark
            row["error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--checkpoint", help="a BF16 checkpoint directory: measure its block --block instead")
    ap.add_argument("--block", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: this benchmark decodes on the GPU and needs a CUDA device; none found", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    tensors = checkpoint_block(args.checkpoint, args.block) if args.checkpoint else synthetic_block(args.seed)
    all_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    bf16 = {k: t for k, t in tensors.items() if df11.compressible(t)}  # what the checkpoint writer compresses
    raw_bytes = sum(t.numel() * 2 for t in bf16.values())

    log(f"{len(bf16)} of {len(tensors)} tensors compressible, {raw_bytes / 2**30:.3f} of {all_bytes / 2**30:.3f} GiB")
    blobs, cpu_s = encode_all(bf16, check=False, device="cpu")
    log(f"encoded on the CPU ({torch.get_num_threads()} threads) in {cpu_s:.1f} s")
    _, cpu_check_s = encode_all(bf16, check=True, device="cpu")
    log(f"encoded and checked on the CPU in {cpu_check_s:.1f} s")
    encode_all(bf16, check=True, device="cuda")  # warm-up
    _, cuda_check_s = encode_all(bf16, check=True, device="cuda")
    log(f"encoded and checked on the GPU in {cuda_check_s:.1f} s")
    layouts = {k: df11.parse_header(b, b.size, name=k) for k, b in blobs.items()}
    packed = sum(b.size for b in blobs.values())

    per_tensor, bound_bits = [], 0.0
    for name, t in bf16.items():
        h = df11.exponent_entropy_bits(t)
        bound_bits += t.numel() * (8 + h)
        per_tensor.append({"name": name, "shape": list(t.shape), "ratio": blobs[name].size / (2 * t.numel()),
                           "entropy_bits": h, "code_bits": layouts[name].total_bits / t.numel(),
                           "chunk": layouts[name].chunk})  # fmt: skip

    # Correctness first: every tensor decoded on the GPU equals the original bit for bit.
    dev_blobs = {k: torch.from_numpy(b).to(dev) for k, b in blobs.items()}
    outs = {k: torch.empty(t.shape, dtype=torch.bfloat16, device=dev) for k, t in bf16.items()}
    for k, t in bf16.items():
        df11.decode_blob(dev_blobs[k], layouts[k], outs[k])
        if not torch.equal(outs[k].view(torch.int16).cpu(), t.view(torch.int16)):
            raise SystemExit(f"error: {k} did not decode bit-exact on the GPU")
    ops = {k: (df11.sections(dev_blobs[k], layouts[k]), layouts[k].chunk) for k in bf16}

    def decode_block() -> None:
        for k, (s, chunk) in ops.items():
            decode(s["words"], s["sm"], s["lane_bits"], s["group_base"], s["lut"], outs[k], chunk=chunk)

    block_decode = timed(decode_block, args.repeats)
    biggest = max(bf16, key=lambda k: bf16[k].numel())
    s, chunk = ops[biggest]
    one = timed(lambda: decode(s["words"], s["sm"], s["lane_bits"], s["group_base"], s["lut"], outs[biggest],
                               chunk=chunk), args.repeats)  # fmt: skip

    host_raw = torch.empty(raw_bytes, dtype=torch.uint8).pin_memory()
    host_packed = torch.empty(packed, dtype=torch.uint8).pin_memory()
    dev_raw = torch.empty(raw_bytes, dtype=torch.uint8, device=dev)
    h2d_raw = timed(lambda: dev_raw.copy_(host_raw, non_blocking=True), 5)
    h2d_packed = timed(lambda: dev_raw[:packed].copy_(host_packed, non_blocking=True), 5)

    record_path, variant = BLOCK_RECORD
    block_s = json.loads((ROOT / record_path).read_text())["variants"][variant]["median_s"]
    log("decode timed; nvCOMP next")

    result = {
        "source": args.checkpoint or f"synthetic Pro-distill block (seed {args.seed})",
        "block": args.block,
        "bf16_bytes": raw_bytes,
        "df11_bytes": packed,
        "ratio": packed / raw_bytes,
        "entropy_bound_ratio": bound_bits / (16 * raw_bytes / 2),
        "block_bytes": all_bytes,
        "block_ratio": (packed + all_bytes - raw_bytes) / all_bytes,
        "min_elements": df11.MIN_ELEMENTS,
        "max_chunk": df11.CHUNK,
        "target_groups": df11.TARGET_GROUPS,
        "lanes": df11.LANES,
        "encode_cpu_gbps": raw_bytes / cpu_s / 1e9,
        "encode_check_cpu_gbps": raw_bytes / cpu_check_s / 1e9,
        "cpu_threads": torch.get_num_threads(),
        "encode_check_cuda_gbps": raw_bytes / cuda_check_s / 1e9,
        "decode_block": {**block_decode, "gbps": raw_bytes / (block_decode["p50_ms"] / 1e3) / 1e9},
        "decode_largest": {"name": biggest, **one, "gbps": 2 * bf16[biggest].numel() / (one["p50_ms"] / 1e3) / 1e9},
        "h2d_bf16": h2d_raw,
        "h2d_df11": h2d_packed,
        "block_compute_s": block_s,
        "block_compute_record": f"{record_path} variants[{variant!r}].median_s",
        "decode_over_compute": block_decode["p50_ms"] / 1e3 / block_s,
        "per_tensor": per_tensor,
        "nvcomp": [],
    }
    record = {"environment": environment(dev), "results": result}
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")  # kept if nvCOMP brings the process down
    raw_dev = torch.cat([t.reshape(-1).view(torch.uint8) for t in bf16.values()]).to(dev)
    result["nvcomp"] = bench_nvcomp(raw_dev, args.repeats)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print_table(record)
    print(f"wrote {args.out}")
    return 0


def print_table(record: dict) -> None:
    env, r = record["environment"], record["results"]
    print(f"{env['gpu']} ({env['capability']}), torch {env['torch']}, triton {env['triton']}; {r['source']}")
    print(f"{'tensor':<52}{'shape':>14}{'ratio':>8}{'H bits':>8}{'code bits':>10}{'chunk':>7}")
    for t in r["per_tensor"]:
        print(f"{t['name']:<52}{'x'.join(map(str, t['shape'])):>14}{t['ratio']:>8.3f}{t['entropy_bits']:>8.2f}"
              f"{t['code_bits']:>10.2f}{t['chunk']:>7}")  # fmt: skip
    gib = r["bf16_bytes"] / 2**30
    print(
        f"compressed tensors {gib:.3f} GiB BF16 -> ratio {r['ratio']:.4f} (entropy bound "
        f"{r['entropy_bound_ratio']:.4f}); whole block with the small tensors raw {r['block_ratio']:.4f}"
    )
    print(f"encode: CPU ({r['cpu_threads']} threads) {r['encode_cpu_gbps']:.3f} GB/s, with the decode check (the "
          f"write path) {r['encode_check_cpu_gbps']:.3f} GB/s; GPU with the check {r['encode_check_cuda_gbps']:.2f} "
          "GB/s")  # fmt: skip
    d, one = r["decode_block"], r["decode_largest"]
    print(f"decode block (GPU): p20/p50/p80 {d['p20_ms']:.2f}/{d['p50_ms']:.2f}/{d['p80_ms']:.2f} ms, "
          f"{d['gbps']:.0f} GB/s; largest tensor {one['p50_ms']:.3f} ms, {one['gbps']:.0f} GB/s")  # fmt: skip
    print(f"H2D pinned p50: bf16 {r['h2d_bf16']['p50_ms']:.2f} ms, df11 {r['h2d_df11']['p50_ms']:.2f} ms; block "
          f"compute {r['block_compute_s'] * 1e3:.1f} ms ({r['block_compute_record']}): decode/compute "
          f"{r['decode_over_compute']:.3f}")  # fmt: skip
    for row in r["nvcomp"]:
        if "error" in row:
            print(f"{row['codec']:<28} error: {row['error']}")
        else:
            speed = f"{row['decode_gbps']:.0f} GB/s" if "decode_gbps" in row else "not timed (inexact)"
            print(f"{row['codec']:<28} ratio {row['ratio']:.4f} exact {row['exact']} decode {speed}")


if __name__ == "__main__":
    raise SystemExit(main())
