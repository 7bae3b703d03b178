"""Block-sparse attention (k6fast/kernels/sparse_attention.py) against dense and masked references.

CPU: the FP32 reference with every block kept equals dense FP32 attention (to fp32 rounding) and with a hand-built
block list equals SDPA under the same token mask, at odd shapes (one query, ragged last blocks, cross attention, a
query block with no key, per-head lists); input checks; the custom op under torch.compile (fullgraph); the Triton
kernel compiled for sm_120 (tensor cores, pipelined loads, within 99 KiB of shared memory) and sm_90 without a GPU.
`interpret`: the Triton kernel under TRITON_INTERPRET=1 against the reference, fp32 and fp16 operands (bf16 dots are
wrong in the interpreter), every launch config. `gpu`: the Triton kernel and flash-attn-4's block-sparse path (where
installed, sm_90) in bf16 at the Pro and Lite head dims by the flash-attention rule (error against FP32 no worse
than twice a bf16 SDPA's under the same mask).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import interpreter_suite, needs_cuda

from k6fast.kernels import aot
from k6fast.kernels import sparse_attention as sa
from k6fast.kernels import tile_mask as tm
from k6fast.testing.bounds import assert_within_baseline_error, rel_l2

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted_only = pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (see the subprocess test)")


def qkv(b, h, m, n, d, *, seed, dtype=torch.float32, device="cpu"):
    """q: [b, m, h, d], k/v: [b, n, h, d]; K with per-channel offsets, as the DiT's keys."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, m, h, d, generator=g, device=device)
    k = torch.randn(b, n, h, d, generator=g, device=device) + 2.0 * torch.randn(h, d, generator=g, device=device)
    v = torch.randn(b, n, h, d, generator=g, device=device)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def random_blocks(b, h, m, n, *, seed, max_keep=None, allow_empty=False):
    """A hand-built block list: per (batch, head, query block) a random ascending subset of the key blocks, of random
    size; the ragged last key block appears in some rows."""
    g = torch.Generator().manual_seed(seed)
    mb, nb = -(-m // sa.BLOCK), -(-n // sa.BLOCK)
    width = nb if max_keep is None else max_keep
    idx = torch.zeros(b, h, mb, width, dtype=torch.int32)
    cnt = torch.zeros(b, h, mb, dtype=torch.int32)
    for bi in range(b):
        for hi in range(h):
            for i in range(mb):
                lo = 0 if allow_empty else 1
                c = int(torch.randint(lo, width + 1, (1,), generator=g))
                kept = torch.sort(torch.randperm(nb, generator=g)[:c]).values
                idx[bi, hi, i, :c] = kept.to(torch.int32)
                cnt[bi, hi, i] = c
    return idx, cnt


def masked_sdpa(q, k, v, idx, cnt):
    """SDPA in fp32 under the block list's token mask ([B, H, M, N]); rows with no key give zeros."""
    mask = tm.token_mask(idx, cnt, q.shape[1], k.shape[1])
    out = F.scaled_dot_product_attention(
        q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2), attn_mask=mask
    )
    out = torch.where(mask.any(-1, keepdim=True), out, 0.0)
    return out.transpose(1, 2)


def dense_fp32(q, k, v):
    s = torch.einsum("bmhd,bnhd->bhmn", q.float(), k.float()) / q.shape[-1] ** 0.5
    return torch.einsum("bhmn,bnhd->bmhd", torch.softmax(s, dim=-1), v.float())


# ---------------------------------------------------------------------------------------------------------------------
# CPU: the reference
# ---------------------------------------------------------------------------------------------------------------------

ODD = [  # (b, h, m, n, d): one query, one key, ragged last blocks, cross attention, exact multiples
    (1, 2, 1, 300, 64),
    (1, 1, 300, 1, 64),
    (2, 3, 257, 129, 32),
    (1, 2, 384, 384, 128),
    (1, 1, 130, 1000, 64),
]


