"""The DiT's configuration, read from the checkpoint's `transformer/config.json`, and the tensor names and shapes
that configuration implies (used to validate a checkpoint before any weight is read)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

# Attention call sites of the DiT. Text blocks attend over text only; fused blocks have the six below.
ATTENTION_SITES = (
    "text_self",
    "video_self",
    "video_text",
    "audio_self",
    "audio_text",
    "video_audio",  # video queries, audio keys
    "audio_video",  # audio queries, video keys
)
# The fused blocks' tensor names: BLOCK_PREFIX, the block's index, a dot, then the block's own names.
BLOCK_PREFIX = "visual_transformer_blocks."


def block_prefix(block: int) -> str:
    """The prefix of fused block `block`'s tensor names in the checkpoint."""
    return f"{BLOCK_PREFIX}{block}."


@dataclass(frozen=True)
class DiTConfig:
    in_visual_dim: int
    out_visual_dim: int
    in_text_dim: int
    in_text_dim2: int
    time_dim: int
    patch_size: tuple[int, int, int]
    model_dim: int
    ff_dim: int
    num_text_blocks: int
    num_visual_blocks: int
    axes_dims: tuple[int, int, int]
    visual_cond: bool
    in_audio_dim: int
    out_audio_dim: int
    model_dim_a: int
    time_dim_a: int
    ff_dim_a: int
    axes_dims_a: tuple[int, int, int]
    audio_freqs_scaling: float
    scale_factor: tuple[float, float, float]
    text_token_padding: bool
    ca_rope: bool
    cross_gates: bool
    fix_modulation: bool
    visual_token_type_num_embeddings: int

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DiTConfig:
        """Build from a diffusers `Kandinsky6Transformer3DModel` config dict, applying diffusers' defaults."""
        defaults: dict[str, Any] = {
            "in_visual_dim": 16,
            "out_visual_dim": 16,
            "in_text_dim": 3584,
            "in_text_dim2": 768,
            "time_dim": 1024,
            "patch_size": (1, 2, 2),
            "model_dim": 4096,
            "ff_dim": 16384,
            "num_text_blocks": 4,
            "num_visual_blocks": 60,
            "axes_dims": (32, 48, 48),
            "visual_cond": True,
            "in_audio_dim": 20,
            "out_audio_dim": 20,
            "model_dim_a": None,
            "time_dim_a": None,
            "ff_dim_a": None,
            "axes_dims_a": None,
            "audio_freqs_scaling": 1.0,
            "scale_factor": (1.0, 2.0, 2.0),
            "text_token_padding": False,
            "ca_rope": False,
            "cross_gates": False,
            "fix_modulation": False,
            "visual_token_type_num_embeddings": 0,
        }
        values = {**defaults, **{k: v for k, v in raw.items() if k in defaults and v is not None}}
        values["model_dim_a"] = values["model_dim_a"] or values["model_dim"]
        values["time_dim_a"] = values["time_dim_a"] or values["time_dim"]
        values["ff_dim_a"] = values["ff_dim_a"] or values["ff_dim"]
        values["axes_dims_a"] = values["axes_dims_a"] or values["axes_dims"]
        for key in ("patch_size", "axes_dims", "axes_dims_a"):
            values[key] = tuple(int(v) for v in values[key])
        values["scale_factor"] = tuple(float(v) for v in values["scale_factor"])
        values["audio_freqs_scaling"] = float(values["audio_freqs_scaling"])
        values["visual_token_type_num_embeddings"] = int(values["visual_token_type_num_embeddings"] or 0)
        cfg = cls(**{f.name: values[f.name] for f in fields(cls)})
        cfg._check()
        return cfg

    def _check(self) -> None:
        if self.model_dim % self.head_dim or self.model_dim_a % self.head_dim_a:
            raise ValueError(
                f"transformer config: model_dim {self.model_dim} / model_dim_a {self.model_dim_a} must be divisible "
                f"by the head dims {self.head_dim} / {self.head_dim_a} (sum of axes_dims)"
            )
        if self.ca_rope and self.head_dim != self.head_dim_a:
            raise ValueError(
                f"transformer config: ca_rope needs equal video and audio head dims, found {self.head_dim} and "
                f"{self.head_dim_a}"
            )

    @property
    def head_dim(self) -> int:
        return sum(self.axes_dims)

    @property
    def head_dim_a(self) -> int:
        return sum(self.axes_dims_a)

    @property
    def visual_in_channels(self) -> int:
        """Channels of the DiT's video input: noisy latent, conditioning latent and mask when visual_cond."""
        return 2 * self.in_visual_dim + 1 if self.visual_cond else self.in_visual_dim

    @property
    def n_grid(self) -> int:
        """PiFlow grid size: distilled heads predict n_grid values per latent channel; 1 for a velocity head."""
        return self.out_visual_dim // self.in_visual_dim

    @property
    def size_class(self) -> str:
        return {4096: "pro", 1792: "lite"}.get(self.model_dim, "custom")


