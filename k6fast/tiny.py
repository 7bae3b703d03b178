"""Tiny random-weight Kandinsky 6 checkpoints in the exact Diffusers layout.

`make_tiny(dir)` writes `model_index.json` and all nine components (`transformer/ vae/ text_encoder/ tokenizer/
text_encoder_2/ tokenizer_2/ scheduler/ audio_vae/ vocoder/`) with the classes and `save_pretrained` of diffusers
and transformers, so that `Kandinsky6TI2VAPipeline.from_pretrained(dir)` loads it offline and generates 64x64x17 in
about a second on a CPU. The transformer and the Qwen text encoder are sharded like the real checkpoints. The whole
checkpoint is about 4 MB; building it takes well under a second once diffusers and transformers are imported
(the imports take about 5 s). Weights are stored in float32 (the real ones are bf16) so CPU tests run at full
precision.

What is kept from the real checkpoints (so the code paths that real users hit run here too): every Pro transformer
flag (`ca_rope`, `cross_gates`, `fix_modulation`, `text_token_padding`, `visual_cond`, two visual token types,
`audio_freqs_scaling` 0.144), patch (1, 2, 2), the video VAE's 16 latent channels and its 4x temporal / 8x spatial
compression, 44.1 kHz audio at 1024 samples per latent step, the widened PiFlow heads (10 x the latent channels),
the audio VAE scaling factors, Qwen's special tokens and right padding, and a Qwen chat-template prefix of exactly
the 129 tokens the reference pipeline crops. Widths are tiny and deliberately unequal (video 64, audio 32, Qwen 48,
CLIP 24) so that a mixed-up dimension fails loudly instead of passing by coincidence.
"""

from __future__ import annotations

import re
import shutil
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from .atomic import build_dir_atomically

if TYPE_CHECKING:
    from diffusers import Kandinsky6TI2VAPipeline
    from transformers import CLIPTokenizer, Qwen2_5_VLProcessor

Variant = Literal["distill", "base"]
VARIANTS: tuple[str, ...] = ("distill", "base")

# The reference pipeline crops this many Qwen tokens (the chat-template prefix) off the encoder output
# (`_QWEN_CROP_START` in pipeline_kandinsky6_ti2va.py); the tiny tokenizer is trained so that the prefix is exactly
# this long, so the cropped embeddings start at the user prompt as they do with the real tokenizer.
QWEN_CROP_START = 129

# Widths of the tiny components. The transformer's `in_*` dims follow from these.
QWEN_HIDDEN = 48
CLIP_HIDDEN = 24
VIDEO_LATENT_CHANNELS = 16
AUDIO_LATENT_CHANNELS = 8
AUDIO_MEL_BINS = 32
N_GRID = 10
CLIP_NUM_MERGES = 160

# Real checkpoints store the DiT as several `diffusion_pytorch_model-0000N-of-0000M.safetensors` and Qwen2.5-VL as
# `model-0000N-of-0000M.safetensors`; these sizes split the tiny ones into a handful of shards.
TRANSFORMER_SHARD_BYTES = 400_000
TEXT_ENCODER_SHARD_BYTES = 150_000

AUDIO_VAE_SCALING = {"distill": 0.417, "base": 0.5302}

# Qwen2.5-VL's added tokens, in the order of the real vocabulary (151643 onward).
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Qwen2.5-VL-Instruct's chat template; the pipeline's `expand_prompts` goes through it.
QWEN_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# A few prompts in the style of the K6 showcase; with the chat-template prefix they are the tokenizers' corpus.
_CORPUS_SENTENCES = (
    "A cat and a dog baking a cake together in a kitchen.",
    "A red ball bouncing on a wooden floor, the camera slowly zooms in.",
    "An old man plays the violin on a rainy street at night, people walk past with umbrellas.",
    "Waves crash against the rocks while seagulls cry above the sea.",
    "A woman says <S>Hello, how are you today?<E> and smiles. <AUDCAP>Soft piano music.<ENDAUDCAP>",
    "Static, 2D cartoon, cartoon, 2d animation, paintings, images, worst quality, low quality, ugly, deformed, "
    "walking backwards",
    "The quick brown fox jumps over the lazy dog 0123456789 times!",
)


