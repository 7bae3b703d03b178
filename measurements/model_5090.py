"""A performance model of one W1 request on an RTX 5090 (sm_120), per arm: MODELLED figures, not measurements.

Inputs:
- H200 profiles recorded here (device time per kernel category of one Pro fused block at W1): the `final` and `fast`
  DiT steps (measurements/sessions/2026-11-29_h200-kernels2/profile_{final,fast}_w1.json, 6 blocks) and the eager
  reference block (…/block_arms.json). From them: the memory-bound parts (elementwise and quantization passes, scaled
  by the ratio of DRAM bandwidths) and the launch gaps (kept as they are).
- FLOPs per block from the Pro shapes (`block_flops`), the compute-bound parts, divided by published sm_120 rates,
  each with its source (`RATES`).
- PCIe copies of the streamed blocks (the blocks the 32 GB card cannot keep), hidden behind compute but the first.
- One calibration: the seconds outside the DiT (text encoding, VAE decode, audio, mux) are fitted so that the
  fork's BF16 reference on a real 5090 (234.6 s, fractalyze/vllm-omni Kandinsky 6 showcase) is met; the fork's tuned
  arm (151.05 s, same source) is then predicted, and its error is the model's stated error.

Run: python measurements/model_5090.py [--out measurements/model_5090.md] [--json model.json]
Writes the Markdown table (arms, calibration, ranking of GeForce work) and prints it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
SESSION = HERE / "sessions" / "2026-11-29_h200-kernels2"
GiB = 2**30


@dataclass(frozen=True)
class Rate:
    value: float  # FLOP/s (or B/s)
    source: str


_FLASHINFER = "flashinfer issue 3628 / PR 4149; Dao-AILab/quack PR 153 (RTX 5090 GEMM rates)"
_SAGE = "SageAttention2++ paper (arXiv 2505.21136): ≈560 TOPS on an RTX 5090, 2.7x FlashAttention2"
RATES = {
    "gemm_bf16": Rate(250e12, f"BF16 inputs, FP32 accumulation ≈250 TFLOP/s: {_FLASHINFER}"),
    "gemm_fp16acc": Rate(
        1.5 * 250e12,
        "the fork's Triton FP16-accumulate GEMM: 1.46-1.57x cuBLAS BF16 at M=50,220 on an RTX 5090 (fractalyze/"
        "vllm-omni Kandinsky 6 showcase); FP16-accumulate MMA itself is 2x",
    ),
    "gemm_fp16acc_2x": Rate(500e12, f"FP16-accumulate MMA at twice the BF16 FP32-accumulate rate: {_FLASHINFER}"),
    "gemm_fp8": Rate(500e12, f"FP8, FP32 accumulation ≈500 TFLOP/s (half rate on consumer Blackwell): {_FLASHINFER}"),
    "gemm_fp8_fp16acc": Rate(1000e12, f"FP8 with FP16 accumulation ≈1,000 TFLOP/s: {_FLASHINFER}"),
    "gemm_mxfp8": Rate(1000e12, f"block-scaled MXFP8 ≈1,000 TFLOP/s: {_FLASHINFER}"),
    "gemm_nvfp4": Rate(1000e12, f"NVFP4 through torch._scaled_mm ≈1,000-1,340 TFLOP/s (low end): {_FLASHINFER}"),
    "attn_exact": Rate(560e12 / 2.7, f"FlashAttention2-class BF16 attention, 560/2.7: {_SAGE}"),
    "attn_quant_f16pv": Rate(560e12, f"INT8 Q·K, FP8 P·V with FP16 accumulation (SageAttention2++): {_SAGE}"),
    "attn_quant_f32pv": Rate(0.0, "derived: as SageAttention2++ but P·V at the FP32-accumulate rate (see below)"),
    "dram": Rate(1.792e12, "RTX 5090 memory bandwidth 1,792 GB/s (NVIDIA's specification)"),
    "pcie": Rate(
        50e9,
        "pinned H2D over PCIe 5 x16 ≈50 GB/s, measured on the H200 host (measurements/sessions/2026-11-29_streaming)",
    ),  # fmt: skip
}
H200_DRAM = 4.8e12  # NVIDIA's H200 specification


def derive_rates(rates: dict[str, Rate]) -> dict[str, Rate]:
    """Quantized attention with P·V at FP32 accumulation (what k6fast/kernels/quant_attention_core.py issued on sm_120
    before its FP16-accumulate P·V, tests/test_sass_geforce.py; kept to rank that work): Q·K and P·V are half the FLOPs
    each; at SageAttention2++'s 560 both MMAs run at the FP16-accumulate FP8 rate R and the rest (softmax, loads)
    takes t_s = F (1/560 - 1/R); halving P·V's rate adds F/(2R)."""
    r8, sage = rates["gemm_fp8_fp16acc"].value, rates["attn_quant_f16pv"].value
    per_flop = 1 / sage + 1 / (2 * r8)
    out = dict(rates)
    out["attn_quant_f32pv"] = dataclasses.replace(rates["attn_quant_f32pv"], value=1 / per_flop)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Work per block (Pro at W1) and the H200 profile
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shapes:
    video: int = 50220  # tokens
    audio: int = 218
    text: int = 64
    dim: int = 4096
    dim_a: int = 2048
    ff: int = 16384
    ff_a: int = 7168


