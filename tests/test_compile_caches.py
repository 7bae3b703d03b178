"""The compile caches a second start reuses: the entry points ask for flash-attn-4's disk cache, and set every
cache's variables before anything imports flash-attn-4 (it reads them once, at import; set later they do nothing).
A Pipeline built by library code changes no environment variable."""

from __future__ import annotations

import os

import pytest

from k6fast.cli import main
from k6fast.entry import configure_compile_caches
from k6fast.kernels import fa4_attention
from k6fast.pipeline import Pipeline
from k6fast.switches import Options

VARIABLES = (
    "TORCHINDUCTOR_CACHE_DIR",
    "TRITON_CACHE_DIR",
    "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED",
    "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR",
)


@pytest.fixture
def clean_env(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)  # restored (or removed again) after the test
    return monkeypatch


def _cache_env() -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in VARIABLES}


def test_a_cache_dir_holds_every_compilers_cache(clean_env, tmp_path):
    configure_compile_caches(str(tmp_path))
    assert _cache_env() == {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path),
        "TRITON_CACHE_DIR": str(tmp_path / "triton"),
        "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1",
        "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": str(tmp_path / "fa4"),
    }


def test_without_a_cache_dir_flash_attn_4_still_keeps_its_kernels(clean_env):
    configure_compile_caches("")
    assert _cache_env() == {
        "TORCHINDUCTOR_CACHE_DIR": None,
        "TRITON_CACHE_DIR": None,
        "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1",  # in flash-attn-4's own default place
        "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": None,
    }


def test_the_users_own_settings_are_kept(clean_env, tmp_path):
    clean_env.setenv("TRITON_CACHE_DIR", "/elsewhere/triton")
    clean_env.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "0")
    configure_compile_caches(str(tmp_path))
    assert os.environ["TRITON_CACHE_DIR"] == "/elsewhere/triton"
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "0"
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] == str(tmp_path / "fa4")


def test_generate_sets_them_before_the_backend_imports_flash_attn_4(clean_env, tmp_path, tiny_distill):
    """Building the attention backend with K6_EXACT_ATTN_KERNEL=fa4 asks whether flash-attn-4 runs, which imports it
    on a GPU: `k6fast generate` must have set the cache variables by then (they were set after it once, and every
    process compiled its kernels again)."""
    seen: list[dict[str, str | None]] = []
    real = fa4_attention.fa4_unavailable_reason

    def recording(device):
        seen.append(_cache_env())
        return real(device)

    clean_env.setattr(fa4_attention, "fa4_unavailable_reason", recording)
    clean_env.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)  # the command line sets it too; restored after
    cache = tmp_path / "cache"
    clean_env.setenv("K6_EXACT_ATTN_KERNEL", "fa4")
    clean_env.setenv("K6_INDUCTOR_CACHE_DIR", str(cache))
    argv = ["generate", "--prompt", "a cat", "--size", "32x32", "--frames", "5", "--steps", "1", "--no-audio"]
    assert main([*argv, "--model", str(tiny_distill), "--out", str(tmp_path / "clip.mp4")]) == 0
    assert seen, "the backend never asked whether flash-attn-4 runs"
    assert seen[0]["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
    assert seen[0]["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] == str(cache / "fa4")
    assert seen[0]["TRITON_CACHE_DIR"] == str(cache / "triton")


def test_a_library_pipeline_changes_no_environment_variable(clean_env, tmp_path, tiny_distill):
    before = dict(os.environ)
    options = Options().replace(exact_attn_kernel="fa4", inductor_cache_dir=str(tmp_path / "cache"))
    Pipeline(tiny_distill, options, device="cpu").close()
    assert dict(os.environ) == before
