"""GeForce kernels proven at build time: every Triton kernel a GeForce arm runs, compiled for sm_120 (RTX 50) and
sm_89 (RTX 40) on the CPU, its SASS read back.

Triton 3.8 compiles for a `GPUTarget` without a GPU, and its wheel ships `ptxas`, `cuobjdump` and `nvdisasm`, so this
runs in CI (a clean venv, no GPU, no CUDA toolkit). What is checked, per kernel and target, at the launch parameters
the kernel's launcher uses at W1 shapes (its autotune configs, for the GEMMs):
- it builds: a kernel that does not compile for an architecture `auto` sends it to fails here;
- its tensor-core instructions are the ones the arm exists for: FP16-accumulate `HMMA.16816.F16` in the fp16acc GEMM,
  `QMMA.16832.F16.E4M3.E4M3` in the FP16-chunk FP8 GEMM, INT8 `IMMA` for Q·Kᵀ and FP16-accumulate FP8 `QMMA` for P·V
  in the quantized attention; no FP32-accumulate form of either (the half-rate fallback on GeForce);
- register spills: local-memory stores (`STL` in the SASS) within the bound `SPILL_BOUNDS` states per kernel (none,
  except where a kernel spills today: its count then is the bound, so it cannot grow unnoticed).

Found here (Triton 3.8, the default attention config, which is what sm_89/sm_120 get): the quantized attention runs
Q·Kᵀ on `IMMA.16832.S8.S8.SAT` and P·V on `QMMA.16832.F16.E4M3.E4M3` only: the prologue quantizes V to ±2.25 there
and the core sums each 32-key chunk in FP16, the chunks in FP32 (`pv_fp16_acc_on`; its numerics are checked in
tests/test_quant_attention_fp16acc.py). At head_dim 128 its 128-row tile spills on sm_89 (17 stores; none on
sm_120; with the FP32-accumulate P·V it was 30 and 6), as does the K/V quantization pass (84 on sm_120, 182 on sm_89).
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import pytest
import triton
from kernel_testing import W1_TOKENS
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.tools.disasm import get_sass

from k6fast.kernels import adaln, aot, fp8_fp16acc, fp8_linear, fp8_outliers, fp16acc_linear
from k6fast.kernels import quant_attention as qa
from k6fast.kernels import quant_attention_prologue as qp
from k6fast.kernels.attention_constants import FP8_MAX, V_FP16_ACC_MAX

TARGETS = {"sm_120": 120, "sm_89": 89}
# The stated spill bounds (STL instructions): none, but for two kernels that spill today.
SPILL_BOUNDS = {
    # head_dim 128 on the default 128x64-key tile, 8 warps, FP16-accumulate P·V: 17 stores on sm_89 (255 registers),
    # none on sm_120 (Triton 3.6: 15 and 0); an sm_89 entry in quant_attention_core's `_CONFIGS` is the remaining fix.
    ("_quant_attention_kernel", 128): 17,
    # the K/V quantization pass at head_dim 128, 4 warps over 64-key blocks: 84 stores on sm_120, 182 on sm_89 (0 at
    # head_dim 64); the whole prologue is 1.0 ms of ~57 ms on an H200 (measurements/sessions/2026-11-29_attention-tree).
    ("_kv_quantize_kernel", 128): 182,
    # one program per call, choosing 32 of 16,384 channels: a few stores of its cumsum on sm_120, off the hot path.
    ("_select_top_channels_kernel", None): 8,
}
MAX_SPILL_STORES = 0


def spill_bound(name: str, variant: int | None = None) -> int:
    return SPILL_BOUNDS.get((name, variant), MAX_SPILL_STORES)


DIM, FF_DIM = 4096, 16384


@dataclass(frozen=True)
class Build:
    name: str
    sass: str
    mma: collections.Counter  # tensor-core opcode (with modifiers) → count
    registers: int
    spill_stores: int  # STL instructions


def build(fn, cap: int, pointers: dict[str, str], consts: dict, *, num_warps: int, num_stages: int = 3) -> Build:
    """Compile the JITFunction `fn` for sm_`cap`: pointer params typed by `pointers`, params in `consts` fixed (the
    kernel's constexprs, and ints a launch specialises, such as unit strides), other params i32 (fp32 for `eps` and
    the scalar scale). Pointers and `stride*` ints carry the 16-divisibility a launch on torch allocations sees."""
    signature, attrs = {}, {}
    for i, p in enumerate(fn.params):
        if p.name in consts:
            signature[p.name] = "constexpr"
        elif p.is_constexpr:
            raise KeyError(f"{fn.__name__}: no value for constexpr {p.name}")
        elif p.name in pointers:
            signature[p.name] = pointers[p.name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[p.name] = "fp32" if p.name in ("eps", "scale_mult") else "i32"
            if p.name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    compiled = triton.compile(
        src, target=GPUTarget("cuda", cap, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )
    sass = get_sass(compiled.asm["cubin"])
    mma = collections.Counter(
        m.group(1) for m in re.finditer(r"\b((?:HMMA|IMMA|QMMA|OMMA|UTCQMMA|UTCHMMA)\.[\w.]+)", sass)
    )
    return Build(fn.__name__, sass, mma, _registers(compiled.asm["cubin"]), len(re.findall(r"\bSTL\b", sass)))


def _registers(cubin: bytes) -> int:
    fd, path = tempfile.mkstemp(suffix=".cubin")
    try:
        os.write(fd, cubin)
        os.close(fd)
        usage = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", path], capture_output=True, text=True)
    finally:
        os.remove(path)
    return int(re.search(r"REG:(\d+)", usage.stdout).group(1))


def _config_kwargs(config: triton.Config) -> tuple[dict, int, int]:
    return dict(config.kwargs), config.num_warps, config.num_stages


# ---------------------------------------------------------------------------------------------------------------
# The GEMMs
# ---------------------------------------------------------------------------------------------------------------

_GEMM_POINTERS = {"x_ptr": "*bf16", "w_ptr": "*fp16", "bias_ptr": "*bf16", "y_ptr": "*bf16"}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("config", fp16acc_linear.FP16ACC_CONFIGS, ids=str)
def test_fp16acc_gemm_accumulates_in_fp16(target, config) -> None:
    # GeForce runs the default 32-wide chunk (`fp16acc_default_chunk` off sm_90): one 32-deep MMA per FP32 add.
    block_k, steps = fp16acc_linear.fp16acc_chunk_steps(32)
    tile, warps, stages = _config_kwargs(config)
    consts = {"HAS_BIAS": True, "EVEN_K": True, "BLOCK_K": block_k, "CHUNK_STEPS": steps, **tile}
    b = build(aot.body("fp16acc_linear"), TARGETS[target], _GEMM_POINTERS, consts, num_warps=warps,
              num_stages=stages)  # fmt: skip
    assert set(b.mma) == {"HMMA.16816.F16"}, f"{target}: expected FP16-accumulate HMMA only, found {dict(b.mma)}"
    assert b.spill_stores <= MAX_SPILL_STORES, f"{target}: {b.spill_stores} spill stores, {b.registers} registers"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("config", fp8_fp16acc.FP8_FP16ACC_CONFIGS, ids=str)
def test_fp8_gemm_accumulates_chunks_in_fp16(target, config) -> None:
    tile, warps, stages = _config_kwargs(config)
    pointers = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32",
                "bias_ptr": "*bf16", "y_ptr": "*bf16"}  # fmt: skip
    consts = {"HAS_BIAS": True, "EVEN_K": True, "BLOCK_K": fp8_fp16acc.DEFAULT_CHUNK, **tile}
    b = build(aot.body("fp8_fp16acc"), TARGETS[target], pointers, consts, num_warps=warps, num_stages=stages)
    assert set(b.mma) == {"QMMA.16832.F16.E4M3.E4M3"}, f"{target}: expected FP16-accumulate QMMA, found {dict(b.mma)}"
    assert b.spill_stores <= MAX_SPILL_STORES, f"{target}: {b.spill_stores} spill stores, {b.registers} registers"


# ---------------------------------------------------------------------------------------------------------------
# The quantized attention (the Triton kernels of k6fast/kernels/quant_attention_prologue.py and
# quant_attention_core.py, as `quant_attention` launches them off sm_90)
# ---------------------------------------------------------------------------------------------------------------


def _fp16_acc(target: str) -> bool:
    """What the prologue and core choose on this target (`quantize_qkv`'s default there)."""
    return qp.pv_fp16_acc_on(divmod(TARGETS[target], 10))


def _attention_core(target: str, head_dim: int) -> Build:
    cfg = qa.QuantAttentionConfig()  # `config_for` has no sm_89/sm_120 entry: the default config runs there
    pointers = {"Q8": "*i8", "QS": "*fp32", "K8": "*i8", "KS": "*fp32", "VT": "*fp8e4nv", "VS": "*fp32",
                "VO": "*fp32", "Out": "*bf16"}  # fmt: skip
    consts = {"stride_od": 1, "HEAD_DIM": head_dim, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
              "Q_BLK": qa.Q_BLOCK, "PV_FP8": True, "FP8_NO_FOLD": True, "UNROLL": cfg.unroll,
              "EXP2_POLY": cfg.exp2_poly, "PIPELINE": cfg.pipeline, "PV_FP16_ACC": _fp16_acc(target)}  # fmt: skip
    return build(aot.body("quant_attention"), TARGETS[target], pointers, consts, num_warps=cfg.num_warps,
                 num_stages=cfg.num_stages)  # fmt: skip


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("head_dim", qa.SUPPORTED_HEAD_DIMS)
def test_quant_attention_builds_with_int8_qk(target, head_dim) -> None:
    b = _attention_core(target, head_dim)
    assert any(op.startswith("IMMA.16832.S8.S8") for op in b.mma), f"{target}: no INT8 IMMA for Q·Kᵀ: {dict(b.mma)}"
    assert any(op.startswith("QMMA.16832") for op in b.mma), f"{target}: no FP8 QMMA for P·V: {dict(b.mma)}"
    bound = spill_bound(b.name, head_dim)
    assert b.spill_stores <= bound, f"{target}: {b.spill_stores} spill stores (bound {bound}), {b.registers} registers"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("head_dim", qa.SUPPORTED_HEAD_DIMS)
def test_quant_attention_pv_accumulates_in_fp16(target, head_dim) -> None:
    assert _fp16_acc(target), f"{target}: the FP16-accumulate P·V is not chosen there"
    b = _attention_core(target, head_dim)
    pv = {op for op in b.mma if op.startswith("QMMA")}
    assert pv == {"QMMA.16832.F16.E4M3.E4M3"}, f"{target}: P·V QMMA forms {pv}"
    # No overflow by construction: every 32-key chunk is one MMA from zero (its C operand RZ), so no FP16 accumulator
    # carries a partial sum from one chunk into the next (the FP32 form chains its tile's MMAs on one register).
    c_operands = re.findall(r"\bQMMA\.[\w.]+\s+[\w.]+,\s*[\w.]+,\s*[\w.]+,\s*(\w+)", b.sass)  # D, A, B, C
    assert len(c_operands) == sum(b.mma[op] for op in pv), f"{target}: unparsed QMMA operands"
    chained = [c for c in c_operands if c != "RZ"]
    assert not chained, f"{target}: {len(chained)} of {len(c_operands)} QMMAs accumulate onto a register"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("head_dim", qa.SUPPORTED_HEAD_DIMS)
def test_quant_attention_prologue_builds(target, head_dim) -> None:
    cap = TARGETS[target]
    src = {"stride_d": 1}
    builds = [
        build(aot.body("quantize_q"), cap, {"Q": "*bf16", "Q8": "*i8", "QS": "*fp32"},
              {**src, "HEAD_DIM": head_dim, "BLOCK": qa.Q_BLOCK}, num_warps=8),
        build(aot.body("kv_stats"), cap, {"K": "*bf16", "V": "*bf16", "STATS": "*fp32"},
              {"stride_kd": 1, "stride_vd": 1, "HEAD_DIM": head_dim, "BLOCK": qp.STATS_ROWS,
               "CHUNK": qp.STATS_CHUNK, "PV_FP8": True}, num_warps=4),
        build(aot.body("kv_quantize"), cap,
              {"K": "*bf16", "V": "*bf16", "KMEAN": "*fp32", "VMEAN": "*fp32", "VMAX": "*fp32", "K8": "*i8",
               "KS": "*fp32", "VT": "*fp8e4nv", "VQSUM": "*fp32"},
              {"stride_kd": 1, "stride_vd": 1, "HEAD_DIM": head_dim, "BLOCK": qa.K_BLOCK,
               "SUB": qp.KV_QUANT_ROWS // qa.K_BLOCK, "PV_FP8": True, "V_PERM": False,
               "V_QMAX": V_FP16_ACC_MAX if _fp16_acc(target) else FP8_MAX},
              num_warps=qp.KV_QUANT_WARPS),
    ]  # fmt: skip
    for b in builds:
        bound = spill_bound(b.name, head_dim)
        assert b.spill_stores <= bound, f"{b.name} {target}: {b.spill_stores} spill stores (bound {bound})"


# ---------------------------------------------------------------------------------------------------------------
# What else the arms launch: the fp8 arm's row quantization and outlier choice, the fused elementwise kernels
# ---------------------------------------------------------------------------------------------------------------


def _elementwise_builds(cap: int) -> list[Build]:
    norm_d, norm_rows, norm_warps = adaln.row_tile(DIM, W1_TOKENS, adaln.NORM_TILE)
    res_d, res_rows, res_warps = adaln.row_tile(DIM, W1_TOKENS, 8192)
    builds = []
    for k in (DIM, FF_DIM):  # both GEMM input widths of the fp8 arm, with the 32 outlier columns it appends
        block_k = min(triton.next_power_of_2(k), fp8_linear.MAX_SINGLE_PASS)
        rows = max(1, min(4096 // block_k, W1_TOKENS))
        builds.append(build(
            aot.body("quantize_rows_fp8"), cap,
            {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "cols_ptr": "*i32"},
            {"ROWS": rows, "BLOCK_K": block_k, "SINGLE_PASS": block_k >= k, "C": fp8_outliers.OUTLIER_WIDTH,
             "RESIDUAL": False, "QMAX": fp8_fp16acc.FP16_CHUNK_QMAX[fp8_fp16acc.DEFAULT_CHUNK]},
            num_warps=min(16, max(4, rows * block_k // 1024)),
        ))  # fmt: skip
    builds += [
        build(aot.body("sampled_column_absmax"), cap, {"x_ptr": "*bf16", "amax_ptr": "*i32"},
              {"SPLIT": 8, "ROWS": fp8_outliers.ABSMAX_ROWS, "BLOCK_C": fp8_outliers.ABSMAX_COLUMNS}, num_warps=4),
        build(aot.body("select_top_channels"), cap, {"amax_ptr": "*i32", "out_ptr": "*i32"},
              {"COUNT": 32, "WIDTH": fp8_outliers.OUTLIER_WIDTH, "BLOCK": FF_DIM}, num_warps=16),
        build(aot.body("layernorm_modulate"), cap,
              {"x_ptr": "*bf16", "scale_ptr": "*fp32", "shift_ptr": "*fp32", "y_ptr": "*bf16", "q_scale_ptr": "*fp32"},
              {"stride_scale_d": 1, "stride_shift_d": 1, "OUT_FP8": False, "ROWS": norm_rows, "BLOCK_D": norm_d},
              num_warps=norm_warps),
        build(aot.body("gated_residual"), cap,
              {"x_ptr": "*bf16", "out_ptr": "*bf16", "gate_ptr": "*fp32", "y_ptr": "*bf16"},
              {"stride_gate_d": 1, "ROWS": res_rows, "BLOCK_D": res_d}, num_warps=res_warps),
        build(aot.body("gated_residual_modulate"), cap,
              {"x_ptr": "*bf16", "out_ptr": "*bf16", "gate_ptr": "*fp32", "scale_ptr": "*fp32", "shift_ptr": "*fp32",
               "x_new_ptr": "*bf16", "y_ptr": "*bf16"},
              {"stride_gate_d": 1, "stride_scale_d": 1, "stride_shift_d": 1, "ROWS": norm_rows, "BLOCK_D": norm_d},
              num_warps=norm_warps),
        build(aot.body("rms_norm_rope"), cap,
              {"x_ptr": "*bf16", "w_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "y_ptr": "*bf16"},
              {"D": 128, "BLOCK_D": 128, "ROWS": 4096 // 128, "ROPE": True}, num_warps=4),
    ]  # fmt: skip
    return builds


@pytest.mark.parametrize("target", TARGETS)
def test_arm_elementwise_kernels_build_without_spills(target) -> None:
    for b in _elementwise_builds(TARGETS[target]):
        assert not b.mma, f"{b.name}: unexpected tensor-core instructions {dict(b.mma)}"
        bound = spill_bound(b.name)
        assert b.spill_stores <= bound, f"{b.name} {target}: {b.spill_stores} spill stores (bound {bound})"