def _linear(shapes: dict[str, tuple[int, ...]], name: str, n_in: int, n_out: int, bias: bool = True) -> None:
    shapes[f"{name}.weight"] = (n_out, n_in)
    if bias:
        shapes[f"{name}.bias"] = (n_out,)


def _attention(shapes: dict, name: str, dim: int, kv_dim: int, head_dim: int) -> None:
    _linear(shapes, f"{name}.to_query", dim, dim)
    _linear(shapes, f"{name}.to_key", kv_dim, dim)
    _linear(shapes, f"{name}.to_value", kv_dim, dim)
    shapes[f"{name}.query_norm.weight"] = (head_dim,)
    shapes[f"{name}.key_norm.weight"] = (head_dim,)
    _linear(shapes, f"{name}.out_layer", dim, dim)


def _feed_forward(shapes: dict, name: str, dim: int, ff_dim: int) -> None:
    _linear(shapes, f"{name}.net.0.proj", dim, ff_dim, bias=False)
    _linear(shapes, f"{name}.net.2", ff_dim, dim, bias=False)


def _text_embeddings(shapes: dict, name: str, n_in: int, dim: int) -> None:
    _linear(shapes, f"{name}.in_layer", n_in, dim)
    shapes[f"{name}.norm.weight"] = (dim,)
    shapes[f"{name}.norm.bias"] = (dim,)


def fused_block_shapes(cfg: DiTConfig) -> dict[str, tuple[int, ...]]:
    """Tensor names (relative to `block_prefix(i)`) and shapes of one fused video/audio block."""
    shapes: dict[str, tuple[int, ...]] = {}
    for prefix, dim, time_dim, ff_dim, head_dim in (
        ("video_dec_block", cfg.model_dim, cfg.time_dim, cfg.ff_dim, cfg.head_dim),
        ("audio_dec_block", cfg.model_dim_a, cfg.time_dim_a, cfg.ff_dim_a, cfg.head_dim_a),
    ):
        _linear(shapes, f"{prefix}.visual_modulation.out_layer", time_dim, 9 * dim)
        _attention(shapes, f"{prefix}.self_attention", dim, dim, head_dim)
        _attention(shapes, f"{prefix}.cross_attention", dim, dim, head_dim)
        _feed_forward(shapes, f"{prefix}.feed_forward", dim, ff_dim)
    _attention(shapes, "va_cross_attention", cfg.model_dim, cfg.model_dim_a, cfg.head_dim)
    _attention(shapes, "av_cross_attention", cfg.model_dim_a, cfg.model_dim, cfg.head_dim_a)
    if cfg.cross_gates:
        va_out, av_out = 2 * cfg.model_dim + cfg.model_dim_a, 2 * cfg.model_dim_a + cfg.model_dim
    else:
        va_out, av_out = 3 * cfg.model_dim, 3 * cfg.model_dim_a
    _linear(shapes, "va_modulation.out_layer", cfg.time_dim, va_out)
    _linear(shapes, "av_modulation.out_layer", cfg.time_dim_a, av_out)
    return shapes


# The fused block's linears whose rows are the video tokens: the video self-attention's four, the text cross-attention's
# query and output (its keys and values are the prompt's), the video-to-audio attention's query and output, the audio
# stream's keys and values of the video tokens, the feed-forward's two.
VIDEO_TOKEN_LINEARS = (
    *(f"video_dec_block.self_attention.{p}" for p in ("to_query", "to_key", "to_value", "out_layer")),
    "video_dec_block.cross_attention.to_query",
    "video_dec_block.cross_attention.out_layer",
    "va_cross_attention.to_query",
    "va_cross_attention.out_layer",
    "av_cross_attention.to_key",
    "av_cross_attention.to_value",
    "video_dec_block.feed_forward.net.0.proj",
    "video_dec_block.feed_forward.net.2",
)