@pytest.mark.parametrize("shape", ODD)
def test_reference_with_every_block_is_dense_attention(shape):
    b, h, m, n, d = shape
    q, k, v = qkv(*shape, seed=0)
    mb, nb = -(-m // sa.BLOCK), -(-n // sa.BLOCK)
    idx = torch.arange(nb, dtype=torch.int32).expand(b, h, mb, nb).contiguous()
    cnt = torch.full((b, h, mb), nb, dtype=torch.int32)
    out = sa.sparse_attention_ref(q, k, v, idx, cnt)
    assert out.shape == (b, m, h, d) and out.dtype == torch.float32
    assert rel_l2(out, dense_fp32(q, k, v)) <= 1e-6


@pytest.mark.parametrize("shape", ODD)
def test_reference_with_hand_built_blocks_is_masked_sdpa(shape):
    b, h, m, n, d = shape
    q, k, v = qkv(*shape, seed=1)
    idx, cnt = random_blocks(b, h, m, n, seed=2, allow_empty=True)
    out = sa.sparse_attention_ref(q, k, v, idx, cnt)
    torch.testing.assert_close(out, masked_sdpa(q, k, v, idx, cnt), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [*ODD, (1, 1, 1100, 300, 32)])  # the last: nine query blocks, two chunks
def test_sdpa_baseline_in_fp32_is_the_reference(shape):
    # The baseline the GPU tests hold the kernels' error to (`_rule`): in fp32 it computes what the reference does.
    b, h, m, n, d = shape
    q, k, v = qkv(*shape, seed=3)
    idx, cnt = random_blocks(b, h, m, n, seed=4)
    got = sa.sparse_attention_sdpa(q, k, v, idx, cnt)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got, sa.sparse_attention_ref(q, k, v, idx, cnt), rtol=1e-5, atol=1e-6)


def test_reference_zero_blocks_row_gives_zeros():
    q, k, v = qkv(1, 1, 200, 200, 32, seed=3)
    idx = torch.tensor([[[[0, 1], [0, 0]]]], dtype=torch.int32)
    cnt = torch.tensor([[[2, 0]]], dtype=torch.int32)
    out = sa.sparse_attention_ref(q, k, v, idx, cnt)
    assert (out[:, 128:] == 0).all() and out[:, :128].abs().sum() > 0


def test_inputs_are_checked():
    q, k, v = qkv(1, 2, 200, 300, 64, seed=4)
    idx, cnt = random_blocks(1, 2, 200, 300, seed=5)
    with pytest.raises(ValueError, match=r"expected kv_idx \[1, 2, 2, K\] and kv_cnt \[1, 2, 2\]"):
        sa.sparse_attention(q, k, v, idx[:, :, :1], cnt[:, :, :1])
    with pytest.raises(ValueError, match="expected int32"):
        sa.sparse_attention(q, k, v, idx.long(), cnt)
    with pytest.raises(ValueError, match=r"expected k and v \[1, N, 2, 64\]"):
        sa.sparse_attention(q, k[..., :32], v[..., :32], idx, cnt)
    with pytest.raises(ValueError, match=r"q: expected \[B, N, H, D\]"):
        sa.sparse_attention(q.int(), k, v, idx, cnt)
    with pytest.raises(ValueError, match="impl: expected"):
        sa.sparse_attention(q, k, v, idx, cnt, impl="cuda")


@pytest.mark.skipif(INTERPRETED, reason="under the interpreter the Triton kernel takes CPU tensors")
def test_cpu_runs_the_reference_and_the_triton_path_refuses_cpu_tensors():
    q, k, v = qkv(1, 2, 200, 300, 64, seed=6)
    idx, cnt = random_blocks(1, 2, 200, 300, seed=7)
    assert sa.implementation_for(q.device, q.dtype, 64) == "reference"
    assert torch.equal(sa.sparse_attention(q, k, v, idx, cnt), sa.sparse_attention_ref(q, k, v, idx, cnt))
    with pytest.raises(ValueError, match="expected CUDA tensors"):
        sa.sparse_attention(q, k, v, idx, cnt, impl="triton")


@pytest.mark.skipif(INTERPRETED, reason="the reference runs on CPU without the interpreter")
def test_the_compiled_op_keeps_one_graph():
    # The DiT's compiled blocks build the mask and call the op inside the graph: no break, same values as eager.
    q, k, v = qkv(1, 2, 300, 300, 32, seed=8)

    def attend(q, k, v):
        idx, cnt = tm.build_block_mask(q, k, None, 0.5)
        return sa.sparse_attention_op(q, k, v, idx, cnt) * 1.0

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")(q, k, v)
    assert torch.equal(compiled, attend(q, k, v))
    idx, cnt = tm.build_block_mask(q, k, None, 0.5)
    torch.library.opcheck(sa.sparse_attention_op, (q, k, v, idx, cnt))


