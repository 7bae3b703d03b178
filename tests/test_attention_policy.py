"""The attention and GEMM policies end to end on a small DiT (head_dim 64, as Lite) on CPU: exact blocks and steps
really run the exact backend (counted), masked calls go exact, a missing sageattention stops start-up."""

from __future__ import annotations

import sys

import pytest
import torch
from diffusers import Kandinsky6Transformer3DModel

from k6fast.dit.attention import AttentionDispatch
from k6fast.dit.backend import SwitchedBackend
from k6fast.dit.config import DiTConfig
from k6fast.dit.linear import LinearDispatch
from k6fast.dit.model import K6DiT
from k6fast.switches import Options, SwitchError

CONFIG = dict(
    in_visual_dim=4, out_visual_dim=4, in_text_dim=24, in_text_dim2=20, time_dim=16, model_dim=128, ff_dim=64,
    num_text_blocks=1, num_visual_blocks=4, axes_dims=(16, 24, 24), in_audio_dim=6, out_audio_dim=6,
    model_dim_a=128, time_dim_a=16, ff_dim_a=48, audio_freqs_scaling=0.144, ca_rope=True, cross_gates=True,
    fix_modulation=True, visual_token_type_num_embeddings=2,
)  # fmt: skip


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    ref = Kandinsky6Transformer3DModel(**CONFIG).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return DiTConfig.from_dict(dict(ref.config)), {k: v.clone() for k, v in ref.state_dict().items()}


def _inputs(cfg: DiTConfig, masked: bool = False) -> dict:
    g = torch.Generator().manual_seed(1)
    kw = dict(
        hidden_states=torch.randn(1, 2, 4, 4, cfg.visual_in_channels, generator=g),
        encoder_hidden_states=torch.randn(1, 5, cfg.in_text_dim, generator=g),
        pooled_projections=torch.randn(1, cfg.in_text_dim2, generator=g),
        timestep=torch.tensor([600.0]),
        audio_hidden_states=torch.randn(1, 3, cfg.in_audio_dim, generator=g),
    )
    if masked:
        kw["encoder_attention_mask"] = torch.tensor([[True, True, True, False, False]])
    return kw


def test_exact_blocks_and_steps_run_exact(model) -> None:
    cfg, weights = model
    options = Options().replace(attn="k6", exact_attn_blocks=1, exact_attn_steps=1)
    backend = SwitchedBackend(options, torch.device("cpu"))
    dit = K6DiT(cfg, weights, backend=backend)
    counts = backend.attn.counts
    dit.begin_step(0)
    dit(**_inputs(cfg))
    assert counts[("k6", "video_self")] == 0 and counts[("exact", "video_self")] == 4  # step 0 is exact
    counts.clear()
    dit.begin_step(1)
    quantized = dit(**_inputs(cfg))
    # Blocks 1 and 2 are quantized; blocks 0 and 3 (first and last) stay exact; other sites are exact by default.
    assert counts[("k6", "video_self")] == 2 and counts[("exact", "video_self")] == 2
    assert counts[("exact", "audio_self")] == 4 and counts[("exact", "text_self")] == 2
    exact = K6DiT(cfg, weights, backend=SwitchedBackend(Options(), torch.device("cpu")))(**_inputs(cfg))
    rel = ((quantized[0] - exact[0]).norm() / exact[0].norm()).item()
    assert 0 < rel < 0.05  # lossy, but close: INT8 QK and quantized PV on two of four blocks


def test_all_sites_but_masked_calls_stay_exact(model) -> None:
    cfg, weights = model
    backend = SwitchedBackend(Options().replace(attn="k6", quant_attn_sites="all"), torch.device("cpu"))
    K6DiT(cfg, weights, backend=backend)(**_inputs(cfg, masked=True))
    counts = backend.attn.counts
    for site in ("video_self", "audio_self", "video_audio", "audio_video"):
        assert counts[("k6", site)] == 4, site
    for site in ("video_text", "audio_text"):  # masked: always exact
        assert counts[("exact", site)] == 4 and counts[("k6", site)] == 0, site


def test_reference_backend_is_all_exact(model) -> None:
    cfg, weights = model
    backend = SwitchedBackend(Options(), torch.device("cpu"))
    K6DiT(cfg, weights, backend=backend)(**_inputs(cfg))
    assert all(kind == "exact" for kind, _ in backend.attn.counts)
    assert backend.gemm.counts["bf16"] > 0 and set(backend.gemm.counts) == {"bf16"}


