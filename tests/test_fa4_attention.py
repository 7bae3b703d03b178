"""flash-attn-4 as the exact-attention kernel (k6fast/kernels/fa4_attention.py, `K6_EXACT_ATTN_KERNEL=fa4`).

CPU: the switch refuses the removed `k6` value (k6fast's Gluon exact kernel) naming what it accepts; where
flash-attn-4 cannot run (no CUDA device, the package missing) the reason is explicit and the dispatch falls back to
SDPA, logged once, and counts it; with flash-attn-4 present, unmasked calls of a shape it takes go to its op and
masked or unsupported ones to SDPA (the op replaced by a recording stand-in). GPU (`-m gpu`, flash-attn-4 installed,
sm_90/sm_100/sm_120): the flash-attention rule against FP32 attention (error no worse than twice SDPA's) at odd shapes
and both head dims, the op under torch.compile, the dispatch routing unmasked calls to it.
"""

from __future__ import annotations

import logging
import re
import sys

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import needs_cuda

from k6fast.dit import attention as attention_module
from k6fast.dit.attention import AttentionDispatch
from k6fast.kernels import fa4_attention as fa4
from k6fast.switches import Options, SwitchError, load_options
from k6fast.testing.bounds import assert_within_baseline_error, rel_l2


@pytest.fixture
def fresh_import():
    fa4.import_fa4.cache_clear()
    attention_module.log_once.cache_clear()
    yield
    fa4.import_fa4.cache_clear()
    attention_module.log_once.cache_clear()


def test_removed_gluon_value_is_refused_naming_the_accepted_ones(tmp_path):
    """`k6` (k6fast's own Gluon exact kernel) is gone: from the environment, an arm file or Options it is refused with
    what the switch accepts, never silently taken as SDPA."""
    expected = "Unable to use K6_EXACT_ATTN_KERNEL='k6': expected one of sdpa, fa4"
    with pytest.raises(SwitchError, match=expected):
        load_options({"K6_EXACT_ATTN_KERNEL": "k6"})
    arm = tmp_path / "old.env"
    arm.write_text("K6_EXACT_ATTN_KERNEL=k6\n", encoding="utf-8")
    with pytest.raises(SwitchError, match=re.escape(f"{arm}:1: {expected}")):
        load_options({}, arm=arm)
    with pytest.raises(SwitchError, match=expected):
        Options().replace(exact_attn_kernel="k6")
    assert load_options({"K6_EXACT_ATTN_KERNEL": "fa4"}).exact_attn_kernel == "fa4"


def test_no_cuda_device_is_a_stated_reason():
    assert "needs a CUDA device" in fa4.fa4_unavailable_reason(torch.device("cpu"))


def test_a_missing_package_is_a_stated_reason(monkeypatch, fresh_import):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # makes `import flash_attn.cute` raise ImportError
    module, why = fa4.import_fa4()
    assert module is None and "flash-attn-4 cannot be imported (ModuleNotFoundError" in why and "k6fast[fa4]" in why


def test_shapes_it_takes():
    bf = torch.empty(1, 10, 2, 64, dtype=torch.bfloat16)
    assert fa4.fa4_shapes_ok(bf, bf, bf)
    assert fa4.fa4_shapes_ok(bf, bf[:, :3], bf[:, :3])  # cross attention
    assert not fa4.fa4_shapes_ok(bf.float(), bf.float(), bf.float())  # fp32
    assert not fa4.fa4_shapes_ok(bf, bf.half(), bf)  # mixed dtypes
    wide = torch.empty(1, 10, 2, 192, dtype=torch.bfloat16)
    assert not fa4.fa4_shapes_ok(wide, wide, wide)  # above 128 (sm_100's bound)
    assert not fa4.fa4_supported(bf, bf, bf)  # CPU tensors
    with pytest.raises(ValueError, match="fa4_attention: expected"):
        fa4.fa4_attention(bf, bf, bf)


def test_dispatch_falls_back_to_sdpa_logged_once(caplog, fresh_import):
    with caplog.at_level(logging.WARNING):
        dispatch = AttentionDispatch(Options().replace(exact_attn_kernel="fa4"), torch.device("cpu"))
        AttentionDispatch(Options().replace(exact_attn_kernel="fa4"), torch.device("cpu"))
    warnings = [r.getMessage() for r in caplog.records if "K6_EXACT_ATTN_KERNEL=fa4" in r.getMessage()]
    assert len(warnings) == 1 and "needs a CUDA device" in warnings[0] and "runs PyTorch SDPA" in warnings[0]
    assert dispatch.choices["exact"] == "sdpa (flash-attn-4 unavailable)"
    q = torch.randn(1, 20, 2, 64)
    out = dispatch(q, q, q, site="video_self", mask=None)
    assert dispatch.counts[("exact", "video_self")] == 1
    torch.testing.assert_close(out, F.scaled_dot_product_attention(*(q.transpose(1, 2),) * 3).transpose(1, 2))