# ---------------------------------------------------------------------------------------------------------------------
# Interpreter: the Triton kernel on CPU
# ---------------------------------------------------------------------------------------------------------------------


test_interpreter_suite_in_subprocess = interpreter_suite(__file__, timeout=900)


INTERPRET_SHAPES = [(1, 2, 1, 300, 16), (1, 1, 300, 1, 32), (2, 1, 257, 129, 16), (1, 2, 130, 384, 64)]


@pytest.mark.interpret
@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", INTERPRET_SHAPES)
def test_triton_matches_reference_interpreted(shape, dtype):
    b, h, m, n, d = shape
    q, k, v = qkv(*shape, seed=10, dtype=dtype)
    idx, cnt = random_blocks(b, h, m, n, seed=11, allow_empty=True)
    out = sa.sparse_attention(q, k, v, idx, cnt, impl="triton")
    assert out.dtype == dtype and out.shape == q.shape and out.is_contiguous()
    ref = sa.sparse_attention_ref(q, k, v, idx, cnt, out_dtype=torch.float32)
    # fp32: the kernel's online softmax differs from the reference's only by rounding; fp16: P and the output rounded.
    bound = 1e-5 if dtype == torch.float32 else 2e-3
    assert rel_l2(out, ref) <= bound, rel_l2(out, ref)


@pytest.mark.interpret
@interpreted_only
def test_triton_every_block_is_dense_interpreted():
    q, k, v = qkv(1, 2, 200, 300, 32, seed=12)
    idx = torch.arange(3, dtype=torch.int32).expand(1, 2, 2, 3).contiguous()
    cnt = torch.full((1, 2, 2), 3, dtype=torch.int32)
    assert rel_l2(sa.sparse_attention(q, k, v, idx, cnt, impl="triton"), dense_fp32(q, k, v)) <= 1e-5


@pytest.mark.interpret
@interpreted_only
@pytest.mark.parametrize("config", sa.CANDIDATE_CONFIGS, ids=str)
def test_triton_configs_interpreted(config):
    # 130 queries: one full query block and one of 2 rows; 300 keys: the last kept block has 44 keys, and with
    # 128-key blocks cut into block_n sub-tiles the last sub-tile of a row may hold none.
    q, k, v = qkv(1, 2, 130, 300, 16, seed=13)
    idx, cnt = random_blocks(1, 2, 130, 300, seed=14)
    out = sa.sparse_attention(q, k, v, idx, cnt, impl="triton", config=config)
    assert rel_l2(out, sa.sparse_attention_ref(q, k, v, idx, cnt)) <= 1e-5


@pytest.mark.interpret
@interpreted_only
def test_triton_takes_strided_inputs_interpreted():
    q, k, v = qkv(1, 2, 150, 150, 16, seed=15)
    fused = torch.randn(1, 150, 3, 2, 16)  # one q/k/v projection buffer, as a fused QKV layout would hand over
    fused[:, :, 0], fused[:, :, 1], fused[:, :, 2] = q, k, v
    idx, cnt = random_blocks(1, 2, 150, 150, seed=16)
    strided = sa.sparse_attention(fused[:, :, 0], fused[:, :, 1], fused[:, :, 2], idx, cnt, impl="triton")
    assert torch.equal(strided, sa.sparse_attention(q, k, v, idx, cnt, impl="triton"))


# ---------------------------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------------------------

GPU_SHAPES = [  # (b, h, m, n, d)
    (1, 4, 50220, 50220, 128),  # W1's token count (393 blocks, the last of 44 tokens), 4 of Pro's 32 heads
    (1, 4, 50220, 50220, 64),  # Lite's head_dim
    (2, 3, 1000, 777, 128),
    (1, 2, 1, 300, 64),
]


