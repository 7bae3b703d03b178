"""Block-sparse video self-attention (k6fast/kernels/sparse_attention.py and tile_mask.py) at W1: speed per density
against cuDNN dense SDPA, and the error of dropping blocks against dense attention.

What is measured, in order:
1. Correctness of each kernel (flash-attn-4's block-sparse path where installed on sm_90, the Triton kernel):
   at W1's token count with 4 heads, per density, the kernel against the FP32 reference under the same block mask,
   by the flash-attention rule (error no worse than twice a bf16 SDPA's under that mask). A kernel that fails is not
   timed.
2. Time (p50 of do_bench): cuDNN SDPA dense, then per density the sparse kernel alone and the mask build (block means,
   pooled scores, top-k; it runs once per call in the DiT) at the full shape, 1 x heads x 50,220 x head_dim.
3. Error of sparsity (the arm's loss, not a kernel's): rel. L2 and cosine of the sparse output against exact FP32
   dense attention, per density, on three inputs. `random`: q, k, v i.i.d. (plus DiT-like key offsets) — no
   locality at all, attention spread evenly, so dropping 75 % of the blocks drops most of the mass: a worst case for
   the mask rule. `video-like (peak P)`: a smooth random field over the (frames x height x width) grid (noise on a
   grid 4x coarser, trilinearly upsampled) is each token's content; q and k are that content plus 50 % noise, v
   another smooth field, all with the model's 3-D RoPE applied to q and k at the token's position; P is the logit of
   a token against its own content (q·k/sqrt(D)), which sets how peaked attention is. Neighbouring tokens then share
   content and RoPE phase, so attention mass concentrates nearby, as Sliding Tile Attention and Radial Attention
   observed in trained video DiTs.
   Beside each error, the oracle's: the same number of key blocks per query block chosen by their true attention
   mass (computed exactly), which separates what the mask rule misses from what any mask of that density loses.
   The errors include the kernels' bf16 rounding (the `dense` row gives cuDNN's, the floor).
   What this can tell: whether the mask rule (window + pooled top-k) finds the blocks that carry the mass when mass
   is local, how the error grows as density falls, and that the whole path (token order, mask, kernel) is right at
   W1. What it cannot tell: the error on a trained model's activations (its heads mix local, global and
   content-matched patterns, and text and the image frame steer them), how that error compounds through 60 blocks
   and 10 steps, or what it does to the video. Those need real weights: the acceptance run's whole-chain latent
   error, and the user's gate run for quality.

Tokens are put in the arm's tiled order before anything runs (dense attention does not care; the mask needs it).
The last thing printed is the table; --out gets the JSON record.

Run (GPU):  python measurements/bench_sparse_attention.py --out sparse.json [--head-dim 64 --heads 28] [--sweep]
About 3 minutes on an H200 (flash-attn-4 compiles on first use; --sweep adds the Triton launch configs at 0.25).
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from bench_common import attention_arg_parser, environment
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from k6fast.dit.rope import rope_3d
from k6fast.kernels import sparse_attention as sa
from k6fast.kernels import tile_mask as tm
from k6fast.kernels.exact_attention import attention_fp32
from k6fast.kernels.fa4_attention import fa4_block_sparse_runs_on, fa4_version
from k6fast.kernels.qk_norm_rope import apply_rope

DENSITIES = "1.0,0.5,0.25,0.125"
GRID = (31, 30, 54)  # W1 text-to-video: 50,220 tokens (with the image tail frame: 32 frames)
AXES = {128: (32, 48, 48), 64: (16, 24, 24)}  # the model's RoPE split of head_dim over (t, h, w)
ROPE_SCALE = (1.0, 2.0, 2.0)  # DiTConfig's default scale_factor
CHECK_HEADS = 4
TARGET = 3.0  # density 0.25 against cuDNN dense, the speed target
DEVICE = "cuda"  # the input builders' device (a CPU check of them sets it)


def cudnn_bnhd(q, k, v):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def exact_bnhd(q, k, v):
    return attention_fp32(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def random_qkv(heads, head_dim, n, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(1, n, heads, head_dim, generator=g, device=DEVICE)
    k = torch.randn(1, n, heads, head_dim, generator=g, device=DEVICE) + 3 * torch.randn(heads, head_dim, generator=g,
                                                                                       device=DEVICE)  # fmt: skip
    v = torch.randn(1, n, heads, head_dim, generator=g, device=DEVICE)
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def smooth_field(channels, grid, g):
    """[N, channels] fp32, unit RMS per token: noise on a 4x coarser grid, trilinearly upsampled (t, h, w order)."""
    coarse = [max(2, math.ceil(s / 4) + 1) for s in grid]
    x = torch.randn(1, channels, *coarse, generator=g, device=DEVICE)
    x = F.interpolate(x, size=grid, mode="trilinear", align_corners=True)[0].flatten(1).T
    return x / x.pow(2).mean(dim=1, keepdim=True).sqrt()


def video_like_qkv(heads, head_dim, grid, peak, seed):
    """q, k, v [1, N, H, D] bf16 in (t, h, w) order; see the module docstring."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    n, c = math.prod(grid), heads * head_dim
    content = smooth_field(c, grid, g)
    scale = math.sqrt(peak / math.sqrt(head_dim))  # q·k/sqrt(D) of a token's own content, noise aside: `peak`
    q = (content + 0.5 * torch.randn(n, c, generator=g, device=DEVICE)) * scale
    k = (content + 0.5 * torch.randn(n, c, generator=g, device=DEVICE)) * scale
    v = smooth_field(c, grid, g) + 0.5 * torch.randn(n, c, generator=g, device=DEVICE)
    positions = tuple(torch.arange(s, device=DEVICE) for s in grid)
    cos, sin = rope_3d(positions, AXES[head_dim], ROPE_SCALE)
    q, k, v = (t.view(1, n, heads, head_dim) for t in (q, k, v))
    return apply_rope(q, cos, sin).bfloat16(), apply_rope(k, cos, sin).bfloat16(), v.bfloat16()