def video_gemm_shapes(cfg: DiTConfig) -> dict[tuple[int, int], int]:
    """(K, N) → how many of a fused block's GEMMs on the video tokens have that shape (`VIDEO_TOKEN_LINEARS`)."""
    shapes = fused_block_shapes(cfg)
    out: dict[tuple[int, int], int] = {}
    for name in VIDEO_TOKEN_LINEARS:
        n, k = shapes[f"{name}.weight"]
        out[(k, n)] = out.get((k, n), 0) + 1
    return out


def text_block_shapes(dim: int, time_dim: int, ff_dim: int, head_dim: int) -> dict[str, tuple[int, ...]]:
    """Tensor names (relative to `<video|audio>_text_transformer_blocks.<i>.`) and shapes of one text block."""
    shapes: dict[str, tuple[int, ...]] = {}
    _linear(shapes, "text_modulation.out_layer", time_dim, 6 * dim)
    _attention(shapes, "attn", dim, dim, head_dim)
    _feed_forward(shapes, "feed_forward", dim, ff_dim)
    return shapes


def expected_shapes(cfg: DiTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint with this config must hold, by full name."""
    shapes: dict[str, tuple[int, ...]] = {}
    _linear(shapes, "visual_embeddings.in_layer", math.prod(cfg.patch_size) * cfg.visual_in_channels, cfg.model_dim)
    if cfg.visual_token_type_num_embeddings > 0:
        shapes["visual_token_type_embeddings.weight"] = (cfg.visual_token_type_num_embeddings, cfg.model_dim)
    _linear(shapes, "out_layer.modulation.out_layer", cfg.time_dim, 2 * cfg.model_dim)
    _linear(shapes, "out_layer.out_layer", cfg.model_dim, math.prod(cfg.patch_size) * cfg.out_visual_dim)
    _text_embeddings(shapes, "audio_embeddings", cfg.in_audio_dim, cfg.model_dim_a)
    _linear(shapes, "audio_out_layer.modulation.out_layer", cfg.time_dim_a, 2 * cfg.model_dim_a)
    _linear(shapes, "audio_out_layer.out_layer", cfg.model_dim_a, cfg.out_audio_dim)
    for prefix, dim, time_dim, ff_dim, head_dim in (
        ("video", cfg.model_dim, cfg.time_dim, cfg.ff_dim, cfg.head_dim),
        ("audio", cfg.model_dim_a, cfg.time_dim_a, cfg.ff_dim_a, cfg.head_dim_a),
    ):
        _linear(shapes, f"{prefix}_time_embeddings.timestep_embedder.linear_1", dim, time_dim)
        _linear(shapes, f"{prefix}_time_embeddings.timestep_embedder.linear_2", time_dim, time_dim)
        _text_embeddings(shapes, f"{prefix}_text_embeddings", cfg.in_text_dim, dim)
        _text_embeddings(shapes, f"{prefix}_pooled_text_embeddings", cfg.in_text_dim2, time_dim)
        block = text_block_shapes(dim, time_dim, ff_dim, head_dim)
        for i in range(cfg.num_text_blocks):
            shapes.update({f"{prefix}_text_transformer_blocks.{i}.{k}": v for k, v in block.items()})
    block = fused_block_shapes(cfg)
    for i in range(cfg.num_visual_blocks):
        shapes.update({f"{block_prefix(i)}{k}": v for k, v in block.items()})
    return shapes


# Layers every GEMM switch leaves exact (fp32): one row of activations each, and their outputs scale every residual
# update. `LinearDispatch` and `k6fast quantize` share this list.
EXACT_LAYERS = ("modulation", "time_embeddings", "pooled_text_embeddings")

# Quantized checkpoints written by `k6fast quantize` (see k6fast/quantize.py for the format). Per quantized layer the
# checkpoint stores, instead of a bf16 `<layer>.weight` [N, K]:
#   fp8:   <layer>.weight F8_E4M3 [N, K], <layer>.weight_scale F32 [N]            w = weight · weight_scale[:, None]
#   mxfp8: <layer>.weight F8_E4M3 [N, K], <layer>.weight_scale U8 [N, K/32] (e8m0 biased exponents, MX block 32)
#                                                               w = weight · 2^(weight_scale[:, k // 32] - 127)
#   nvfp4: <layer>.weight U8 [N, K/2] (two E2M1 codes a byte, element 2i low), <layer>.weight_scale F8_E4M3 [N, K/16],
#          <layer>.weight_scale_2 F32 []                        w = e2m1(weight) · weight_scale[:, k // 16] · scale_2
# Scales are stored row-major (one row per output channel), not in cuBLAS's swizzled layout: the block-scaled GEMM
# (k6fast/kernels/blockscaled.py) swizzles them per call (1/32 or 1/16 of the weight's bytes), and every other device
# dequantizes from the plain layout. The nvfp4 format is the one k6fast wrote before the block-scaled GEMM existed.
# in transformer/config.json: {"format": one of QUANT_FORMATS, "version": 1}
QUANT_CONFIG_KEY = "k6fast_quantization"
QUANT_FORMATS = ("fp8", "mxfp8", "nvfp4")
QUANT_VERSION = 1
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_2")


def fast_gemm_layer(name: str, weight_shape: tuple[int, ...]) -> bool:
    """The layers a fast GEMM (fp16acc, fp8, mxfp8, nvfp4) or a quantized checkpoint (QUANT_FORMATS) may take, whatever
    the row count: not an exact layer, and N and K multiples of 16 (FP8 tensor cores need both)."""
    if any(part in name for part in EXACT_LAYERS) or len(weight_shape) != 2:
        return False
    return weight_shape[0] % 16 == 0 and weight_shape[1] % 16 == 0


def quantized_layer(name: str, weight_shape: tuple[int, ...], fmt: str) -> bool:
    """Whether `k6fast quantize --format fmt` stores this tensor quantized: a fused-block linear weight that the fast
    GEMM takes (MXFP8 and NVFP4 also need K a multiple of 32). `name` is the full checkpoint name."""
    if fmt not in QUANT_FORMATS:
        raise ValueError(f"quantization format: expected one of {QUANT_FORMATS}, found {fmt!r}")
    if not (name.startswith(BLOCK_PREFIX) and name.endswith(".weight")):
        return False
    if not fast_gemm_layer(name, weight_shape):
        return False
    return fmt == "fp8" or weight_shape[1] % 32 == 0


def quantized_tensors(name: str, weight_shape: tuple[int, ...], fmt: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """The tensors (name → (shape, safetensors dtype)) a quantized checkpoint stores for the weight `name` [N, K]."""
    n, k = weight_shape
    if fmt == "fp8":
        return {name: ((n, k), "F8_E4M3"), f"{name}_scale": ((n,), "F32")}
    if fmt == "mxfp8":
        return {name: ((n, k), "F8_E4M3"), f"{name}_scale": ((n, k // 32), "U8")}
    return {name: ((n, k // 2), "U8"), f"{name}_scale": ((n, k // 16), "F8_E4M3"), f"{name}_scale_2": ((), "F32")}


def quantized_layout(shapes: dict[str, tuple[int, ...]], fmt: str) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """`expected_shapes` of a checkpoint quantized with `fmt` → (every tensor's shape, the safetensors dtype of each
    quantized tensor and scale; tensors kept as stored are not listed)."""
    out: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    for name, shape in shapes.items():
        if quantized_layer(name, shape, fmt):
            for stored, (stored_shape, dtype) in quantized_tensors(name, shape, fmt).items():
                out[stored], dtypes[stored] = stored_shape, dtype
        else:
            out[name] = shape
    return out, dtypes


def stays_as_stored(name: str, stored_itemsize: int, floating: bool) -> bool:
    """Tensors the device holds in their stored dtype: integers, quantized weights (one byte an element: e4m3,
    packed nvfp4) and their scales. The stored form is what their GEMM reads."""
    return not floating or stored_itemsize == 1 or name.endswith(SCALE_SUFFIXES)


def held_itemsize(name: str, stored_itemsize: int, floating: bool, compute_itemsize: int) -> int:
    """Bytes an element of this tensor takes on the device (the rule `k6fast.stream.reader.target_dtype` applies)."""
    if stays_as_stored(name, stored_itemsize, floating):
        return stored_itemsize
    return 4 if is_fp32_tensor(name) else compute_itemsize


def is_fp32_tensor(name: str) -> bool:
    """Layers k6fast keeps in float32 whatever the compute dtype: every AdaLN modulation projection, both time
    embeddings and the pooled-text projections added to them. They see one row of activations per sample and their
    outputs scale every residual update, so bf16 rounding there would be paid in every block. (diffusers'
    `_keep_in_fp32_modules` name match misses `*_time_embeddings` and `visual_modulation`/`text_modulation`;
    k6fast keeps them all.)"""
    return "modulation." in name or "_time_embeddings." in name or "_pooled_text_embeddings." in name
