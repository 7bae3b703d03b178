"""Every k6fast switch, declared once.

Rules for adding one: a switch lands together with the code it controls; its default is the BF16 reference
(off, empty, or the reference choice), so an empty environment runs the reference path; `lossy=True` when it
trades accuracy for speed; `affects_output=False` only when it cannot change a single output sample.
"""

from __future__ import annotations

from .registry import Switch, SwitchError, index_switches

PIFLOW_CACHE_STEPS = Switch(
    name="K6_PIFLOW_CACHE_STEPS",
    kind="int_list",
    default=(),
    doc="denoising steps whose DiT call is skipped, reusing the previous step's prediction; distilled (PiFlow) "
    "checkpoints only: a base checkpoint runs every step (its step cache is K6_STEP_CACHE)",
    lossy=True,
    min=0,
)
STEP_CACHE = Switch(
    name="K6_STEP_CACHE",
    kind="enum",
    default="off",
    choices=("off", "magcache", "calibrate"),
    doc="step cache for base (flow-matching Euler + CFG) checkpoints: magcache = skip the DiT call (both CFG passes, "
    "video and audio) on steps where this checkpoint's calibrated magnitude ratios of successive predictions keep the "
    "estimated error under K6_STEP_CACHE_THRESHOLD (k6fast/step_cache.py); calibrate = run every step and record "
    "those ratios for this checkpoint and step count; off = every step runs",
    lossy=True,
)
STEP_CACHE_THRESHOLD = Switch(
    name="K6_STEP_CACHE_THRESHOLD",
    kind="float",
    default=0.12,
    doc="with K6_STEP_CACHE=magcache: the accumulated error (sum of |1 - product of magnitude ratios| over the "
    "skipped run) a skip must stay under; 0 = nothing is skipped (0.12 is MagCache's and Kandinsky 5's setting)",
    min=0.0,
    max=1.0,
)
STEP_CACHE_MAX_SKIP = Switch(
    name="K6_STEP_CACHE_MAX_SKIP",
    kind="int",
    default=2,
    doc="with K6_STEP_CACHE=magcache: the most consecutive steps skipped before the DiT runs again",
    min=1,
    max=10,
)
STEP_CACHE_RETENTION = Switch(
    name="K6_STEP_CACHE_RETENTION",
    kind="float",
    default=0.2,
    doc="with K6_STEP_CACHE=magcache: the share of first steps that always run (the last step always runs too)",
    min=0.0,
    max=1.0,
)
STEP_CACHE_DIR = Switch(
    name="K6_STEP_CACHE_DIR",
    kind="path",
    default="",
    doc="where K6_STEP_CACHE=calibrate writes and magcache reads the calibrations, one file per checkpoint and step "
    "count (empty = k6fast-step-cache/ inside the checkpoint's folder)",
    affects_output=False,
)
AUDIO_NORM = Switch(
    name="K6_AUDIO_NORM",
    kind="enum",
    default="peak",
    choices=("peak", "clip"),
    doc="how the decoded waveform is brought into [-1, 1]: peak-normalise or clip",
)
VIDEO_DECODE = Switch(
    name="K6_VIDEO_DECODE",
    kind="enum",
    default="exact",
    choices=("exact", "streamed", "tiled"),
    doc="video VAE decode: exact = k6fast's whole-clip decode, equal to diffusers' untiled one (the DiT's weights "
    "leave the device for it when the budget needs them to; a request it cannot fit fails); streamed = k6fast's "
    "decode inside what the budget leaves beside the DiT (whole-clip where that fits, else slabs with running "
    "GroupNorm statistics); tiled = diffusers' tiled decode",
    lossy=True,
)
API_KEY = Switch(
    name="K6_API_KEY",
    kind="str",
    default="",
    doc="bearer token the server requires; empty = no authentication",
    secret=True,
    affects_output=False,
)
DATA_DIR = Switch(
    name="K6_DATA_DIR",
    kind="path",
    default="",
    doc="where `k6fast serve` keeps jobs and videos (empty = ./k6fast-data)",
    affects_output=False,
)