def permute(order, *ts):
    perm = order.perm.to(DEVICE)
    return tuple(t[:, perm].contiguous() for t in ts)


def block_mass(q, k):
    """fp32 [B, H, Mb, Nb]: the exact attention probability each query block puts on each key block (summed over its
    queries), chunked over query blocks. Its top-k per row is the oracle mask the rule is compared with."""
    b, n, h, d = q.shape
    nb = -(-n // sa.BLOCK)
    kt = k.float().permute(0, 2, 3, 1)
    pad = nb * sa.BLOCK - n
    mass = torch.empty(b, h, nb, nb, device=q.device)
    for i in range(nb):
        rows = q[:, i * sa.BLOCK : (i + 1) * sa.BLOCK].float().transpose(1, 2)
        p = torch.softmax(torch.matmul(rows, kt) / math.sqrt(d), dim=-1).sum(dim=2)  # [B, H, N]
        mass[:, :, i] = F.pad(p, (0, pad)).view(b, h, nb, sa.BLOCK).sum(-1)
    return mass


def oracle_mask(mass, density):
    keep = tm.keep_count(density, mass.shape[-1])
    idx = torch.sort(torch.topk(mass, keep, dim=-1).indices, dim=-1).values.to(torch.int32)
    return idx, torch.full(mass.shape[:3], keep, dtype=torch.int32, device=mass.device)


def rel_cos(out, ref):
    o, r = out.double().flatten(), ref.double().flatten()
    return ((o - r).norm() / r.norm()).item(), F.cosine_similarity(o, r, dim=0).item()


def p50(fn, rep_ms):
    t = do_bench(fn, warmup=100, rep=rep_ms, quantiles=[0.5])
    return t[0] if isinstance(t, list) else t


def main() -> None:
    ap = attention_arg_parser()
    ap.add_argument("--densities", default=DENSITIES)
    ap.add_argument("--window", type=int, default=1, help="K6_SPARSE_ATTN_WINDOW")
    ap.add_argument("--peaks", default="4,8,12", help="video-like inputs' self-logit, one input per value")
    ap.add_argument("--sweep", action="store_true", help="also time the Triton kernel's CANDIDATE_CONFIGS at 0.25")
    args = ap.parse_args()
    densities = [float(x) for x in args.densities.split(",")]
    heads, d = args.heads, args.head_dim
    seed = int.from_bytes(os.urandom(4), "little")
    order = tm.tile_order(GRID)
    window = tm.window_blocks(order, args.window).cuda()
    impls = (["fa4"] if fa4_block_sparse_runs_on(torch.device("cuda")) else []) + ["triton"]
    record = {"command": " ".join(sys.argv), "env": environment(), "fa4": fa4_version(), "seed": seed,
              "grid": GRID, "heads": heads, "head_dim": d, "window": args.window, "checks": [], "rows": []}  # fmt: skip

    # 1. Correctness at W1's token count, CHECK_HEADS heads, video-like inputs.
    q, k, v = permute(order, *video_like_qkv(CHECK_HEADS, d, GRID, 8.0, seed))
    ok_impl = {impl: True for impl in impls}
    for density in densities:
        idx, cnt = tm.build_block_mask(q, k, window, density)
        exact = sa.sparse_attention_ref(q, k, v, idx, cnt, out_dtype=torch.float32)
        base = rel_cos(sa.sparse_attention_sdpa(q, k, v, idx, cnt), exact)[0]
        for impl in impls:
            err = rel_cos(sa.sparse_attention(q, k, v, idx, cnt, impl=impl), exact)[0]
            ok = err <= 2.0 * base + 1e-6
            ok_impl[impl] &= ok
            record["checks"].append({"density": density, "impl": impl, "rel": err, "sdpa_rel": base, "ok": ok})
            print(f"check density {density:<5} {impl:<6} rel {err:.2e} (bf16 SDPA {base:.2e}) "
                  f"{'ok' if ok else 'FAILED'}", flush=True)  # fmt: skip
    del q, k, v, exact

    # 2. Time at the full shape; 3. errors against dense attention on each input.
    inputs = {"random": permute(order, *random_qkv(heads, d, order.num_tokens, seed))}
    for peak in (float(p) for p in args.peaks.split(",")):
        inputs[f"video-like (peak {peak:g})"] = permute(order, *video_like_qkv(heads, d, GRID, peak, seed + 1))
    q, k, v = inputs["random"]
    dense_ms = p50(lambda: cudnn_bnhd(q, k, v), args.rep_ms)
    flops = 4.0 * heads * order.num_tokens**2 * d
    print(f"cuDNN dense {dense_ms:.2f} ms ({flops / dense_ms / 1e9:.0f} TFLOP/s)", flush=True)
    exact = {name: exact_bnhd(*qkv) for name, qkv in inputs.items()}
    mass = {name: block_mass(*qkv[:2]) for name, qkv in inputs.items()}
    floor = {name: rel_cos(cudnn_bnhd(*qkv), exact[name])[0] for name, qkv in inputs.items()}
    record["dense"] = {"cudnn_ms": dense_ms, "cudnn_rel_vs_fp32": floor}
    for density in densities:
        idx, cnt = tm.build_block_mask(q, k, window, density)
        mask_ms = p50(lambda: tm.build_block_mask(q, k, window, density), args.rep_ms)  # noqa: B023
        errs = {}
        for name, qkv in inputs.items():
            i2, c2 = tm.build_block_mask(qkv[0], qkv[1], window, density)
            oracle = rel_cos(sa.sparse_attention(*qkv, *oracle_mask(mass[name], density)), exact[name])[0]
            errs[name] = (*rel_cos(sa.sparse_attention(*qkv, i2, c2), exact[name]), oracle)
        for impl in impls:
            row = {"density": density, "kept": int(cnt[0, 0, 0]), "impl": impl, "mask_ms": mask_ms,
                   "errors": {n: {"rel": r, "cos": c, "oracle_rel": o} for n, (r, c, o) in errs.items()},
                   "ok": ok_impl[impl]}  # fmt: skip
            if ok_impl[impl]:
                ms = p50(lambda i=impl: sa.sparse_attention(q, k, v, idx, cnt, impl=i), args.rep_ms)  # noqa: B023
                row.update(ms=ms, vs_cudnn=dense_ms / ms, with_mask_vs_cudnn=dense_ms / (ms + mask_ms))
            record["rows"].append(row)
            print(f"density {density:<5} {impl:<6} {row.get('ms', float('nan')):8.2f} ms, mask {mask_ms:.2f} ms",
                  flush=True)  # fmt: skip
    if args.sweep:
        idx, cnt = tm.build_block_mask(q, k, window, 0.25)
        record["sweep"] = []
        for cfg in sa.CANDIDATE_CONFIGS:
            out = sa.sparse_attention(q, k, v, idx, cnt, impl="triton", config=cfg)
            err = rel_cos(out, sa.sparse_attention(q, k, v, idx, cnt, impl="triton"))[0]
            ms = p50(lambda c=cfg: sa.sparse_attention(q, k, v, idx, cnt, impl="triton", config=c), args.rep_ms)
            record["sweep"].append({"config": str(cfg), "ms": ms, "rel_vs_default": err})
            print(f"sweep {cfg}: {ms:.2f} ms (rel vs default {err:.1e})", flush=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)

    env = record["env"]
    print(f"\n{env['gpu']} ({env['capability']}), torch {env['torch']}, triton {env['triton']}, flash-attn-4 "
          f"{record['fa4'] or 'not installed'}; 1x{heads}x{order.num_tokens}x{d} bf16, grid {GRID}, window "
          f"{args.window}; cuDNN dense {dense_ms:.2f} ms")  # fmt: skip
    names = list(inputs)
    head = " ".join(f"{n[:26]:>26}" for n in names)
    cols = f"{'density':>7} {'kept':>5} {'impl':<6} {'ms':>7} {'vs cuDNN':>8} {'+mask':>7} {'w/ mask':>8}"
    print(f"{cols}  rel L2 / cosine vs dense (oracle: the same count of blocks by true attention mass)")
    print(f"{'':>48}{head}")
    for r in record["rows"]:
        ms = f"{r['ms']:7.2f} {r['vs_cudnn']:7.2f}x" if "ms" in r else f"{'FAILED':>16}"
        wm = f"{r['with_mask_vs_cudnn']:7.2f}x" if "ms" in r else f"{'-':>8}"
        errs = " ".join(
            f"{e['rel']:>8.2e}/{e['cos']:.4f} (o {e['oracle_rel']:.2e})" for e in (r["errors"][n] for n in names)
        )
        print(f"{r['density']:>7} {r['kept']:>5} {r['impl']:<6} {ms} {r['mask_ms']:6.2f} {wm}  {errs}")
    print(f"{'dense':>7} {'':>5} {'cuDNN':<6} {dense_ms:7.2f} {'1.00x':>8}{'':>17}  "
          + " ".join(f"{floor[n]:>8.2e} (bf16 floor)    " for n in names))  # fmt: skip
    at = [r for r in record["rows"] if r["density"] == 0.25 and "ms" in r]
    for r in at:
        print(f"target density 0.25 >= {TARGET}x cuDNN: {r['impl']} {r['with_mask_vs_cudnn']:.2f}x with the mask "
              f"-> {'met' if r['with_mask_vs_cudnn'] >= TARGET else 'not met'}")  # fmt: skip
    if not all(ok_impl.values()):
        raise SystemExit("a kernel failed its correctness check and was not timed")


if __name__ == "__main__":
    main()
