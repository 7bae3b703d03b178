"""Block-sparse exact attention: each query block attends only to the key blocks its list names.

Public API (layout [B, N, H, D], the DiT's projections; self- or cross-attention, no other mask):

- ``sparse_attention(q, k, v, kv_idx, kv_cnt, *, impl=None)``: softmax(q·kᵀ/sqrt(D)) v over the kept blocks.
  q: [B, M, H, D], k/v: [B, N, H, D] bf16/fp16 (fp32 too, for the Triton kernel and the reference); kv_idx: int32
  [B, H, ceil(M / BLOCK), K], the kept key blocks of each query block, ascending, no repeats; kv_cnt: int32
  [B, H, ceil(M / BLOCK)], how many entries of each row are valid (a query block with none gets zeros).
  Returns a new contiguous [B, M, H, D] in q's dtype. Block size BLOCK = 128 for queries and keys.
- ``sparse_attention_ref(...)``: the same in FP32 PyTorch (scores of dropped keys set to -inf), chunked over query
  blocks; the kernels are checked against it.
- ``sparse_attention_sdpa(...)``: the same through PyTorch SDPA in q's dtype under the dense token mask: the plain
  low-precision implementation whose error bounds the kernels' (the flash-attention rule).
- ``sparse_attention_op``: the custom op compiled DiT blocks call.

Implementations (``_select``): flash-attn-4's block-sparse forward (its ``full_block_cnt/idx``) where it runs
(sm_90; fa4_attention.py), else the Triton kernel below on CUDA sm_80 and newer (the RTX 5090's path:
flash-attn-4 4.0.0b36 refuses block sparsity on sm_120), else the reference (logged once). Under TRITON_INTERPRET=1
the Triton kernel runs on CPU tensors.

Why both. flash-attn-4 is FlashAttention-3-class on Hopper (warp-specialised, TMA, intra-warpgroup overlap); skipping
a key block there removes its whole cost, so it is the form most likely to reach the H200 target (density 0.25 at
>= 3x cuDNN dense at W1): a portable Triton kernel reaches a fraction of Hopper's wgmma rate, and a block-sparse
variant of k6fast's Gluon cores would be a second hand-written Hopper kernel to keep. The Triton kernel is the
portable path (sm_80, sm_89, sm_100, sm_120) and runs under the interpreter, so its logic is tested on CPU.

Both kernels read the last entry of a row as the only key block that may be ragged (N not a multiple of BLOCK), so
rows must be ascending: flash-attn-4 processes a row's full blocks last to first and masks sequence ends only in
the first one it processes; the Triton kernel masks only its last iteration.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .attention_constants import LOG2E, on_device
from .fallback import cuda_at_least, kernel_runs
from .tile_mask import BLOCK, token_mask

__all__ = [
    "BLOCK",
    "CANDIDATE_CONFIGS",
    "SparseAttentionConfig",
    "implementation_for",
    "sparse_attention",
    "sparse_attention_op",
    "sparse_attention_ref",
    "sparse_attention_sdpa",
]

logger = logging.getLogger(__name__)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class SparseAttentionConfig:
    """Launch parameters of the Triton kernel; none changes which keys are attended. block_m and block_n divide BLOCK
    (a program covers part of one query block; each kept key block is visited in BLOCK // block_n tiles)."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self) -> None:
        if self.block_m not in (64, 128) or self.block_n not in (32, 64, 128):
            raise ValueError(f"expected block_m in (64, 128) and block_n in (32, 64, 128), found {self}")
        if self.num_warps not in (4, 8) or not 1 <= self.num_stages <= 4:
            raise ValueError(f"expected num_warps 4 or 8 and num_stages 1..4, found {self}")


# `measurements/bench_sparse_attention.py --sweep` times CANDIDATE_CONFIGS (the RTX 5090 is the card this path is
# for); every GPU runs the default unless a record picks another. Every candidate compiles
# for sm_120 with its loads pipelined (cp.async) inside the card's 99 KiB of shared memory (the default at head_dim
# 128 takes 96 KiB: both 64-key halves of a kept block in flight, double-buffered); tests/test_sparse_attention.py.
_DEFAULT_CONFIG = SparseAttentionConfig()
CANDIDATE_CONFIGS = (
    SparseAttentionConfig(128, 64, 8, 2),
    SparseAttentionConfig(128, 64, 4, 2),
    SparseAttentionConfig(64, 64, 4, 3),
    SparseAttentionConfig(128, 128, 8, 2),
    SparseAttentionConfig(64, 128, 4, 2),
)


# ---------------------------------------------------------------------------------------------------------------------
# Checks and the reference
# ---------------------------------------------------------------------------------------------------------------------


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_idx: torch.Tensor, kv_cnt: torch.Tensor) -> None:
    """Shapes, dtypes and devices as the module docstring says; raises ValueError naming what was found."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim != 4 or t.dtype not in _DTYPES:
            raise ValueError(f"{name}: expected [B, N, H, D] bf16/fp16/fp32, found {tuple(t.shape)} {t.dtype}")
    b, m, h, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[2:] != (h, d) or not q.dtype == k.dtype == v.dtype:
        raise ValueError(
            f"expected k and v [{b}, N, {h}, {d}] of q's dtype {q.dtype}, found {tuple(k.shape)} {k.dtype}, "
            f"{tuple(v.shape)} {v.dtype}"
        )
    if m < 1 or k.shape[1] < 1:
        raise ValueError(f"expected at least one query and one key, found M={m}, N={k.shape[1]}")
    mb = math.ceil(m / BLOCK)
    if kv_idx.dtype != torch.int32 or kv_cnt.dtype != torch.int32:
        raise ValueError(f"expected int32 kv_idx and kv_cnt, found {kv_idx.dtype} and {kv_cnt.dtype}")
    if kv_idx.ndim != 4 or kv_idx.shape[:3] != (b, h, mb) or kv_cnt.shape != (b, h, mb):
        raise ValueError(
            f"expected kv_idx [{b}, {h}, {mb}, K] and kv_cnt [{b}, {h}, {mb}] for M={m} ({BLOCK}-token blocks), "
            f"found {tuple(kv_idx.shape)} and {tuple(kv_cnt.shape)}"
        )
    if not (q.device == k.device == v.device == kv_idx.device == kv_cnt.device):
        raise ValueError("expected q, k, v, kv_idx and kv_cnt on one device")


def sparse_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_idx: torch.Tensor, kv_cnt: torch.Tensor, *, out_dtype=None
) -> torch.Tensor:
    """FP32 attention with the dropped keys' scores at -inf. Shapes as ``sparse_attention``; returns [B, M, H, D] in
    out_dtype (default q's dtype). A query block with no kept key gets zeros. Chunked over query blocks so the score
    block stays near 2**26 elements."""
    check_inputs(q, k, v, kv_idx, kv_cnt)
    if torch.get_float32_matmul_precision() != "highest":
        raise RuntimeError("sparse_attention_ref: expected float32 matmul precision 'highest' (TF32 off)")
    b, m, h, d = q.shape
    n = k.shape[1]
    kt = k.float().permute(0, 2, 3, 1)  # [B, H, D, N]
    vf = v.float().transpose(1, 2)  # [B, H, N, D]
    out = torch.empty((b, m, h, d), dtype=torch.float32, device=q.device)
    blocks_per_chunk = max(1, (1 << 26) // (b * h * BLOCK * n))
    mb = kv_idx.shape[2]
    for i in range(0, mb, blocks_per_chunk):
        j = min(mb, i + blocks_per_chunk)
        rows = slice(i * BLOCK, min(m, j * BLOCK))
        keep = token_mask(kv_idx[:, :, i:j], kv_cnt[:, :, i:j], rows.stop - rows.start, n)  # [B, H, rows, N]
        s = torch.matmul(q[:, rows].float().transpose(1, 2), kt).mul_(1.0 / math.sqrt(d))
        s = s.masked_fill(~keep, float("-inf"))
        p = torch.softmax(s, dim=-1).masked_fill_(~keep.any(dim=-1, keepdim=True), 0.0)  # no kept key: zeros
        out[:, rows] = torch.matmul(p, vf).transpose(1, 2)
    return out.to(out_dtype or q.dtype)


def sparse_attention_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_idx: torch.Tensor, kv_cnt: torch.Tensor
) -> torch.Tensor:
    """PyTorch SDPA in q's dtype under the same block mask (as a dense token mask), eight query blocks at a time.
    Shapes as ``sparse_attention``; every query block must keep a key block (SDPA gives NaN for a row with none)."""
    out = torch.empty_like(q)
    for i in range(0, kv_idx.shape[2], 8):
        rows = slice(i * BLOCK, min(q.shape[1], (i + 8) * BLOCK))
        mask = token_mask(kv_idx[:, :, i : i + 8], kv_cnt[:, :, i : i + 8], rows.stop - rows.start, k.shape[1])
        o = F.scaled_dot_product_attention(q[:, rows].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask)  # fmt: skip
        out[:, rows] = o.transpose(1, 2)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------------------------------------


def _interpreted() -> bool:
    return isinstance(_sparse_attention_kernel, InterpretedFunction)


def implementation_for(device: torch.device, dtype: torch.dtype = torch.bfloat16, head_dim: int = 128) -> str:
    """'fa4', 'triton' or 'reference': what ``sparse_attention`` runs for such tensors on `device`."""
    from .fa4_attention import fa4_block_sparse_runs_on

    fa4_shapes = dtype in (torch.bfloat16, torch.float16) and head_dim % 8 == 0 and head_dim <= 128
    if fa4_shapes and fa4_block_sparse_runs_on(device):
        return "fa4"
    if _interpreted() or cuda_at_least(device, (8, 0)):
        return "triton"
    return "reference"


def _select(q: torch.Tensor) -> str:
    impl = implementation_for(q.device, q.dtype, q.shape[-1])
    kernel_runs(logger, "sparse_attention", q.device, impl != "reference", "the Triton kernel needs sm_80 or newer")
    return impl


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_idx: torch.Tensor,
    kv_cnt: torch.Tensor,
    *,
    impl: str | None = None,
    config: SparseAttentionConfig | None = None,
) -> torch.Tensor:
    """Block-sparse attention (module docstring). impl None picks per device; 'fa4', 'triton' or 'reference' force
    one (benchmarks, tests); config: the Triton kernel's launch parameters."""
    check_inputs(q, k, v, kv_idx, kv_cnt)
    impl = _select(q) if impl is None else impl
    if impl == "reference":
        return sparse_attention_ref(q, k, v, kv_idx, kv_cnt)
    if impl == "fa4":
        from .fa4_attention import fa4_block_sparse_attention

        return fa4_block_sparse_attention(q, k, v, kv_idx, kv_cnt, BLOCK)
    if impl != "triton":
        raise ValueError(f"impl: expected None, 'fa4', 'triton' or 'reference', found {impl!r}")
    if not (_interpreted() or q.is_cuda):
        raise ValueError(f"impl='triton': expected CUDA tensors (or TRITON_INTERPRET=1), found {q.device}")
    return _launch(q, k, v, kv_idx, kv_cnt, config or _DEFAULT_CONFIG)


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_idx: torch.Tensor,
    kv_cnt: torch.Tensor,
    cfg: SparseAttentionConfig,
) -> torch.Tensor:
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    kv_idx, kv_cnt = kv_idx.contiguous(), kv_cnt.contiguous()
    b, m, h, d = q.shape
    n = k.shape[1]
    if d not in (16, 32, 64, 128, 256):
        raise ValueError(f"impl='triton': expected head_dim a power of two in [16, 256], found {d}")
    out = torch.empty((b, m, h, d), dtype=q.dtype, device=q.device)
    grid = (triton.cdiv(m, cfg.block_m), b * h)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # ignored for bf16/fp16 operands
    with on_device(q.device):
        _sparse_attention_kernel[grid](
            q, k, v, out, kv_idx, kv_cnt,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
            kv_idx.shape[3], h, m, n, (1.0 / math.sqrt(d)) * LOG2E,
            HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, TILE=BLOCK, PRECISION=precision,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    return out


# For compiled callers (the DiT's compiled block): one opaque op, so the dispatch above neither breaks the graph nor
# becomes guards (as quant_attention_op).
@torch.library.custom_op("k6fast::sparse_attention", mutates_args=())
def sparse_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_idx: torch.Tensor, kv_cnt: torch.Tensor
) -> torch.Tensor:
    """``sparse_attention`` with the implementation chosen for the device: a new contiguous [B, M, H, D]."""
    return sparse_attention(q, k, v, kv_idx, kv_cnt).contiguous()


