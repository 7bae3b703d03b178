"""Ahead-of-time builds: each Triton or Gluon kernel body by name, for checks that compile a kernel for a GPU target
without that GPU (Triton compiles for a `GPUTarget` on the CPU, and its wheel ships ptxas, cuobjdump and nvdisasm).
tests/test_sass_geforce.py reads the SASS of every kernel a GeForce arm runs; the sm_90 tests read the PTX of the Gluon
cores; tests/test_sparse_attention.py sizes the sm_120 build's shared memory.

A body stays private to its module (`_op_kernel`, launched by that module's `op(...)` only, the house layout);
`body(name)` is the one public way to reach one, so a check names what it builds, and a body renamed or moved breaks
here, beside the kernels, rather than in a test. The launch parameters the launchers use (autotune configs, tile
sizes) are public names of their modules.
"""

from __future__ import annotations

import importlib

# name → (module in k6fast/kernels/, the body's name there)
BODIES: dict[str, tuple[str, str]] = {
    "fp16acc_linear": ("fp16acc_linear", "_fp16acc_linear_kernel"),
    "fp8_fp16acc": ("fp8_fp16acc", "_fp8_fp16acc_kernel"),
    "quantize_rows_fp8": ("fp8_linear", "_quantize_rows_fp8_kernel"),
    "sampled_column_absmax": ("fp8_outliers", "_sampled_column_absmax_kernel"),
    "select_top_channels": ("fp8_outliers", "_select_top_channels_kernel"),
    "layernorm_modulate": ("adaln", "_layernorm_modulate_kernel"),
    "gated_residual": ("adaln", "_gated_residual_kernel"),
    "gated_residual_modulate": ("adaln", "_gated_residual_modulate_kernel"),
    "rms_norm_rope": ("qk_norm_rope", "_rms_norm_rope_kernel"),
    "quantize_q": ("quant_attention_prologue", "_quantize_q_kernel"),
    "kv_stats": ("quant_attention_prologue", "_kv_stats_kernel"),
    "kv_quantize": ("quant_attention_prologue", "_kv_quantize_kernel"),
    "quant_attention": ("quant_attention_core", "_quant_attention_kernel"),
    "sparse_attention": ("sparse_attention", "_sparse_attention_kernel"),
    # Gluon (sm_90): present only where this Triton has Gluon (`gluon_hopper.GLUON_AVAILABLE`).
    "fp16acc_wgmma": ("fp16acc_wgmma", "_fp16acc_wgmma_kernel"),
    "quant_attention_wgmma": ("quant_attention_wgmma", "_qattn_wgmma_kernel"),
}


def body(name: str):
    """The `@triton.jit` (or `@gluon.jit`) function of kernel `name` (a key of `BODIES`), as its launcher launches it:
    pass it to `triton.compiler.ASTSource` to build it for a target."""
    if name not in BODIES:
        raise KeyError(f"no kernel body {name!r}; expected one of {', '.join(sorted(BODIES))}")
    module, attr = BODIES[name]
    found = getattr(importlib.import_module(f"{__package__}.{module}"), attr, None)
    if found is None:
        raise LookupError(f"kernels.{module} defines no {attr} here (a Gluon body needs a Triton with Gluon)")
    return found