VRAM_BUDGET_GB = Switch(
    name="K6_VRAM_BUDGET_GB",
    kind="float",
    default=0.0,
    doc="GPU memory k6fast may use, in GiB (enforced on bigger cards); 0 = what the card has free at start, less "
    "0.5 GiB for what CUDA adds outside PyTorch's allocator (a larger value is lowered to that, with a warning)",
    min=0.0,
    affects_output=False,
)
PREFETCH_BLOCKS = Switch(
    name="K6_PREFETCH_BLOCKS",
    kind="int",
    default=1,
    doc="how many streamed DiT blocks are copied ahead of the one computing",
    min=1,
    max=8,
    affects_output=False,
)
MAX_RESIDENT_BLOCKS = Switch(
    name="K6_MAX_RESIDENT_BLOCKS",
    kind="int",
    default=-1,
    doc="cap on fused blocks kept resident (-1 = as many as the budget holds); lets a shallow model stream",
    min=-1,
    affects_output=False,
)
HOST_CACHE_GB = Switch(
    name="K6_HOST_CACHE_GB",
    kind="auto_float",
    default="auto",
    doc="host memory in GiB pinned for the streamed DiT blocks at the end of the cycle, each read from disk once and "
    "copied to the GPU from there every step; auto = only when the streamed blocks do not fit the page cache, as much "
    "as MemAvailable at load (and the process's cgroup memory limit, where one is tighter) leaves beyond a reserve "
    "for the OS and the process (k6fast/memory.py); 0 = off",
    min=0.0,
    affects_output=False,
)
DIT_AHEAD = Switch(
    name="K6_DIT_AHEAD",
    kind="enum",
    default="on",
    choices=("on", "off"),
    doc="on = `k6fast generate` builds the DiT on a thread beside the libraries' imports (k6fast/dit_load.py); off = "
    "after them, in the pipeline's load, as before: an A/B of that overlap",
    affects_output=False,
)
ATTN = Switch(
    name="K6_ATTN",
    kind="enum",
    default="exact",
    choices=("exact", "k6", "sage", "auto"),
    doc="attention backend for the quantized call sites: exact SDPA, k6fast's INT8/FP8 kernel, sageattention, or "
    "auto (k6 on GeForce sm_89/sm_120, exact elsewhere)",
    lossy=True,
)
EXACT_ATTN_BLOCKS = Switch(
    name="K6_EXACT_ATTN_BLOCKS",
    kind="int",
    default=0,
    doc="with a quantized K6_ATTN or K6_SPARSE_ATTN: the first and last N fused blocks keep exact attention",
    min=0,
)
EXACT_ATTN_STEPS = Switch(
    name="K6_EXACT_ATTN_STEPS",
    kind="int",
    default=0,
    doc="with a quantized K6_ATTN or K6_SPARSE_ATTN: the first N denoising steps keep exact attention",
    min=0,
)
EXACT_ATTN_LAST_STEPS = Switch(
    name="K6_EXACT_ATTN_LAST_STEPS",
    kind="int",
    default=0,
    doc="with a quantized K6_ATTN or K6_SPARSE_ATTN: the last N denoising steps keep exact attention (the step that "
    "sets the final detail; radial-attention #51 found few-step sparse runs need it dense)",
    min=0,
)
QUANT_ATTN_SITES = Switch(
    name="K6_QUANT_ATTN_SITES",
    kind="enum",
    default="video_self",
    choices=("video_self", "self", "all"),
    doc="which call sites a quantized K6_ATTN covers: video self-attention, both self-attentions, or all six",
)
EXACT_ATTN_KERNEL = Switch(
    name="K6_EXACT_ATTN_KERNEL",
    kind="enum",
    default="sdpa",
    choices=("sdpa", "fa4"),
    doc="the exact attention calls (unmasked): PyTorch SDPA, or flash-attn-4 on sm_90/sm_100/sm_120 where installed "
    "(k6fast[fa4]; SDPA where it cannot run, logged once); both within the flash-attention rule of fp32",
)
SPARSE_ATTN = Switch(
    name="K6_SPARSE_ATTN",
    kind="float",
    default=0.0,
    doc="training-free block-sparse video self-attention in the blocks and steps the K6_EXACT_ATTN_* policy leaves: "
    "the share of 128-token key blocks each query block keeps (a 3-D window of tiles first, then the highest "
    "mean-pooled scores, per head), tokens in 3-D tiles; 0 = off (dense)",
    lossy=True,
    min=0.0,
    max=1.0,
)
SPARSE_ATTN_WINDOW = Switch(
    name="K6_SPARSE_ATTN_WINDOW",
    kind="int",
    default=1,
    doc="with K6_SPARSE_ATTN: the always-kept neighbourhood, in 2x8x8-token tiles around a query block along each "
    "axis (1 = the 3x3x3 tiles of Sliding Tile Attention and NABLA)",
    min=0,
    max=8,
)
GEMM = Switch(
    name="K6_GEMM",
    kind="enum",
    default="bf16",
    choices=("bf16", "fp16acc", "fp8", "fp8-fp16acc", "mxfp8", "nvfp4", "auto", "auto-lossy"),
    doc="linear layers: cuBLAS bf16; Triton fp16-accumulate (GeForce gain only); fp8 e4m3 row-wise (fp8-fp16acc on "
    "GeForce sm_89/sm_120: FP16-chunk accumulation); block-scaled mxfp8 / nvfp4 on sm_100/sm_120 (needs torchao; "
    "bf16 elsewhere; not run on such a GPU here); auto = fp16acc on GeForce, bf16 elsewhere; auto-lossy = mxfp8 on "
    "Blackwell, fp8 elsewhere from sm_89",
    lossy=True,
)
GEMM_MIN_ROWS = Switch(
    name="K6_GEMM_MIN_ROWS",
    kind="int",
    default=2048,
    doc="with K6_GEMM other than bf16: layers with fewer rows than this stay bf16",
    min=1,
)
FP8_OUTLIER_CHANNELS = Switch(
    name="K6_FP8_OUTLIER_CHANNELS",
    kind="enum",
    default="32",
    choices=("0", "16", "32", "64"),
    doc="with K6_GEMM=fp8 (or mxfp8, nvfp4) on bf16 weights: the input channels (largest activations, chosen per "
    "call) whose weight rounding extra GEMM columns correct, lowering the layer's error for little speed "
    "(measurements/sessions/2026-11-29_fp8-outliers); mxfp8/nvfp4: 2x this many columns correct both operands' "
    "rounding (bounds in tests/test_blockscaled.py); 0 = off",
    lossy=True,
)
FUSED_ELEMENTWISE = Switch(
    name="K6_FUSED_ELEMENTWISE",
    kind="bool",
    default=False,
    doc="one-pass Triton kernels (fp32 math): LayerNorm+AdaLN, gated residual (also fused with the next modulation), "
    "q/k RMSNorm+RoPE; ATen's GELU kept under compile",
)
COMPILE = Switch(
    name="K6_COMPILE",
    kind="bool",
    default=False,
    doc="torch.compile each fused block (the first request compiles; later ones reuse the Inductor cache)",
)
INDUCTOR_CACHE_DIR = Switch(
    name="K6_INDUCTOR_CACHE_DIR",
    kind="path",
    default="",
    doc=(
        "where the kernel compilers keep their caches (Inductor's here, Triton's in triton/, flash-attn-4's in fa4/), "
        "so a second start compiles nothing (empty = each one's default place)"
    ),
    affects_output=False,
)
LPIPS_BACKBONE = Switch(
    name="K6_LPIPS_BACKBONE",
    kind="path",
    default="",
    doc="AlexNet weights for the quality gate's LPIPS (empty = the torch hub cache)",
    affects_output=False,
)