def block_flops(s: Shapes = Shapes()) -> dict[str, float]:
    """FLOPs of one fused block: its GEMMs, and its attention per call site (4·Nq·Nk·dim)."""
    d, da = s.dim, s.dim_a
    video = s.video * (8 * d * d + 2 * d * da + 2 * d * s.ff)  # self qkvo, text q/o, audio q/o, av k/v, FFN
    audio = s.audio * (8 * da * da + 2 * da * d + 2 * da * s.ff_a)
    text = s.text * (2 * d * d + 2 * da * da)
    return {
        "gemm": 2.0 * (video + audio + text),
        "video_self": 4.0 * s.video * s.video * d,
        "audio_self": 4.0 * s.audio * s.audio * da,
        "cross": 4.0 * (s.video * s.text * d + s.audio * s.text * da + s.video * s.audio * d + s.audio * s.video * da),
    }


@dataclass(frozen=True)
class H200Block:
    """Per fused block, seconds on the H200: memory-bound work, quantization passes and launch gaps."""

    elementwise: float  # fused + other elementwise kernels
    gemm_quant: float  # activation / weight quantization passes of a quantized GEMM
    attn_prologue: float  # q/k/v quantization of the quantized attention
    gap: float  # launches and idle device time, copies excluded


def _per_block(profile: dict, blocks: int) -> H200Block:
    step = profile.get("step", profile)
    cats = step["categories"]
    quant = sum(k["s"] for k in step["top_kernels"] if k["category"] == "gemm" and "quantize" in k["name"])
    prologue = sum(k["s"] for k in step["top_kernels"] if k["category"] == "attention" and "_kv_" in k["name"])
    prologue += sum(k["s"] for k in step["top_kernels"] if k["name"] == "_quantize_q_kernel")
    gap = max(0.0, step["gap_s"] - step.get("copy_exposed_s", 0.0))
    elementwise = cats["fused_elementwise"]["s"] + cats["elementwise"]["s"]
    return H200Block(elementwise / blocks, quant / blocks, prologue / blocks, gap / blocks)


def load_h200_profiles(session: Path = SESSION) -> dict[str, H200Block]:
    final = json.loads((session / "profile_final_w1.json").read_text())
    fast = json.loads((session / "profile_fast_w1.json").read_text())
    block = json.loads((session / "block_arms.json").read_text())
    return {
        "fused": _per_block(final, final["fused_blocks"]),
        "fused_fp8": _per_block(fast, fast["fused_blocks"]),
        "eager": _per_block(block["variants"]["reference"]["profile"], 1),
    }


# ---------------------------------------------------------------------------------------------------------------
# Arms
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arm:
    name: str
    gemm: str  # RATES key
    profile: str  # load_h200_profiles key: which H200 block's memory-bound work and gaps this arm has
    quant_sites: tuple[str, ...] = ()  # attention sites on the quantized kernel: "video_self", "audio_self"
    quant_rate: str = "attn_quant_f16pv"  # what k6fast/kernels/quant_attention_core.py issues on sm_120 (FP16-acc P·V)
    exact_blocks: int = 0  # first and last N blocks keep exact attention
    exact_calls: int = 0  # first N DiT calls keep exact attention
    dit_calls: int = 10  # 10 PiFlow steps minus cached ones
    gemm_quant: bool = False  # pays quantization passes (fp8 / mxfp8 / nvfp4 GEMMs)
    sparse_density: float = 1.0  # block-sparse video self-attention: the share of key blocks kept (1.0 = dense)
    block_bytes: float = 0.899 * GiB  # what a streamed block moves (bf16 weights)
    note: str = ""


@dataclass(frozen=True)
class Machine:
    blocks: int = 60
    vram: float = 32 * GiB
    fixed: float = (2.54 + 7.13 + 2.0) * GiB  # embeddings/text blocks/heads, activations, reserve (k6fast's W1 plan)


