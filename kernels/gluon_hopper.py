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
