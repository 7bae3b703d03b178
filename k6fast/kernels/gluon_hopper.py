"""The Gluon names k6fast's sm_90 kernels use, imported in one place, and what their CTAs share.

Gluon is Triton's experimental lower-level language: a Triton without it (or with another API) leaves
`GLUON_AVAILABLE` False, and each kernel module then reports itself unsupported so its callers fall back.
"""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    GLUON_AVAILABLE = True
except ImportError:  # pragma: no cover - exercised only on Tritons without Gluon
    GLUON_AVAILABLE = False

__all__ = [
    "GLUON_AVAILABLE",
    "TensorDescriptor",
    "fence_async_shared",
    "gl",
    "gluon",
    "mbarrier",
    "ring_barriers",
    "row_reduce",
    "tma",
    "warpgroup_mma",
    "warpgroup_mma_wait",
]


if GLUON_AVAILABLE:

    @gluon.jit
    def ring_barriers(STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
        """(ready, empty): one mbarrier pair per slot of a STAGES-deep TMA ring, initialised. `ready[s]` completes
        when the producer's loads into slot s land; `empty[s]` when each of CONSUMERS warpgroups has released it.
        The caller fences (`fence_async_shared`) after its own barriers are initialised too."""
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=CONSUMERS)
        return ready, empty

    @gluon.jit
    def _reduce(x, axis: gl.constexpr, IS_MAX: gl.constexpr):
        return gl.max(x, axis) if IS_MAX else gl.sum(x, axis)

    @gluon.jit
    def row_reduce(x, IS_MAX: gl.constexpr, like):
        """Row max or sum of a wgmma accumulator tile [rows, C] (C <= 128) as a tree, in the layout of `like` (the
        caller's running row statistic; the conversion is checked to move nothing).

        A thread's 2·C/8 values per row are folded in log2 steps, then the 4 lanes of the row. Under Triton 3.6
        `gl.max`/`gl.sum` alone fold a thread's values one after another, a chain of C/4 dependent instructions on the
        softmax's critical path (the quantized attention core ran slower with it on an H200,
        measurements/sessions/2026-11-29_attention-tree/README.md); Triton 3.8 builds the same tree itself."""
        for _ in gl.static_range(4):  # C <= 128: at most four halvings reach 8 columns
            if x.shape[1] > 8:  # column c with c + C/2, both in one thread while C > 8
                x = _reduce(gl.reshape(x, [x.shape[0], 2, x.shape[1] // 2]), 1, IS_MAX)
        return gl.convert_layout(_reduce(x, 1, IS_MAX), like.type.layout, assert_trivial=True)
