"""flash-attn-4 (Dao-AILab's CuTe-DSL FlashAttention; package `flash-attn-4`, module `flash_attn.cute`) as an
exact-attention kernel and as a block-sparse one, where it is installed and runs.

What the tested version (4.0.0b36, read from its source) offers k6fast:
- `flash_attn_func(q, k, v)` on [B, N, H, D] bf16/fp16 tensors, the DiT's own layout, softmax scale 1/sqrt(D) by
  default; returns (out, lse). Forward kernels for sm_90 (FlashAttention-3-style warp-specialised wgmma), sm_100/110
  (tcgen05) and sm_120 (the RTX 5090: sm_80-style mma.sync with its 99 KiB of shared memory). Head dims up to 256 on
  sm_90, up to 128 (plus a few MLA shapes) on sm_100; 64 and 128 (Lite, Pro) run everywhere it runs. FP8 inputs only
  on sm_100.
- Block sparsity (`block_sparse_tensors=BlockSparseTensorsTorch(...)`): per (batch, head, query block) a count and a
  list of key blocks, split into "mask" blocks (a `mask_mod` is applied inside them) and "full" blocks (no mask but
  the sequence end). k6fast's kept blocks are full blocks. On sm_90 the key block must equal the kernel's key tile
  (128 at head_dim 64 and 128) and the query block a multiple of its query tile (128 once sparse), which k6fast's
  128 x 128 blocks are. sm_100 runs block sparsity too, but with two 128-row query tiles per CTA (q_stage 2) its query
  block must be a multiple of 256; sm_120 refuses it ("Block sparsity not supported on SM 12.0"), and the sm_80 path
  ignores it without an error (flash-attention issue 2897). So block sparsity goes to flash-attn-4 on sm_90 only.

The import is tried once; when it fails the reason is returned for the caller to log (the runtime falls back to SDPA
for exact attention and to k6fast's Triton kernel for sparse attention). Installed with `pip install --target`, the
CuTe DSL's `.pth` file is not read: `<target>/nvidia_cutlass_dsl/dsl_packages` must then be on PYTHONPATH.
"""

from __future__ import annotations

import functools
from importlib import metadata

import torch

__all__ = [
    "fa4_attention",
    "fa4_attention_op",
    "fa4_block_sparse_attention",
    "fa4_block_sparse_runs_on",
    "fa4_block_sparse_supported",
    "fa4_shapes_ok",
    "fa4_supported",
    "fa4_unavailable_reason",
    "fa4_version",
]

DENSE_MAJORS = (9, 10, 11, 12)  # sm_90, sm_100/103, sm_110, sm_120/121
BLOCK_SPARSE_MAJORS = (9,)  # with 128-token query blocks (see above)
_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def import_fa4() -> tuple[object | None, str]:
    """(the flash_attn.cute module, "") or (None, why it cannot be used). Tried once per process;
    `import_fa4.cache_clear()` makes the next call try again."""
    try:
        import flash_attn.cute as fa4
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch  # noqa: F401  (the block-sparse API)
    except (ImportError, OSError, RuntimeError) as exc:  # not installed, or its CUDA/DSL libraries fail to load
        return None, f"flash-attn-4 cannot be imported ({type(exc).__name__}: {exc}); pip install 'k6fast[fa4]'"
    return fa4, ""


def fa4_version() -> str | None:
    try:
        return metadata.version("flash-attn-4")
    except metadata.PackageNotFoundError:
        return None


def fa4_unavailable_reason(device: torch.device) -> str | None:
    """None where flash-attn-4's dense forward can run on `device`, else why not (for a log line)."""
    if device.type != "cuda":
        return f"flash-attn-4 needs a CUDA device, found {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in DENSE_MAJORS:
        return f"sm_{major}{minor}: flash-attn-4 is used on sm_90, sm_100, sm_110 and sm_120 only"
    return import_fa4()[1] or None


