"""k6fast's DiT against diffusers' `Kandinsky6Transformer3DModel` on the same checkpoint and inputs: one fused block,
and one whole forward resident and with diffusers' group offload (block level, streams) — the peer rows.

Correctness first: k6fast's block output is compared with diffusers' on the same inputs (bf16; relative error
reported). Times are medians of `--repeats` runs after a warm-up, CUDA-event timed.

Run (GPU):  python measurements/bench_dit_peer.py --model /tmp/syn --out peer.json [--geometry 864x480x121]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from bench_common import wall_seconds

from k6fast.allocator import device_budget
from k6fast.checkpoint import open_checkpoint
from k6fast.dit.blocks import FusedBlockInputs, fused_block
from k6fast.dit.rope import rope_1d, rope_3d
from k6fast.stream.plan import GiB
from k6fast.stream.runtime import build_dit
from k6fast.vae_geometry import latent_frames


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--geometry", default="864x480x121")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--text-tokens", type=int, default=64)
    ap.add_argument("--skip-offload", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from bench_streaming import inputs  # same inputs as the streaming benchmark
    from diffusers import Kandinsky6Transformer3DModel

    width, height, frames = (int(v) for v in args.geometry.split("x"))
    device = torch.device("cuda")
    ckpt = open_checkpoint(args.model)
    cfg = ckpt.dit
    kwargs = inputs(cfg, width, height, frames, args.text_tokens, device)
    results: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "geometry": args.geometry,
                     "blocks": cfg.num_visual_blocks, "model": args.model}  # fmt: skip

    # One fused block: both implementations on the same block-0 weights and the same hidden states.
    torch.manual_seed(0)
    t = latent_frames(frames)
    n_vid = t * (height // 16) * (width // 16)
    n_aud = kwargs["audio_hidden_states"].shape[1]
    vis = torch.randn(1, n_vid, cfg.model_dim, device=device, dtype=torch.bfloat16)
    aud = torch.randn(1, n_aud, cfg.model_dim_a, device=device, dtype=torch.bfloat16)
    text_v = torch.randn(1, args.text_tokens, cfg.model_dim, device=device, dtype=torch.bfloat16)
    text_a = torch.randn(1, args.text_tokens, cfg.model_dim_a, device=device, dtype=torch.bfloat16)
    temb_v = torch.randn(1, cfg.time_dim, device=device)
    temb_a = torch.randn(1, cfg.time_dim_a, device=device)
    pos = (torch.arange(t, device=device), torch.arange(height // 16, device=device),
           torch.arange(width // 16, device=device))  # fmt: skip
    rope_v = rope_3d(pos, cfg.axes_dims, cfg.scale_factor)
    rope_a = rope_1d(torch.arange(n_aud, device=device), cfg.head_dim_a, cfg.audio_freqs_scaling)

    ref = Kandinsky6Transformer3DModel.from_pretrained(ckpt.root / "transformer", dtype=torch.bfloat16).to(device)
    ref_block = ref.visual_transformer_blocks[0]
    # diffusers' rope tables: its own modules from the same positions.
    ref_rope_v = ref.visual_rope_embeddings(pos, ref.scale_factor).flatten(0, 2)
    ref_rope_a = ref.audio_rope_embeddings(torch.arange(n_aud, device=device))

    def diffusers_block():
        with torch.no_grad():
            return ref_block(vis, aud, text_v, text_a, (temb_v.to(torch.bfloat16), temb_a.to(torch.bfloat16)),
                             ref_rope_v, ref_rope_a, None)  # fmt: skip

    results["diffusers_block_s"] = wall_seconds(diffusers_block, args.repeats)
    expected = diffusers_block()
    results["diffusers_peak_gib_block"] = torch.cuda.max_memory_allocated() / GiB

    # Whole forward, resident.
    def diffusers_forward():
        with torch.no_grad():
            return ref(**kwargs, return_dict=False)

    results["diffusers_forward_s"] = wall_seconds(diffusers_forward, max(2, args.repeats // 2))
    ref = ref_block = None  # free the peer before k6fast loads
    torch.cuda.empty_cache()

    runtime = build_dit(
        ckpt.transformer_files,
        ckpt.dit,
        device,
        torch.bfloat16,
        budget_bytes=device_budget(device, 0),
        tokens=(n_vid, n_aud),
    )
    weights = runtime.dit.blocks.get(0)
    inp = FusedBlockInputs(text_v, text_a, temb_v, temb_a, rope_v, rope_a, None)

    def k6_block():
        with torch.no_grad():
            return fused_block(runtime.dit.backend, cfg, weights, vis, aud, inp)

    results["k6_block_s"] = wall_seconds(k6_block, args.repeats)
    got = k6_block()
    rel = [((g.float() - e.float()).norm() / e.float().norm()).item() for g, e in zip(got, expected, strict=True)]
    results["block_rel_l2_vs_diffusers"] = rel
    results["k6_forward_s"] = wall_seconds(lambda: runtime.dit(**kwargs), max(2, args.repeats // 2))
    runtime.close()
    runtime = weights = None
    torch.cuda.empty_cache()

    if not args.skip_offload:
        torch.cuda.reset_peak_memory_stats()
        off = Kandinsky6Transformer3DModel.from_pretrained(ckpt.root / "transformer", dtype=torch.bfloat16)
        off.enable_group_offload(device, offload_type="block_level", num_blocks_per_group=1, use_stream=True)

        def offload_forward():
            with torch.no_grad():
                return off(**kwargs, return_dict=False)

        results["diffusers_offload_forward_s"] = wall_seconds(offload_forward, 2)
        results["diffusers_offload_peak_gib"] = torch.cuda.max_memory_allocated() / GiB

    med = {k: statistics.median(v) for k, v in results.items() if k.endswith("_s")}
    results["medians"] = med
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    for k, v in med.items():
        print(f"{k:<32}{v:>10.4f}")
    print(f"block speed-up vs diffusers {med['diffusers_block_s'] / med['k6_block_s']:.3f}x; rel L2 {rel}")


if __name__ == "__main__":
    main()