def test_sage_without_its_package_is_a_start_up_error(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "sageattention", None)  # makes `import sageattention` raise ImportError
    with pytest.raises(SwitchError, match="K6_ATTN='sage'.*sageattention"):
        AttentionDispatch(Options().replace(attn="sage"), torch.device("cpu"))


@pytest.mark.parametrize(
    ("name", "rows", "shape", "fast"),
    [
        ("video_dec_block.self_attention.to_query", 50220, (4096, 4096), True),
        ("video_dec_block.feed_forward.net.0.proj", 50220, (16384, 4096), True),
        ("audio_dec_block.self_attention.to_query", 218, (2048, 2048), False),  # below the row threshold
        ("video_dec_block.visual_modulation.out_layer", 50220, (36864, 1024), False),  # always exact
        ("video_time_embeddings.timestep_embedder.linear_1", 50220, (1024, 4096), False),
        ("out_layer.out_layer", 50220, (640, 4096), True),
        ("odd", 50220, (100, 4096), False),  # N not a multiple of 16
    ],
)
def test_gemm_policy(name: str, rows: int, shape: tuple[int, int], fast: bool) -> None:
    assert LinearDispatch(Options().replace(gemm="fp8")).use_fast(rows, shape, name) is fast
    assert LinearDispatch(Options()).use_fast(rows, shape, name) is False


def test_auto_choices_follow_the_card(monkeypatch) -> None:
    from k6fast.dit import arch
    from k6fast.switches import Options

    cuda = torch.device("cuda", 0)
    cards = {"NVIDIA GeForce RTX 5090": (12, 0), "NVIDIA GeForce RTX 4090": (8, 9), "NVIDIA GeForce RTX 3090": (8, 6),
             "NVIDIA H200": (9, 0), "NVIDIA L40S": (8, 9)}  # fmt: skip
    expected = {"NVIDIA GeForce RTX 5090": ("fp16acc", "k6"), "NVIDIA GeForce RTX 4090": ("fp16acc", "k6"),
                "NVIDIA GeForce RTX 3090": ("fp16acc", "exact"), "NVIDIA H200": ("bf16", "exact"),
                "NVIDIA L40S": ("bf16", "exact")}  # fmt: skip
    auto = Options().replace(gemm="auto", attn="auto")
    for name, capability in cards.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        resolved = arch.resolve_auto(auto, cuda)
        assert (resolved.gemm, resolved.attn) == expected[name], name
    cpu = arch.resolve_auto(auto, torch.device("cpu"))
    assert (cpu.gemm, cpu.attn) == ("bf16", "exact")
    explicit = Options().replace(gemm="fp8", attn="k6")
    assert arch.resolve_auto(explicit, torch.device("cpu")) is explicit
    with pytest.raises(ValueError, match="resolved for a device"):
        LinearDispatch(auto)
    with pytest.raises(ValueError, match="resolved for a device"):
        AttentionDispatch(auto, torch.device("cpu"))


def test_projections_of_one_input_share_a_linears_call(model) -> None:
    # q/k/v of a self-attention, k/v of a cross-attention: one `linears` call each, so the fp8 arm prepares the input
    # (row quantization, outlier channels) once; the outputs equal separate `linear` calls.
    cfg, weights = model
    groups: list[list[str]] = []

    class Recording(SwitchedBackend):
        def linears(self, x, layers):
            groups.append([name.rsplit(".", 1)[1] for _, _, name in layers])
            return super().linears(x, layers)

    backend = Recording(Options(), torch.device("cpu"))
    recorded = K6DiT(cfg, weights, backend=backend)(**_inputs(cfg))
    calls = {site: n for (_, site), n in backend.attn.counts.items()}
    self_attentions = sum(n for site, n in calls.items() if site.endswith("_self"))
    cross_attentions = sum(calls.values()) - self_attentions
    assert self_attentions == 2 + 4 * 2 and cross_attentions == 4 * 4
    assert groups.count(["to_query", "to_key", "to_value"]) == self_attentions
    assert groups.count(["to_key", "to_value"]) == cross_attentions
    assert len(groups) == self_attentions + cross_attentions
    plain = K6DiT(cfg, weights, backend=SwitchedBackend(Options(), torch.device("cpu")))(**_inputs(cfg))
    for a, b in zip(recorded, plain, strict=True):
        assert torch.equal(a, b)