@sparse_attention_op.register_fake
def _(q, k, v, kv_idx, kv_cnt):
    return q.new_empty(q.shape)


# ---------------------------------------------------------------------------------------------------------------------
# The Triton kernel
# ---------------------------------------------------------------------------------------------------------------------


@triton.jit
def _attend(q, k_base, v_base, offs_d, start_n, N, stride_kn, stride_vn, acc, m_i, l_i, qk_scale,
            BLOCK_N: tl.constexpr, MASK: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    # One BLOCK_N-key tile: online softmax in the exp2 domain (m is the running max of s·qk_scale), acc += P·V.
    # PRECISION only matters for fp32 operands (tests, the interpreter): "ieee" multiplies them in full fp32.
    offs_n = start_n + tl.arange(0, BLOCK_N)
    in_seq = offs_n < N
    k = tl.load(k_base + offs_n[:, None].to(tl.int64) * stride_kn + offs_d[None, :], mask=in_seq[:, None], other=0.0)
    v = tl.load(v_base + offs_n[:, None].to(tl.int64) * stride_vn + offs_d[None, :], mask=in_seq[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if MASK:
        s = tl.where(in_seq[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _sparse_attention_kernel(
    Q, K, V, Out, KV_IDX, KV_CNT,  # q/out: [B, M, H, D]; k/v: [B, N, H, D] (unit channel stride); idx/cnt: int32
    stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh, stride_ob, stride_om, stride_oh,
    WIDTH, H, M, N, qk_scale,  # WIDTH: kv_idx's last dim; qk_scale = sm_scale·log2(e)
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)  # fastest: neighbouring query tiles share kept key blocks in L2
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :]
    q = tl.load(q_ptrs, mask=(offs_m < M)[:, None], other=0.0)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh

    row = bh.to(tl.int64) * tl.cdiv(M, TILE) + (pid_m * BLOCK_M) // TILE  # this program's query block
    cnt = tl.load(KV_CNT + row)
    idx_ptr = KV_IDX + row * WIDTH
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # Rows are ascending, so only the last kept block can hold the ragged end of the keys: the loop runs unmasked.
    for j in range(0, cnt - 1):
        kb = tl.load(idx_ptr + j).to(tl.int64)
        for sub in tl.static_range(TILE // BLOCK_N):
            acc, m_i, l_i = _attend(q, k_base, v_base, offs_d, kb * TILE + sub * BLOCK_N, N, stride_kn, stride_vn,
                                    acc, m_i, l_i, qk_scale, BLOCK_N, False, PRECISION)  # fmt: skip
    if cnt > 0:
        kb = tl.load(idx_ptr + cnt - 1).to(tl.int64)
        for sub in tl.static_range(TILE // BLOCK_N):
            acc, m_i, l_i = _attend(q, k_base, v_base, offs_d, kb * TILE + sub * BLOCK_N, N, stride_kn, stride_vn,
                                    acc, m_i, l_i, qk_scale, BLOCK_N, True, PRECISION)  # fmt: skip
    # A sub-tile wholly past N (the ragged block's tail with block_n < TILE) has all scores at -inf and adds nothing:
    # the block's first sub-tile always holds a key, so the running max is finite by then and exp2 never sees -inf-inf.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # no kept key: zeros
    o_ptrs = Out + b * stride_ob + h * stride_oh + offs_m[:, None].to(tl.int64) * stride_om + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=(offs_m < M)[:, None])