SWITCHES: tuple[Switch, ...] = (
    PIFLOW_CACHE_STEPS,
    STEP_CACHE,
    STEP_CACHE_THRESHOLD,
    STEP_CACHE_MAX_SKIP,
    STEP_CACHE_RETENTION,
    STEP_CACHE_DIR,
    ATTN,
    EXACT_ATTN_BLOCKS,
    EXACT_ATTN_STEPS,
    EXACT_ATTN_LAST_STEPS,
    QUANT_ATTN_SITES,
    EXACT_ATTN_KERNEL,
    SPARSE_ATTN,
    SPARSE_ATTN_WINDOW,
    GEMM,
    GEMM_MIN_ROWS,
    FP8_OUTLIER_CHANNELS,
    FUSED_ELEMENTWISE,
    COMPILE,
    AUDIO_NORM,
    VIDEO_DECODE,
    VRAM_BUDGET_GB,
    PREFETCH_BLOCKS,
    MAX_RESIDENT_BLOCKS,
    HOST_CACHE_GB,
    DIT_AHEAD,
    API_KEY,
    DATA_DIR,
    INDUCTOR_CACHE_DIR,
    LPIPS_BACKBONE,
)
SWITCHES_BY_NAME: dict[str, Switch] = index_switches(SWITCHES)


def validate_cache_steps(steps: tuple[int, ...], num_steps: int) -> None:
    """Check K6_PIFLOW_CACHE_STEPS against a `num_steps`-step schedule; raises SwitchError when it does not fit.

    Step 0 has no previous prediction to reuse, so the cacheable steps are 1..num_steps-1.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, found {num_steps}")
    problems: list[str] = []
    if 0 in steps:
        problems.append("step 0 cannot be cached (it has no previous prediction)")
    outside = sorted({s for s in steps if s < 0 or s >= num_steps})
    if outside:
        noun = "step" if len(outside) == 1 else "steps"
        problems.append(f"{noun} {', '.join(map(str, outside))} outside the schedule")
    repeated = sorted({s for s in steps if steps.count(s) > 1})
    if repeated:
        problems.append(f"repeated: {', '.join(map(str, repeated))}")
    if not problems:
        return
    if num_steps == 1:
        valid = "no step can be cached in a 1-step schedule"
    elif num_steps == 2:
        valid = "the only valid step is 1 for a 2-step schedule"
    else:
        valid = f"valid steps are 1..{num_steps - 1} for a {num_steps}-step schedule"
    shown = ",".join(map(str, steps))
    raise SwitchError(f"{PIFLOW_CACHE_STEPS.name}={shown}: {'; '.join(problems)}; {valid}")