def make_tiny(out_dir: str | Path, variant: Variant = "distill", seed: int = 0) -> Path:
    """Write a tiny random-weight Kandinsky 6 checkpoint (Diffusers layout) to `out_dir` and return its path.

    `variant` "distill" mirrors Pro-distill (PiFlow scheduler, heads of `n_grid` x the latent channels, run with
    guidance 1.0); "base" mirrors Pro (flow-matching Euler, plain heads, CFG). The same `seed` gives the same weight
    bytes. The checkpoint is built in a temporary folder beside `out_dir` and renamed into place, so an interrupted
    build never leaves a half-written checkpoint; an existing non-empty `out_dir` is refused.
    """
    _check_args(variant, seed)
    return build_dir_atomically(out_dir, lambda tmp: _write_checkpoint(tmp, variant, seed), "tiny checkpoint")


def build_tiny_pipeline(variant: Variant = "distill", seed: int = 0) -> Kandinsky6TI2VAPipeline:
    """The in-memory pipeline that `make_tiny` saves: float32 weights on the CPU, default initialisers."""
    from diffusers import Kandinsky6TI2VAPipeline

    _check_args(variant, seed)
    processor = build_qwen_processor()
    tokenizer_2 = build_clip_tokenizer()
    # Each component draws from its own seed so that changing one leaves the others' bytes alone.
    with _seeded(seed, 1):
        text_encoder = _build_qwen(processor.tokenizer)
    with _seeded(seed, 2):
        text_encoder_2 = _build_clip(tokenizer_2)
    with _seeded(seed, 3):
        transformer = _build_transformer(variant)
    with _seeded(seed, 4):
        vae = _build_video_vae()
    with _seeded(seed, 5):
        audio_vae = _build_audio_vae(variant)
    with _seeded(seed, 6):
        vocoder = _build_vocoder()
    return Kandinsky6TI2VAPipeline(
        transformer=transformer,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=processor,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        scheduler=_build_scheduler(variant),
        audio_vae=audio_vae,
        vocoder=vocoder,
    )


def transformer_config(variant: Variant) -> dict:
    """`Kandinsky6Transformer3DModel` config of the tiny checkpoint: the Pro flags at tiny widths."""
    _check_args(variant, 0)
    widen = N_GRID if variant == "distill" else 1
    return {
        "in_visual_dim": VIDEO_LATENT_CHANNELS,
        "out_visual_dim": widen * VIDEO_LATENT_CHANNELS,
        "in_text_dim": QWEN_HIDDEN,
        "in_text_dim2": CLIP_HIDDEN,
        "time_dim": 16,
        "patch_size": (1, 2, 2),
        "model_dim": 64,
        "ff_dim": 128,
        "num_text_blocks": 1,
        "num_visual_blocks": 2,
        # head_dim 16 for both modalities: `ca_rope` rotates audio keys with video positions and needs equal heads.
        "axes_dims": (4, 6, 6),
        "visual_cond": True,
        "in_audio_dim": AUDIO_LATENT_CHANNELS,
        "out_audio_dim": widen * AUDIO_LATENT_CHANNELS,
        "model_dim_a": 32,
        "time_dim_a": 16,
        "ff_dim_a": 64,
        "axes_dims_a": (4, 6, 6),
        "audio_freqs_scaling": 0.144,
        "scale_factor": (1.0, 2.0, 2.0),
        "text_token_padding": True,
        "ca_rope": True,
        "cross_gates": True,
        "fix_modulation": True,
        "visual_token_type_num_embeddings": 2,
    }


def qwen_prompt_prefix() -> str:
    """The reference pipeline's Qwen chat-template text that precedes the user prompt."""
    from diffusers.pipelines.kandinsky6.pipeline_kandinsky6_ti2va import _PROMPT_TEMPLATE

    prefix, _, _ = _PROMPT_TEMPLATE.partition("{}")
    return prefix


def build_qwen_processor() -> Qwen2_5_VLProcessor:
    """A `Qwen2_5_VLProcessor` around a byte-level BPE tokenizer trained here on a built-in corpus (no download)."""
    from transformers import Qwen2_5_VLProcessor, Qwen2Tokenizer, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    byte_vocab = {symbol: i for i, symbol in enumerate(_byte_symbols())}
    # A merge-less tokenizer only to borrow Qwen's normalizer and pre-tokenizer for training.
    backend = Qwen2Tokenizer(vocab=byte_vocab, merges=[]).backend_tokenizer
    prefix = qwen_prompt_prefix()
    prefix_words = Counter(_pretokenize(backend, prefix))
    corpus = prefix_words + Counter(word for text in _CORPUS_SENTENCES for word in _pretokenize(backend, text))
    # Special tokens are single tokens outside BPE, so the BPE part of the prefix gets the rest of the 129.
    merges = _learn_merges_to_length(corpus, prefix_words, QWEN_CROP_START - len(_SPECIAL_RE.findall(prefix)))
    vocab = dict(byte_vocab)
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    for token in QWEN_SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=[t for t in QWEN_SPECIAL_TOKENS if t not in ("<|endoftext|>", "<|im_end|>")],
        # The pipeline reads the prompt from position 129 on and masks the padding after it.
        padding_side="right",
        model_max_length=131072,
    )
    prefix_len = len(tokenizer(prefix)["input_ids"])
    if prefix_len != QWEN_CROP_START:
        raise RuntimeError(
            f"tiny Qwen tokenizer: expected the chat-template prefix to be {QWEN_CROP_START} tokens, got {prefix_len}"
        )
    # A 56x56 to 224x224 pixel budget keeps an image to a few dozen tokens in `expand_prompts`.
    pixel_bounds = {"min_pixels": 56 * 56, "max_pixels": 224 * 224}
    return Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(**pixel_bounds),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(**pixel_bounds),
        chat_template=QWEN_CHAT_TEMPLATE,
    )