def fa4_shapes_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether flash-attn-4 takes these [B, N, H, D] tensors (dtype, matching shapes, head_dim), device aside."""
    return (
        q.ndim == 4
        and q.dtype in _DTYPES
        and q.dtype == k.dtype == v.dtype
        and k.shape == v.shape
        and k.shape[0] == q.shape[0]
        and k.shape[2:] == q.shape[2:]
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= 128
    )


def fa4_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `fa4_attention` takes these [B, N, H, D] inputs on their device."""
    return q.is_cuda and fa4_shapes_ok(q, k, v) and fa4_unavailable_reason(q.device) is None


def fa4_block_sparse_runs_on(device: torch.device) -> bool:
    """Whether flash-attn-4's block-sparse forward takes k6fast's 128 x 128 blocks on `device` (sm_90, the package
    importable)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] not in BLOCK_SPARSE_MAJORS:
        return False
    return import_fa4()[0] is not None


def fa4_block_sparse_supported(q: torch.Tensor) -> bool:
    """Whether `fa4_block_sparse_attention` takes q's dtype and head_dim on its device (bf16/fp16, D % 8, D <= 128)."""
    if q.dtype not in _DTYPES or q.shape[-1] % 8 or q.shape[-1] > 128:
        return False
    return fa4_block_sparse_runs_on(q.device)


def _module():
    fa4, why = import_fa4()
    if fa4 is None:
        raise RuntimeError(why)
    return fa4


def _out(result) -> torch.Tensor:
    return result[0] if isinstance(result, tuple) else result  # (out, lse) in 4.0.0b36


def fa4_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Exact softmax(q·kᵀ/sqrt(D))·v. q: [B, M, H, D], k/v: [B, N, H, D] bf16/fp16 -> [B, M, H, D] in q's dtype."""
    if not fa4_supported(q, k, v):
        raise ValueError(
            "fa4_attention: expected [B, N, H, D] bf16/fp16 q, k, v of one dtype, head_dim a multiple of 8 up to 128, "
            f"on a GPU flash-attn-4 runs on; found {tuple(q.shape)}/{tuple(k.shape)}/{tuple(v.shape)} {q.dtype} on "
            f"{q.device} ({fa4_unavailable_reason(q.device) if q.is_cuda else 'not CUDA'})"
        )
    return _out(_module().flash_attn_func(q, k, v))


def fa4_block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_idx: torch.Tensor, kv_cnt: torch.Tensor, block: int
) -> torch.Tensor:
    """Block-sparse attention through flash-attn-4's full blocks (sparse_attention.py states the contract:
    kv_idx int32 [B, H, Mb, K] ascending, kv_cnt int32 [B, H, Mb], `block`-token blocks)."""
    if not fa4_block_sparse_supported(q):
        cap = torch.cuda.get_device_capability(q.device) if q.is_cuda else None
        raise ValueError(
            f"fa4_block_sparse_attention: expected bf16/fp16 CUDA tensors on sm_90 with flash-attn-4 "
            f"importable, found {q.dtype} on {q.device} (capability {cap}; {import_fa4()[1] or 'imports'})"
        )
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    b, h, mb = kv_cnt.shape
    no_masked = torch.zeros((b, h, mb), dtype=torch.int32, device=q.device)
    tensors = BlockSparseTensorsTorch(
        mask_block_cnt=no_masked,
        mask_block_idx=no_masked[..., None],
        full_block_cnt=kv_cnt,
        full_block_idx=kv_idx,
        block_size=(block, block),
    )
    return _out(_module().flash_attn_func(q, k, v, block_sparse_tensors=tensors))


# For compiled callers: one opaque op, so flash-attn-4's Python (argument checks, its compile cache) stays out of the
# traced graph.
@torch.library.custom_op("k6fast::fa4_attention", mutates_args=())
def fa4_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`fa4_attention(q, k, v)`: [B, M, H, D] in, a contiguous [B, M, H, D] out."""
    return fa4_attention(q, k, v).contiguous()


@fa4_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return q.new_empty(q.shape)