@dataclass
class Prediction:
    arm: str
    dit_s: float
    per_call_s: list[float] = field(default_factory=list)
    exposed_copy_s: float = 0.0
    resident_blocks: int = 0
    parts_s: dict[str, float] = field(default_factory=dict)  # per block, exact-attention call


def block_seconds(arm: Arm, rates: dict[str, Rate], h200: H200Block, flops: dict, quantized: bool) -> dict[str, float]:
    """One fused block of one DiT call on the 5090, by part."""
    mem = H200_DRAM / rates["dram"].value  # memory-bound H200 time → 5090 time
    attn = flops["cross"] / rates["attn_exact"].value
    prologue = 0.0
    for site in ("video_self", "audio_self"):
        if quantized and site == "video_self" and arm.sparse_density < 1.0:
            # The sparse arm takes video self-attention before the quantized kernel would: on sm_120 k6fast's Triton
            # block-sparse kernel (BF16 mma.sync), modelled at the exact rate on the kept share of the work.
            attn += arm.sparse_density * flops[site] / rates["attn_exact"].value
            continue
        on_quant = quantized and site in arm.quant_sites
        attn += flops[site] / rates[arm.quant_rate if on_quant else "attn_exact"].value
        prologue += h200.attn_prologue * mem if on_quant and site == "video_self" else 0.0
    return {
        "gemm": flops["gemm"] / rates[arm.gemm].value + (h200.gemm_quant * mem if arm.gemm_quant else 0.0),
        "attention": attn + prologue,
        "elementwise": h200.elementwise * mem,
        "gap": h200.gap,
    }