def build_clip_tokenizer() -> CLIPTokenizer:
    """A `CLIPTokenizer` in CLIP's layout (byte symbols, `</w>` word ends, start/end tokens last) trained here."""
    from transformers import CLIPTokenizer

    symbols = _byte_symbols()
    byte_vocab = {symbol: i for i, symbol in enumerate(symbols + [symbol + "</w>" for symbol in symbols])}
    specials = {"<|startoftext|>": len(byte_vocab), "<|endoftext|>": len(byte_vocab) + 1}
    backend = CLIPTokenizer(vocab={**byte_vocab, **specials}, merges=[]).backend_tokenizer
    corpus: Counter = Counter()
    for text in (qwen_prompt_prefix(), *_CORPUS_SENTENCES):
        for word in _pretokenize(backend, text):
            corpus[(*word[:-1], word[-1] + "</w>")] += 1
    merges = _learn_merges(corpus, CLIP_NUM_MERGES)
    vocab = dict(byte_vocab)
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)


def _check_args(variant: str, seed: int) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")


def _write_checkpoint(path: Path, variant: Variant, seed: int) -> None:
    pipe = build_tiny_pipeline(variant, seed)
    pipe.save_pretrained(path, safe_serialization=True)
    # Re-save the two big components sharded, as real checkpoints ship them.
    for name, shard_bytes in (("transformer", TRANSFORMER_SHARD_BYTES), ("text_encoder", TEXT_ENCODER_SHARD_BYTES)):
        shutil.rmtree(path / name)
        getattr(pipe, name).save_pretrained(path / name, safe_serialization=True, max_shard_size=shard_bytes)


@contextmanager
def _seeded(seed: int, component: int) -> Iterator[None]:
    # Default initialisers draw from the global RNG; fork it so building a checkpoint leaves the caller's RNG alone.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1000 + component)
        yield


def _build_qwen(tokenizer):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN_SPECIAL_TOKENS}
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": QWEN_HIDDEN,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 3,
            # Grouped-query attention like Qwen2.5-VL-7B (28 query heads over 4 key/value heads).
            "num_key_value_heads": 1,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            # M-RoPE splits head_dim / 2 = 8 rotary frequencies over (temporal, height, width).
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]},
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config={
            "depth": 2,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": QWEN_HIDDEN,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [1],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def _build_clip(tokenizer):
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=CLIP_HIDDEN,
        intermediate_size=48,
        projection_dim=CLIP_HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=77,
        hidden_act="quick_gelu",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModel(config).eval()


def _build_transformer(variant: Variant):
    from diffusers import Kandinsky6Transformer3DModel

    return Kandinsky6Transformer3DModel(**transformer_config(variant)).eval()


def _build_video_vae():
    from diffusers import AutoencoderKLHunyuanVideo

    # Four levels as in the real VAE: 8x spatial and 4x temporal compression, 16 latent channels; the default
    # scaling factor is the real one.
    return AutoencoderKLHunyuanVideo(
        latent_channels=VIDEO_LATENT_CHANNELS,
        block_out_channels=(8, 16, 16, 16),
        layers_per_block=1,
        norm_num_groups=4,
        spatial_compression_ratio=8,
        temporal_compression_ratio=4,
    ).eval()


def _build_audio_vae(variant: Variant):
    from diffusers import MMAudioVAE

    # 44.1 kHz with a mel hop of 512; the encoder halves the frame rate, so one latent step is 1024 samples.
    return MMAudioVAE(
        mel_bins=AUDIO_MEL_BINS,
        latent_channels=AUDIO_LATENT_CHANNELS,
        hidden_channels=16,
        channel_multipliers=(1, 2, 4),
        layers_per_block=1,
        sample_rate=44_100,
        n_fft=2048,
        hop_length=512,
        scaling_factor=AUDIO_VAE_SCALING[variant],
    ).eval()


def _build_vocoder():
    from diffusers import MMAudioVocoder

    # The upsample rates multiply to the audio VAE's mel hop (8 * 8 * 8 = 512), one waveform sample per step.
    return MMAudioVocoder(
        num_mels=AUDIO_MEL_BINS,
        upsample_initial_channel=16,
        upsample_rates=(8, 8, 8),
        upsample_kernel_sizes=(16, 16, 16),
        resblock_kernel_sizes=(3, 5),
        resblock_dilation_sizes=((1, 3), (1, 3)),
    ).eval()


def _build_scheduler(variant: Variant):
    from diffusers import FlowMatchEulerDiscreteScheduler, PiflowScheduler

    if variant == "distill":
        return PiflowScheduler(
            num_train_timesteps=1000,
            shift=5.0,
            n_grid=N_GRID,
            eps=1e-6,
            final_step_size_scale=0.5,
            num_policy_substeps=128,
        )
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0)