def test_fp8_input_is_prepared_once_per_shared_dict(monkeypatch) -> None:
    from k6fast.dit import linear as linear_module
    from k6fast.kernels import fp8_outliers

    calls = []
    choose = fp8_outliers.outlier_columns
    monkeypatch.setattr(fp8_outliers, "outlier_columns", lambda x, c: calls.append(c) or choose(x, c))
    x = torch.randn(2, 70, 128)
    shared: dict = {}
    first = linear_module.fp8_input(x, 32, shared)
    assert linear_module.fp8_input(x, 32, shared) is first and calls == [32]
    cols, (xq, scale) = first
    assert cols.shape == (128,) and xq.shape == (140, 256) and scale.shape == (140, 1)
    plain = linear_module.fp8_input(x, 0, shared)  # stored fp8 weights: no outlier columns, its own entry
    assert plain[0] is None and plain[1][0].shape == (140, 128) and calls == [32, 0]
    assert linear_module.fp8_input(x, 32, None) is not first and calls == [32, 0, 32]  # no dict: no sharing


def test_switched_linears_hand_the_layers_one_shared_dict() -> None:
    backend = SwitchedBackend(Options(), torch.device("cpu"))
    seen = []
    backend.gemm = lambda x, w, b, *, name, shared: seen.append((name, shared)) or x @ w.t()
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    outs = backend.linears(x, [(w, None, "a"), (2 * w, None, "b")])
    backend.linears(x, [(w, None, "c")])
    assert [name for name, _ in seen] == ["a", "b", "c"]
    assert seen[0][1] is seen[1][1] and seen[2][1] is not seen[0][1]  # one dict per call, shared by its layers
    assert torch.equal(outs[1], 2 * outs[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("outliers", ["0", "32"])
def test_fp8_linears_match_separate_calls_gpu(monkeypatch, outliers) -> None:
    from k6fast.kernels import fp8_linear

    # Count the preparations themselves (row quantizations of the input x), not the calls that find one already
    # made; the weights' own quantizations (residual=True) go through the same function and are not counted.
    prepared = []
    quantize = fp8_linear.quantize_rows_fp8

    def counting(x, *args, **kwargs):
        if not kwargs.get("residual", False):
            prepared.append(tuple(x.shape))
        return quantize(x, *args, **kwargs)

    monkeypatch.setattr(fp8_linear, "quantize_rows_fp8", counting)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(3000, 512, device="cuda", generator=g).bfloat16()
    layers = [
        ((torch.randn(n, 512, device="cuda", generator=g) * 0.02).bfloat16(), None, f"a.self_attention.{name}")
        for n, name in ((512, "to_query"), (256, "to_key"), (256, "to_value"))
    ]
    options = Options().replace(gemm="fp8", gemm_min_rows=1, fp8_outlier_channels=outliers)
    backend = SwitchedBackend(options, torch.device("cuda"))
    together = backend.linears(x, layers)
    assert len(prepared) == 1
    separate = [backend.linear(x, w, b, name=name) for w, b, name in layers]
    assert len(prepared) == 4 and backend.gemm.counts["fp8"] == 6
    for a, b in zip(together, separate, strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------------------------
# The sparse video self-attention arm (K6_SPARSE_ATTN): its policy, the token order, and nothing moving when off
# ---------------------------------------------------------------------------------------------------------------------


def _video_inputs(cfg: DiTConfig, image: bool = False) -> dict:
    """A 4 x 8 x 16 token grid (4 blocks of 128) with audio; `image`: a tail frame at temporal position 0."""
    kw = _inputs(cfg)
    g = torch.Generator().manual_seed(2)
    frames = 4
    kw["hidden_states"] = torch.randn(1, frames, 16, 32, cfg.visual_in_channels, generator=g)
    if image:
        kw["visual_rope_pos"] = (torch.tensor([0, 1, 2, 0]), torch.arange(8), torch.arange(16))
        kw["visual_token_type_ids"] = torch.tensor([[0, 0, 0, 1]])
    return kw


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_sparse_runs_in_the_middle_blocks_after_the_first_steps(model) -> None:
    cfg, weights = model
    options = Options().replace(sparse_attn=0.5, exact_attn_blocks=1, exact_attn_steps=1)
    backend = SwitchedBackend(options, torch.device("cpu"))
    dit = K6DiT(cfg, weights, backend=backend)
    counts = backend.attn.counts
    dit.begin_step(0)
    dit(**_video_inputs(cfg))
    assert counts[("sparse", "video_self")] == 0 and counts[("exact", "video_self")] == 4  # step 0 dense
    counts.clear()
    dit.begin_step(1)
    dit(**_video_inputs(cfg))
    # Blocks 1 and 2 sparse; blocks 0 and 3 (first and last) dense; no other site is ever sparse.
    assert counts[("sparse", "video_self")] == 2 and counts[("exact", "video_self")] == 2
    assert {site for (kind, site) in counts if kind == "sparse"} == {"video_self"}
    assert counts[("exact", "audio_self")] == 4 and counts[("exact", "video_audio")] == 4
    policy = backend.attn
    assert [policy.sparsifies_block(i, 4) for i in range(4)] == [False, True, True, False]
    policy.begin_step(0)
    assert not any(policy.sparsifies_block(i, 4) for i in range(4))


def test_sparse_takes_video_self_attention_from_the_quantized_arm(model) -> None:
    cfg, weights = model
    options = Options().replace(sparse_attn=0.5, attn="k6", quant_attn_sites="self")
    backend = SwitchedBackend(options, torch.device("cpu"))
    K6DiT(cfg, weights, backend=backend)(**_video_inputs(cfg))
    counts = backend.attn.counts
    assert counts[("sparse", "video_self")] == 4 and counts[("k6", "video_self")] == 0
    assert counts[("k6", "audio_self")] == 4


def test_with_the_arm_off_nothing_moves(model) -> None:
    cfg, weights = model
    backend = SwitchedBackend(Options().replace(exact_attn_blocks=2, exact_attn_steps=1), torch.device("cpu"))
    assert backend.video_token_order((4, 8, 16), None) is None
    got = K6DiT(cfg, weights, backend=backend)(**_video_inputs(cfg, image=True))
    want = K6DiT(cfg, weights)(**_video_inputs(cfg, image=True))  # ExactBackend: no order hook at all
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert "sparse" not in backend.attn.choices


@pytest.mark.parametrize("image", [False, True])
def test_the_tiled_order_round_trips_through_the_forward(model, image) -> None:
    # Density 1 keeps every block: the only differences from the dense forward are the order in which attention sums
    # its keys. A token or a RoPE row left out of place, or an order not undone, would be an O(1) error.
    cfg, weights = model
    backend = SwitchedBackend(Options().replace(sparse_attn=1.0), torch.device("cpu"))
    dense = K6DiT(cfg, weights)(**_video_inputs(cfg, image))
    tiled = K6DiT(cfg, weights, backend=backend)(**_video_inputs(cfg, image))
    assert backend.attn.counts[("sparse", "video_self")] == 4
    order = backend.attn.token_order
    assert order is not None and order.num_tokens == 4 * 8 * 16 and not torch.equal(order.perm, order.inverse)
    assert _rel(tiled[0], dense[0]) < 1e-5 and _rel(tiled[1], dense[1]) < 1e-5


def test_sparse_at_half_density_changes_the_output(model) -> None:
    cfg, weights = model
    backend = SwitchedBackend(Options().replace(sparse_attn=0.5, sparse_attn_window=0), torch.device("cpu"))
    dense = K6DiT(cfg, weights)(**_video_inputs(cfg))
    sparse = K6DiT(cfg, weights, backend=backend)(**_video_inputs(cfg))
    assert torch.isfinite(sparse[0]).all() and _rel(sparse[0], dense[0]) > 1e-3
    assert backend.attn.choices["sparse"] == "density 0.5, window 0, reference"


def test_the_order_is_built_once_per_geometry() -> None:
    dispatch = AttentionDispatch(Options().replace(sparse_attn=0.25), torch.device("cpu"))
    grid = (4, 8, 16)
    first = dispatch.video_token_order(grid, None)
    assert dispatch.video_token_order(grid, None) is first
    tail = dispatch.video_token_order(grid, (torch.tensor([0, 1, 2, 0]), torch.arange(8), torch.arange(16)))
    assert tail is not first and tail.lo[0, 0] == tail.hi[0, 0] == 0  # frame 0 and the tail frame share a strip
    assert dispatch.key_window.shape == (tail.num_blocks, tail.num_blocks)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sparse_forward_on_the_gpu(model) -> None:
    # fp32 on the GPU: the Triton kernel (fp32 operands multiply in full precision), the token order on the device.
    cfg, weights = model
    dev = torch.device("cuda")
    weights = {k: v.to(dev) for k, v in weights.items()}
    inputs = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in _video_inputs(cfg, image=True).items()}
    inputs["visual_rope_pos"] = tuple(t.to(dev) for t in inputs["visual_rope_pos"])
    dense = K6DiT(cfg, weights, backend=SwitchedBackend(Options(), dev))(**inputs)
    for density, bound in ((1.0, 1e-4), (0.5, None)):
        backend = SwitchedBackend(Options().replace(sparse_attn=density), dev)
        out = K6DiT(cfg, weights, backend=backend)(**inputs)
        assert backend.attn.counts[("sparse", "video_self")] == 4 and torch.isfinite(out[0]).all()
        rel = _rel(out[0], dense[0])
        assert rel < bound if bound else rel > 1e-3, (density, rel)
