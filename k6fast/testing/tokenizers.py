"""The tiny checkpoint's tokenizers: a Qwen2.5-VL processor and a CLIP tokenizer in the real layouts, their
byte-level BPE vocabularies trained here on a built-in corpus (no download).

The Qwen tokenizer keeps Qwen2.5-VL's special tokens, its chat template and right padding, and is trained so that
the chat-template prefix the reference pipeline crops is exactly QWEN_CROP_START tokens long: the cropped embeddings
then start at the user prompt, as they do with the real tokenizer.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import CLIPTokenizer, Qwen2_5_VLProcessor

# The reference pipeline crops this many Qwen tokens (the chat-template prefix) off the encoder output
# (`_QWEN_CROP_START` in pipeline_kandinsky6_ti2va.py); the tiny tokenizer is trained so that the prefix is exactly
# this long, so the cropped embeddings start at the user prompt as they do with the real tokenizer.
QWEN_CROP_START = 129

CLIP_NUM_MERGES = 160

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