def _byte_symbols() -> list[str]:
    # GPT-2's byte-to-unicode table: the 256 symbols of every byte-level BPE, in GPT-2's order.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    symbols = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


_SPECIAL_RE = re.compile("|".join(re.escape(token) for token in QWEN_SPECIAL_TOKENS))


def _pretokenize(backend, text: str) -> list[tuple[str, ...]]:
    """Words of `text` as byte symbols, split the way `backend` (a `tokenizers.Tokenizer`) splits them before BPE;
    Qwen special tokens are dropped since BPE never sees them."""
    words: list[tuple[str, ...]] = []
    for piece in _SPECIAL_RE.split(text):
        normalized = backend.normalizer.normalize_str(piece)
        words.extend(tuple(word) for word, _ in backend.pre_tokenizer.pre_tokenize_str(normalized))
    return words


def _learn_merges(corpus: Counter, num_merges: int) -> list[tuple[str, str]]:
    """Greedy BPE: the most frequent pair each round, ties broken by the pair itself, never by hash order."""
    merges: list[tuple[str, str]] = []
    while len(merges) < num_merges:
        pairs = _pair_counts(corpus)
        if not pairs:
            break
        best = max(pairs.values())
        pair = min(p for p, count in pairs.items() if count == best)
        merges.append(pair)
        corpus = _apply_merge(corpus, pair)
    return merges


def _learn_merges_to_length(corpus: Counter, prefix: Counter, target_tokens: int) -> list[tuple[str, str]]:
    """Greedy BPE merges until `prefix` tokenizes to exactly `target_tokens` tokens.

    Each round takes the corpus's most frequent pair among those that cannot overshoot: a merge removes at most one
    prefix token per occurrence of the pair in the prefix. Near the end only single occurrences fit, which closes
    the gap one token at a time.
    """
    merges: list[tuple[str, str]] = []
    while (excess := _num_tokens(prefix) - target_tokens) > 0:
        prefix_pairs = _pair_counts(prefix)
        corpus_pairs = _pair_counts(corpus)
        candidates = {p: corpus_pairs[p] for p, count in prefix_pairs.items() if count <= excess}
        if not candidates:
            raise RuntimeError(
                f"tiny BPE: expected a merge that brings the prefix from {_num_tokens(prefix)} to {target_tokens} "
                "tokens, found none"
            )
        best = max(candidates.values())
        pair = min(p for p, count in candidates.items() if count == best)
        merges.append(pair)
        corpus = _apply_merge(corpus, pair)
        prefix = _apply_merge(prefix, pair)
    if excess < 0:
        raise RuntimeError(
            f"tiny BPE: the prefix is {_num_tokens(prefix)} tokens even unmerged, expected {target_tokens}"
        )
    return merges


def _num_tokens(corpus: Counter) -> int:
    return sum(len(word) * count for word, count in corpus.items())


def _pair_counts(corpus: Counter) -> Counter:
    pairs: Counter = Counter()
    for word, count in corpus.items():
        for pair in zip(word[:-1], word[1:], strict=True):
            pairs[pair] += count
    return pairs


def _apply_merge(corpus: Counter, pair: tuple[str, str]) -> Counter:
    merged: Counter = Counter()
    joined = pair[0] + pair[1]
    for word, count in corpus.items():
        out: list[str] = []
        i = 0
        while i < len(word):
            if i + 1 < len(word) and word[i] == pair[0] and word[i + 1] == pair[1]:
                out.append(joined)
                i += 2
            else:
                out.append(word[i])
                i += 1
        merged[tuple(out)] += count
    return merged
