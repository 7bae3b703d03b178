"""The streamed text phase (`TextPhase`) against transformers' whole models (`TextEncoders`, `from_pretrained`), on
the tiny checkpoint on the CPU: bit-identical states, pooled embeddings and masks; the prompt cache (memory and disk,
corrupt and foreign files, what its key depends on); the torch-free plan the pipeline and `k6fast doctor` budget from.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from k6fast.prompt_cache import PromptCache
from k6fast.safetensors_index import TensorLocation
from k6fast.text import encode_prompts
from k6fast.text_phase import TextPhase
from k6fast.text_plan import ALIGN, TEMPLATE_TOKENS, QwenShape, TextWeights, text_footprint, text_weights, unit_bytes
from k6fast.text_stream import UnitLayout

PROMPT = "A fox runs through snow, wind howling"
NEGATIVE = "blurry, static"
CPU = torch.device("cpu")


def assert_same(expected, got) -> None:
    for a, b in zip(expected, got, strict=True):
        if a is None or b is None:
            assert a is None and b is None
            continue
        assert a.embeds.dtype == b.embeds.dtype and a.embeds.shape == b.embeds.shape
        assert torch.equal(a.embeds, b.embeds)
        assert torch.equal(a.pooled, b.pooled)
        assert (a.mask is None and b.mask is None) or torch.equal(a.mask, b.mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pad_to", [None, 40])
def test_streamed_encode_is_bit_identical_to_from_pretrained(tiny_distill, dtype, pad_to) -> None:
    expected = encode_prompts(tiny_distill, PROMPT, NEGATIVE, CPU, dtype, pad_to)
    phase = TextPhase(tiny_distill, CPU, dtype)
    try:
        got = phase.encode(PROMPT, NEGATIVE, pad_to)
        assert_same(expected, got)
        assert (got[0].mask is None) == (pad_to is None)
        # Qwen's decoder layers and CLIP cross once for both prompts; the embedding, vision tower and lm_head never.
        streamed = {loc.name for layout in phase.layouts for _, loc, _ in layout.pieces}
        assert not any(n.startswith(("visual.", "lm_head.")) or "embed_tokens" in n for n in streamed)
        assert phase.last.source == "encoded"
        assert phase.last.bytes_streamed == phase.footprint().streamed_bytes
        alone = phase.encode(PROMPT, None, pad_to)
        assert alone[1] is None
        assert_same(expected[:1], alone[:1])
    finally:
        phase.close()


def test_an_empty_prompt_is_refused(tiny_distill) -> None:
    phase = TextPhase(tiny_distill, CPU, torch.float32)
    try:
        with pytest.raises(ValueError, match="the prompt is empty"):
            phase.encode("  ", None)
        with pytest.raises(ValueError, match="the prompt is empty"):
            phase.encode(PROMPT, "")
    finally:
        phase.close()


def test_a_failed_read_leaves_no_weight_bound(tmp_path, tiny_distill) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(tiny_distill, root)
    phase = TextPhase(root, CPU, torch.float32)
    try:
        shard = max((root / "text_encoder").glob("model-*.safetensors"), key=lambda f: f.stat().st_size)
        with shard.open("r+b") as f:
            f.truncate(shard.stat().st_size // 2)
        with pytest.raises(RuntimeError, match="text encoder weight reader failed"):
            phase.encode(PROMPT, None)
        bound = [n for n, p in phase.qwen.language_model.layers.named_parameters() if p.device.type != "meta"]
        assert bound == [] and all(p.device.type == "meta" for p in phase.clip.parameters())
    finally:
        phase.close()


def test_repeated_prompts_come_from_the_cache(tiny_distill) -> None:
    cache = PromptCache()
    phase = TextPhase(tiny_distill, CPU, torch.float32, cache=cache)
    try:
        first = phase.encode(PROMPT, NEGATIVE)
        assert phase.last.source == "encoded"
        start = time.perf_counter()
        again = phase.encode(PROMPT, NEGATIVE)
        assert time.perf_counter() - start <= 0.05
        assert phase.last.source == "memory" and phase.last.bytes_streamed == 0
        assert_same(first, again)
        again[0].embeds.zero_()  # the caller's tensors are its own: the cache keeps its copy
        assert_same(first, phase.encode(PROMPT, NEGATIVE))
        phase.encode(PROMPT, None)
        assert phase.last.source == "encoded"  # another negative prompt is another entry
        phase.encode(PROMPT, NEGATIVE, pad_to=40)
        assert phase.last.source == "encoded"
    finally:
        phase.close()


def test_the_memory_cache_is_bounded_in_bytes(tiny_distill) -> None:
    phase = TextPhase(tiny_distill, CPU, torch.float32)
    try:
        one = phase.encode(PROMPT, None, pad_to=40)
        size = sum(t.numel() * t.element_size() for t in (one[0].embeds, one[0].pooled, one[0].mask))
        cache = PromptCache(max_bytes=2 * size)
        phase.cache = cache
        for prompt in ("a", "b", "c"):
            phase.encode(prompt, None, pad_to=40)
        assert cache.nbytes == 2 * size
        phase.encode("a", None, pad_to=40)
        assert phase.last.source == "encoded"  # the oldest entry left first
        phase.encode("c", None, pad_to=40)
        assert phase.last.source == "memory"
    finally:
        phase.close()


def test_the_key_follows_prompt_negative_padding_dtype_and_checkpoint(tmp_path, tiny_distill) -> None:
    phase = TextPhase(tiny_distill, CPU, torch.float32)
    bf16 = TextPhase(tiny_distill, CPU, torch.bfloat16)
    root = tmp_path / "ckpt"
    shutil.copytree(tiny_distill, root)
    config = root / "text_encoder_2" / "config.json"
    config.write_text(config.read_text() + " ")  # the same model, another file: embeddings are not trusted across
    other = TextPhase(root, CPU, torch.float32)
    try:
        keys = [phase.key(PROMPT, NEGATIVE, None), phase.key(PROMPT + ".", NEGATIVE, None),
                phase.key(PROMPT, None, None), phase.key(PROMPT, NEGATIVE, 40), bf16.key(PROMPT, NEGATIVE, None),
                other.key(PROMPT, NEGATIVE, None)]  # fmt: skip
        assert len({k.digest for k in keys}) == len(keys)
        assert phase.key(PROMPT, NEGATIVE, None) == TextPhase(tiny_distill, CPU, torch.float32).key(
            PROMPT, NEGATIVE, None
        )
    finally:
        for p in (phase, bf16, other):
            p.close()


def test_the_disk_cache_serves_a_new_process_and_rewrites_bad_files(tmp_path, tiny_distill) -> None:
    folder = tmp_path / "prompts"
    phase = TextPhase(tiny_distill, CPU, torch.float32, cache=PromptCache(directory=folder))
    first = phase.encode(PROMPT, NEGATIVE, pad_to=40)
    phase.close()
    (path,) = folder.glob("*.safetensors")
    assert not list(folder.glob(".*"))  # written atomically: no temporary left behind

    def fresh() -> TextPhase:  # a new process: an empty memory cache over the same folder
        return TextPhase(tiny_distill, CPU, torch.float32, cache=PromptCache(directory=folder))

    phase = fresh()
    assert_same(first, phase.encode(PROMPT, NEGATIVE, pad_to=40))
    assert phase.last.source == "disk"
    other_key = phase.cache.path(phase.key("another prompt", NEGATIVE, 40))
    phase.encode("another prompt", NEGATIVE, pad_to=40)
    good = path.read_bytes()
    phase.close()

    for bad in (good[: len(good) // 2], b"not a safetensors file", other_key.read_bytes()):
        path.write_bytes(bad)  # truncated, garbage, and a valid file of another key under this key's name
        phase = fresh()
        try:
            assert_same(first, phase.encode(PROMPT, NEGATIVE, pad_to=40))
            assert phase.last.source == "encoded"
            phase.cache.clear()
            assert_same(first, phase.encode(PROMPT, NEGATIVE, pad_to=40))
            assert phase.last.source == "disk"  # rewritten
        finally:
            phase.close()


def test_device_bytes_come_from_the_plan(tiny_distill) -> None:
    phase = TextPhase(tiny_distill, CPU, torch.float32)
    try:
        weights = text_weights(tiny_distill)
        assert phase.device_bytes() == text_footprint(weights, "F32").device_bytes
        assert phase.device_bytes(2048) > phase.device_bytes()
        assert [layout.nbytes for layout in phase.layouts] == [unit_bytes(u) for u in weights.units()]
    finally:
        phase.close()


def _fake_weights(q: QwenShape, clip_params: int, clip_hidden: int) -> TextWeights:
    """TextWeights of the release's shapes without files (the plan reads only locations)."""
    h, kv = q.hidden, q.kv_heads * q.head_dim
    layer = {"self_attn.q_proj.weight": (h, h), "self_attn.q_proj.bias": (h,), "self_attn.k_proj.weight": (kv, h),
             "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.weight": (kv, h), "self_attn.v_proj.bias": (kv,),
             "self_attn.o_proj.weight": (h, h), "mlp.gate_proj.weight": (q.intermediate, h),
             "mlp.up_proj.weight": (q.intermediate, h), "mlp.down_proj.weight": (h, q.intermediate),
             "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}  # fmt: skip
    shapes = {f"model.layers.{i}.{n}": s for i in range(q.layers) for n, s in layer.items()}
    shapes |= {"model.embed_tokens.weight": (q.vocab, h), "model.norm.weight": (h,)}
    loc = lambda n, s: TensorLocation(n, Path("/nonexistent"), 0, 2 * math.prod(s), "BF16", s)  # noqa: E731
    qwen = {n: loc(n, s) for n, s in shapes.items()}
    clip = {"text_model.all": loc("text_model.all", (clip_params,))}
    prefixes = tuple(f"model.layers.{i}." for i in range(q.layers))
    return TextWeights(
        q, clip_hidden, qwen, clip, prefixes, qwen["model.embed_tokens.weight"], qwen["model.norm.weight"]
    )


def test_the_plan_at_the_release_shapes() -> None:
    from k6fast.testing.model_constants import CLIP_L_TEXT, CLIP_L_TEXT_PARAMETERS, QWEN_7B_TEXT

    t = QWEN_7B_TEXT
    q = QwenShape(t["hidden_size"], t["intermediate_size"], t["num_attention_heads"], t["num_key_value_heads"],
                  t["num_hidden_layers"], t["vocab_size"])  # fmt: skip
    plan = text_footprint(_fake_weights(q, CLIP_L_TEXT_PARAMETERS, CLIP_L_TEXT["hidden_size"]), "BF16")
    layer_bytes = 2 * (2 * 3584 * 3584 + 3584 + 2 * (512 * 3584 + 512) + 3 * 3584 * 18944 + 2 * 3584)
    assert plan.unit_bytes == layer_bytes == 466_115_584
    assert plan.streamed_bytes == 28 * layer_bytes + 2 * CLIP_L_TEXT_PARAMETERS  # 13.3 GB per new prompt
    assert plan.tokens == 1024 + TEMPLATE_TOKENS and plan.convert_bytes == 0
    assert 2 * layer_bytes < plan.device_bytes < 2 * layer_bytes + 2**30
    assert "text phase:" in plan.describe()


def test_the_plan_restates_the_constants_it_shares() -> None:
    from diffusers.pipelines.kandinsky6.pipeline_kandinsky6_ti2va import _QWEN_CROP_START

    from k6fast.stream.plan import SLOT_ALIGN as BLOCK_ALIGN

    assert TEMPLATE_TOKENS == _QWEN_CROP_START and ALIGN == BLOCK_ALIGN
    locs = {
        "a": TensorLocation("a", Path("x"), 0, 10, "BF16", (5,)),
        "b": TensorLocation("b", Path("x"), 0, 512, "U8", (512,)),
    }
    assert UnitLayout.of(locs).nbytes == unit_bytes(locs) == 256 + 512


def test_the_plan_imports_no_torch(tiny_distill) -> None:
    code = (f"import sys, k6fast.text_plan as p; f = p.text_footprint(p.text_weights({str(tiny_distill)!r}), 'F32'); "
            "assert f.device_bytes > 0; assert 'torch' not in sys.modules, 'torch imported'")  # fmt: skip
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