def test_dispatch_routes_unmasked_calls_it_takes(monkeypatch, caplog, fresh_import):
    calls = []

    def stand_in(q, k, v):
        calls.append(q.shape)
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    monkeypatch.setattr(attention_module, "fa4_runs_on", lambda device: True)
    monkeypatch.setattr(fa4, "fa4_attention_op", stand_in)
    dispatch = AttentionDispatch(Options().replace(exact_attn_kernel="fa4"), torch.device("cpu"))
    q = torch.randn(1, 20, 2, 64, dtype=torch.bfloat16)
    dispatch(q, q, q, site="video_self", mask=None)
    dispatch(q, q[:, :5], q[:, :5], site="video_text", mask=torch.ones(1, 5, dtype=torch.bool))  # masked: SDPA
    with caplog.at_level(logging.WARNING):
        dispatch(q.float(), q.float(), q.float(), site="audio_self", mask=None)  # fp32: SDPA, said once
        dispatch(q.float(), q.float(), q.float(), site="audio_self", mask=None)
    assert calls == [q.shape]
    assert dispatch.counts == {("exact_fa4", "video_self"): 1, ("exact", "video_text"): 1, ("exact", "audio_self"): 2}
    said = [r for r in caplog.records if "is not taken; using SDPA" in r.getMessage()]
    assert len(said) == 1


# ---------------------------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------------------------


def _fa4_runs() -> bool:
    """Whether flash-attn-4 runs on this GPU. Where it does not (not installed, another architecture), the GPU tests
    check the other half of the contract instead: the kernel refuses with the reason and the dispatch takes SDPA."""
    return fa4.fa4_unavailable_reason(torch.device("cuda")) is None


def _assert_falls_back_to_sdpa(q, k, v) -> None:
    with pytest.raises(ValueError, match="fa4_attention: expected"):
        fa4.fa4_attention(q, k, v)
    dispatch = AttentionDispatch(Options().replace(exact_attn_kernel="fa4"), torch.device("cuda"))
    out = dispatch(q, k, v, site="video_self", mask=None)
    sdpa = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    # SDPA's backend order may differ from the default call's: the same attention within half-precision rounding.
    assert dispatch.counts == {("exact", "video_self"): 1} and rel_l2(out, sdpa) <= 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "shape", [(2, 3, 218, 218, 128), (1, 2, 1, 1000, 64), (1, 4, 1000, 1, 128), (2, 3, 1000, 777, 64)]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_flash_attention_rule(shape, dtype):
    from k6fast.kernels.quant_attention import attention_fp32

    b, h, m, n, d = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, m, h, d, generator=g, device="cuda").to(dtype)
    k = (torch.randn(b, n, h, d, generator=g, device="cuda") + 3 * torch.randn(h, d, generator=g, device="cuda")).to(
        dtype
    )
    v = torch.randn(b, n, h, d, generator=g, device="cuda").to(dtype)
    if not _fa4_runs():
        _assert_falls_back_to_sdpa(q, k, v)
        return
    exact = attention_fp32(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    sdpa = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    out = fa4.fa4_attention(q, k, v)
    assert out.shape == q.shape and out.dtype == dtype
    assert_within_baseline_error(out, sdpa, exact, metric="rel_l2", atol=1e-6, what=f"fa4 {shape} {dtype}")


@pytest.mark.gpu
@needs_cuda
def test_gpu_compiled_op_and_dispatch():
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(1, 500, 4, 128, generator=g, device="cuda").bfloat16() for _ in range(3))
    if not _fa4_runs():
        _assert_falls_back_to_sdpa(q, k, v)
        return
    eager = fa4.fa4_attention(q, k, v)
    compiled = torch.compile(lambda a, b, c: fa4.fa4_attention_op(a, b, c) * 1.0, fullgraph=True)(q, k, v)
    assert torch.equal(compiled, eager)
    dispatch = AttentionDispatch(Options().replace(exact_attn_kernel="fa4"), torch.device("cuda"))
    assert dispatch.choices["exact"].startswith("flash-attn-4 ")
    assert torch.equal(dispatch(q, k, v, site="video_self", mask=None), eager)
    assert dispatch.counts[("exact_fa4", "video_self")] == 1


_SECOND_START = """
import sys, torch
from k6fast.entry import configure_compile_caches
configure_compile_caches(sys.argv[1])  # before flash-attn-4 is imported, as the entry points do
from k6fast.kernels import fa4_attention as fa4
if fa4.fa4_unavailable_reason(torch.device("cuda")):
    print("unavailable:", fa4.fa4_unavailable_reason(torch.device("cuda")))
    sys.exit(0)
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(1, 300, 2, 128, generator=g, device="cuda").bfloat16() for _ in range(3))
torch.save(fa4.fa4_attention(q, k, v).cpu(), sys.argv[2])
print("ran")
"""


@pytest.mark.gpu
@needs_cuda
def test_gpu_a_second_process_loads_the_kernels_the_first_compiled(tmp_path):
    """flash-attn-4's kernels compile for seconds per shape; with k6fast's cache settings the first process leaves
    them on disk and a second one loads them (compiling nothing) and computes the same bits."""
    import subprocess

    def start(out):
        # cwd: not the repository: the installed package is the one under test
        done = subprocess.run(
            [sys.executable, "-c", _SECOND_START, str(tmp_path / "cache"), str(out)],
            capture_output=True, text=True, timeout=600, cwd=tmp_path,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip().splitlines()[-1]

    fa4_dir = tmp_path / "cache" / "fa4"
    first = start(tmp_path / "first.pt")
    if first.startswith("unavailable:"):  # no flash-attn-4 here: nothing compiled, nothing kept
        assert "flash-attn-4" in first and not any(fa4_dir.rglob("*"))
        return
    kept = sorted(p for p in fa4_dir.rglob("*") if p.is_file())
    assert first == "ran" and kept, "the first process left no compiled kernel on disk"
    assert start(tmp_path / "second.pt") == "ran"
    assert sorted(p for p in fa4_dir.rglob("*") if p.is_file()) == kept, "the second process compiled again"
    assert torch.equal(torch.load(tmp_path / "first.pt"), torch.load(tmp_path / "second.pt"))