def _gpu_case(shape, seed, density):
    b, h, m, n, d = shape
    q, k, v = qkv(*shape, seed=seed, dtype=torch.bfloat16, device="cuda")
    if m == n:  # the arm's own rule (no window: these tokens have no grid), per head
        idx, cnt = tm.build_block_mask(q, k, None, density)
    else:
        idx, cnt = (t.cuda() for t in random_blocks(b, h, m, n, seed=seed + 1))
    return q, k, v, idx, cnt


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("impl", ["triton", "fa4"])
@pytest.mark.parametrize("density", [1.0, 0.25])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_kernels_by_the_flash_attention_rule(shape, density, impl):
    q, k, v, idx, cnt = _gpu_case(shape, seed=20, density=density)
    if impl == "fa4":
        from k6fast.kernels.fa4_attention import fa4_block_sparse_runs_on

        if not fa4_block_sparse_runs_on(torch.device("cuda")):  # not sm_90 or not installed: refused, with why
            with pytest.raises(ValueError, match="fa4_block_sparse_attention: expected"):
                sa.sparse_attention(q, k, v, idx, cnt, impl=impl)
            assert sa.implementation_for(torch.device("cuda"), q.dtype, q.shape[-1]) == "triton"
            return
    out = sa.sparse_attention(q, k, v, idx, cnt, impl=impl)
    assert out.shape == q.shape and out.dtype == q.dtype and torch.isfinite(out).all()
    exact = sa.sparse_attention_ref(q, k, v, idx, cnt, out_dtype=torch.float32)
    sdpa = sa.sparse_attention_sdpa(q, k, v, idx, cnt)  # the bf16 PyTorch baseline
    assert_within_baseline_error(out, sdpa, exact, metric="rel_l2", atol=1e-6, what=f"{impl} {shape} density {density}")


@pytest.mark.gpu
@needs_cuda
def test_gpu_dispatch_picks_the_expected_kernel():
    from k6fast.kernels.fa4_attention import fa4_block_sparse_runs_on

    dev = torch.device("cuda")
    expected = "fa4" if fa4_block_sparse_runs_on(dev) else "triton"
    assert sa.implementation_for(dev, torch.bfloat16, 128) == expected
    assert sa.implementation_for(dev, torch.float32, 128) == "triton"
    q, k, v, idx, cnt = _gpu_case((1, 2, 1000, 1000, 128), seed=21, density=0.5)
    torch.testing.assert_close(sa.sparse_attention_op(q, k, v, idx, cnt), sa.sparse_attention(q, k, v, idx, cnt))


# ---------------------------------------------------------------------------------------------------------------------
# CPU: the Triton kernel compiles for the cards it is for
# ---------------------------------------------------------------------------------------------------------------------

SM120_SMEM = 101376  # bytes of shared memory per block on sm_120 (99 KiB)


def _compile(capability: int, config: sa.SparseAttentionConfig, head_dim: int):
    """The kernel compiled for `capability` with no GPU, specialised as a launch on aligned bf16 tensors would be
    (pointers and strides divisible by 16: without that Triton neither vectorises nor pipelines the loads)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = ["Q", "K", "V", "Out", "KV_IDX", "KV_CNT"]
    sig = {n: "*bf16" for n in names[:4]} | {"KV_IDX": "*i32", "KV_CNT": "*i32"}
    strides = [f"stride_{t}{a}" for t in "qkvo" for a in ("b", "m" if t in "qo" else "n", "h")]
    sig |= {n: "i32" for n in [*strides, "WIDTH", "H", "M", "N"]} | {"qk_scale": "fp32"}
    consts = {"HEAD_DIM": head_dim, "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "TILE": sa.BLOCK,
              "PRECISION": "tf32"}  # fmt: skip
    sig |= {n: "constexpr" for n in consts}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(len(names) + len(strides))}
    src = ASTSource(fn=aot.body("sparse_attention"), signature=sig, constexprs=consts, attrs=aligned)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)


@pytest.mark.skipif(INTERPRETED, reason="compiles for a GPU target")
@pytest.mark.parametrize("head_dim", [128, 64])
@pytest.mark.parametrize("config", [sa.SparseAttentionConfig(), sa.SparseAttentionConfig(128, 128, 8, 2)], ids=str)
def test_compiles_for_sm120_pipelined_within_its_shared_memory(config, head_dim):
    kernel = _compile(120, config, head_dim)
    ptx = kernel.asm["ptx"]
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx  # tensor cores, fp32 accumulation
    assert "cp.async.commit_group" in ptx  # K/V loads pipelined
    assert kernel.metadata.shared <= SM120_SMEM, kernel.metadata.shared


@pytest.mark.skipif(INTERPRETED, reason="compiles for a GPU target")
def test_compiles_for_sm90_with_wgmma():
    ptx = _compile(90, sa.SparseAttentionConfig(), 128).asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.commit_group" in ptx