def predict(arm: Arm, rates: dict[str, Rate], h200: dict[str, H200Block], machine: Machine = Machine(),
            flops: dict | None = None) -> Prediction:  # fmt: skip
    """DiT seconds of one W1 request for `arm`: every call's blocks, plus the streamed blocks' exposed copies."""
    flops = flops or block_flops()
    profile = h200[arm.profile]
    slot = arm.block_bytes
    resident = max(0, min(machine.blocks, int((machine.vram - machine.fixed - 2 * slot) // slot)))
    streamed = machine.blocks - resident
    copy = slot / rates["pcie"].value
    pred = Prediction(arm.name, 0.0, resident_blocks=resident)
    for call in range(arm.dit_calls):
        total, min_block = 0.0, float("inf")
        for b in range(machine.blocks):
            quantized = (bool(arm.quant_sites) or arm.sparse_density < 1.0) and call >= arm.exact_calls
            quantized &= arm.exact_blocks <= b < machine.blocks - arm.exact_blocks
            parts = block_seconds(arm, rates, profile, flops, quantized)
            if call == 0 and b == 0:
                pred.parts_s = parts
            seconds = sum(parts.values())
            total += seconds
            min_block = min(min_block, seconds)
        # The first streamed block's copy waits for nothing to overlap; later copies hide behind a block's compute.
        exposed = (copy + streamed * max(0.0, copy - min_block)) if streamed else 0.0
        pred.per_call_s.append(total + exposed)
        pred.exposed_copy_s += exposed
    pred.dit_s = sum(pred.per_call_s)
    return pred


def arms() -> dict[str, Arm]:
    """The fork's two configurations (the anchors) and k6fast's arms as they resolve on sm_120."""
    self_sites = ("video_self", "audio_self")
    return {
        "fork-reference": Arm("fork: BF16 reference, compiled", "gemm_bf16", "fused",
                              note="the anchor: 234.6 s measured"),
        "fork-final": Arm("fork: Sage2 on blocks 6-53 from step 2, step 8 cached, FP16-acc GEMM", "gemm_fp16acc",
                          "fused", quant_sites=self_sites, quant_rate="attn_quant_f16pv", exact_blocks=6,
                          exact_calls=1, dit_calls=9, note="the check: 151.05 s measured"),
        "reference": Arm("k6fast reference (eager, BF16, exact attention)", "gemm_bf16", "eager"),
        "final": Arm("k6fast final: fp16acc, k6 attention on blocks 6-53 from step 2, step 8 cached", "gemm_fp16acc",
                     "fused", quant_sites=("video_self",), exact_blocks=6, exact_calls=1, dit_calls=9),
        "fast": Arm("k6fast fast: mxfp8, sparse video (0.25) and k6 audio self-attention on blocks 2-57 from step 2, "
                    "steps 5 and 8 cached", "gemm_mxfp8", "fused_fp8", quant_sites=("audio_self",), exact_blocks=2,
                    exact_calls=1, dit_calls=8, gemm_quant=True, sparse_density=0.25),
    }  # fmt: skip


def variants(base: dict[str, Arm]) -> list[tuple[str, str, Arm]]:
    """(work item, base arm, the arm with it done): the GeForce work the model ranks."""
    final, fast = base["final"], base["fast"]
    r = dataclasses.replace
    return [
        ("final without FP16-accumulate P·V: k6 attention's P·V at FP32 accumulation, as before", "final",
         r(final, quant_rate="attn_quant_f32pv")),
        ("fast without FP16-accumulate P·V: k6 attention's P·V at FP32 accumulation, as before", "fast",
         r(fast, quant_rate="attn_quant_f32pv")),
        ("fp16acc GEMM at the full 2x FP16-accumulate rate (not the fork's 1.5x)", "final",
         r(final, gemm="gemm_fp16acc_2x")),
        ("final with MXFP8 GEMMs instead of fp16acc (lossy)", "final", r(final, gemm="gemm_mxfp8", profile="fused_fp8",
                                                                           gemm_quant=True)),
        ("exact attention on 0 instead of 6 outer blocks in final", "final", r(final, exact_blocks=0)),
        ("fast without this work: fp8 through torch._scaled_mm (FP32 accumulation)", "fast",
         r(fast, gemm="gemm_fp8")),
        ("fast on the FP16-chunk fp8 GEMM (fp8-fp16acc) instead of MXFP8", "fast", r(fast, gemm="gemm_fp8_fp16acc")),
        ("fast with NVFP4 GEMMs at 1,340 TFLOP/s (lossier)", "fast",
         r(fast, gemm="gemm_nvfp4_high")),
        ("fast on an mxfp8 checkpoint (0.52x the streamed bytes)", "fast", r(fast, block_bytes=0.899 * GiB * 0.52)),
        ("fast with sparse video self-attention at density 0.125 instead of 0.25 (lossier)", "fast",
         r(fast, sparse_density=0.125)),
        ("fast without sparse attention (k6 quantized on both self sites, as before)", "fast",
         r(fast, sparse_density=1.0, quant_sites=("video_self", "audio_self"), exact_blocks=0)),
        ("final with sparse video self-attention at 0.25 (lossy)", "final", r(final, sparse_density=0.25)),
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Calibration, report
# ---------------------------------------------------------------------------------------------------------------

ANCHORS = {"fork-reference": 234.6, "fork-final": 151.05}  # s per W1 request on an RTX 5090 (the fork's showcase)
FORK_BLOCK_S = 0.3409  # the fork's compiled BF16 Pro block at W1 on its RTX 5090 (its showcase's measurements)
GOALS = {"final": 120.0, "fast": 80.0}


def run(rates: dict[str, Rate] | None = None, h200: dict[str, H200Block] | None = None) -> dict:
    rates = derive_rates(rates or RATES)
    rates["gemm_nvfp4_high"] = Rate(1340e12, rates["gemm_nvfp4"].source.replace("(low end)", "(high end)"))
    h200 = h200 or load_h200_profiles()
    base = arms()
    dit = {key: predict(arm, rates, h200) for key, arm in base.items()}
    outside = ANCHORS["fork-reference"] - dit["fork-reference"].dit_s  # the one fitted figure
    request = {key: p.dit_s + outside for key, p in dit.items()}
    error = request["fork-final"] / ANCHORS["fork-final"] - 1.0
    ranking = []
    for item, on, arm in variants(base):
        saved = request[on] - (predict(arm, rates, h200).dit_s + outside)
        ranking.append({"work": item, "arm": on, "saved_s": saved})
    ranking.sort(key=lambda row: -row["saved_s"])
    r = dataclasses.replace
    together = {
        "final": r(base["final"], gemm="gemm_fp16acc_2x"),
        "fast": r(base["fast"], gemm="gemm_nvfp4_high"),
    }
    combined = {key: predict(arm, rates, h200).dit_s + outside for key, arm in together.items()}
    return {"rates": rates, "arms": base, "dit": dit, "outside_dit_s": outside, "request_s": request,
            "calibration_error": error, "ranking": ranking, "combined_s": combined}  # fmt: skip


def render(result: dict) -> str:
    r, req, dit = result["rates"], result["request_s"], result["dit"]
    lines = [
        "# RTX 5090 model: predicted seconds per W1 request (MODELLED, not measured)",
        "",
        "Generated by `python measurements/model_5090.py` from the H200 profiles in "
        "[2026-11-29_h200-kernels2](sessions/2026-11-29_h200-kernels2/README.md) and the published rates below. "
        "Only the two fork figures are measurements on a 5090 (fractalyze/vllm-omni Kandinsky 6 showcase); "
        "no k6fast arm has run on an RTX card.",
        "",
        "| arm | predicted s / request | DiT s | DiT calls | resident blocks | exposed copies s | measured on a 5090 |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, arm in result["arms"].items():
        p = dit[key]
        measured = f"{ANCHORS[key]:.2f} s" if key in ANCHORS else "not measured"
        lines.append(f"| {arm.name} | {req[key]:.1f} | {p.dit_s:.1f} | {arm.dit_calls} | {p.resident_blocks} "
                     f"| {p.exposed_copy_s:.2f} | {measured} |")  # fmt: skip
    lines += [
        "",
        f"**Calibration.** One figure is fitted: {result['outside_dit_s']:.1f} s outside the DiT (text encoding, "
        "VAE decode, audio, mux, load), so that the fork's BF16 reference is met exactly. With it the model predicts "
        f"the fork's tuned arm at {req['fork-final']:.1f} s against the measured {ANCHORS['fork-final']:.2f} s: "
        f"**error {result['calibration_error']:+.1%}**. The same outside-DiT seconds are assumed for k6fast's arms "
        "(its exact VAE decode is not measured on a 5090). A check not used in the fit: the fork's compiled BF16 "
        f"block at W1 took {FORK_BLOCK_S * 1e3:.1f} ms on its 5090; the model gives "
        f"{sum(dit['fork-reference'].parts_s.values()) * 1e3:.1f} ms.",
        "",
        "**Goals** (`final` <= 120 s, `fast` <= 80 s): "
        + "; ".join(
            f"`{k}` {req[k]:.1f} s, {'meets it' if req[k] <= g else f'misses by {req[k] - g:.1f} s'}"
            for k, g in GOALS.items()
        )
        + ".",  # fmt: skip
        "",
        "With the fp16acc GEMM at the full 2x FP16-accumulate rate (near-lossless) `final` would be "
        f"{result['combined_s']['final']:.1f} s; `fast` with NVFP4 GEMMs at 1,340 TFLOP/s (lossier) "
        f"{result['combined_s']['fast']:.1f} s. What is left has to come from outside the DiT "
        f"({result['outside_dit_s']:.1f} s here, the same for every arm: decode, text encoding, mux), from fewer "
        "exact blocks or DiT calls (quality), or from a faster exact attention on sm_120 (207 TFLOP/s assumed; it is "
        "the largest single term of the exact first call).",
        "",
        "## GeForce work ranked by modelled seconds saved per W1 request",
        "",
        "| work | on arm | s saved |",
        "|---|---|---|",
    ]
    lines += [f"| {row['work']} | `{row['arm']}` | {row['saved_s']:+.1f} |" for row in result["ranking"]]
    parts = dit["final"].parts_s
    lines += [
        "",
        "## One fused block of `final`'s exact first call on the 5090 (ms)",
        "",
        "| " + " | ".join(parts) + " |",
        "|" + "---|" * len(parts),
        "| " + " | ".join(f"{v * 1e3:.1f}" for v in parts.values()) + " |",
        "",
        "## Rates (sm_120) and their sources",
        "",
        "| rate | value | source |",
        "|---|---|---|",
    ]
    for key, rate in r.items():
        unit = "GB/s" if key in ("dram", "pcie") else "TFLOP/s"
        scale = 1e9 if unit == "GB/s" else 1e12
        lines.append(f"| {key} | {rate.value / scale:,.0f} {unit} | {rate.source} |")
    lines += [
        "",
        "How: per block, GEMM FLOPs / the arm's GEMM rate, attention FLOPs per site / the exact or quantized "
        "attention rate, plus the H200's elementwise and quantization kernel time x (4.8 / 1.792) (DRAM bandwidths) "
        "and its launch gaps as they are; blocks the 32 GB card cannot hold are streamed over PCIe and only the "
        "first copy of each call is exposed where a block computes longer than it copies.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(HERE / "model_5090.md"), help="Markdown table to write")
    parser.add_argument("--json", help="also write the numbers as JSON")
    args = parser.parse_args(argv)
    result = run()
    text = render(result)
    Path(args.out).write_text(text)
    if args.json:
        numbers = {"request_s": result["request_s"], "dit_s": {k: p.dit_s for k, p in result["dit"].items()},
                   "outside_dit_s": result["outside_dit_s"], "calibration_error": result["calibration_error"],
                   "ranking": result["ranking"]}  # fmt: skip
        Path(args.json).write_text(json.dumps(numbers, indent=2) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
