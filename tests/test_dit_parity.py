"""k6fast's DiT forward against diffusers' Kandinsky6Transformer3DModel, float32 on CPU: max relative error ≤ 1e-5
for video and audio, with/without audio, image tail frame, and text padding mask. And the switch-configured backend
against the reference one: bit-identical with every switch off, and with the fused elementwise ops routed through
their public kernels' entry points (which run their references on the CPU)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from diffusers import Kandinsky6Transformer3DModel

from k6fast.dit.backend import SwitchedBackend
from k6fast.dit.config import DiTConfig, expected_shapes
from k6fast.dit.model import K6DiT
from k6fast.kernels import adaln, gelu
from k6fast.switches import Options

TINY = dict(
    in_visual_dim=4,
    out_visual_dim=40,
    in_text_dim=24,
    in_text_dim2=20,
    time_dim=16,
    model_dim=32,
    ff_dim=64,
    num_text_blocks=2,
    num_visual_blocks=2,
    axes_dims=(4, 6, 6),
    in_audio_dim=6,
    out_audio_dim=60,
    model_dim_a=32,
    time_dim_a=16,
    ff_dim_a=48,
    audio_freqs_scaling=0.144,
    ca_rope=True,
    cross_gates=True,
    fix_modulation=True,
    text_token_padding=True,
    visual_token_type_num_embeddings=2,
)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    # Default inits leave some layers at zero (e.g. gates); random values exercise every path.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _pair(seed: int = 0, **overrides):
    config = {**TINY, **overrides}
    ref = Kandinsky6Transformer3DModel(**config).eval()
    _randomize(ref, seed)
    state = dict(ref.state_dict())
    ours = K6DiT(DiTConfig.from_dict(dict(ref.config)), state)
    return ref, ours


def _inputs(cfg: DiTConfig, *, audio: bool, image: bool, masked: bool, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    t, h, w, s, length = 3, 4, 6, 7, 5
    frames = t + 1 if image else t
    kwargs = dict(
        hidden_states=torch.randn(1, frames, h, w, cfg.visual_in_channels, generator=g),
        encoder_hidden_states=torch.randn(1, s, cfg.in_text_dim, generator=g),
        pooled_projections=torch.randn(1, cfg.in_text_dim2, generator=g),
        timestep=torch.tensor([731.5]),
        audio_hidden_states=torch.randn(1, length, cfg.in_audio_dim, generator=g) if audio else None,
    )
    if image:
        kwargs["visual_token_type_ids"] = torch.tensor([[0] * t + [1]])
        kwargs["visual_rope_pos"] = (
            torch.cat([torch.arange(t), torch.zeros(1, dtype=torch.long)]),
            torch.arange(h // 2),
            torch.arange(w // 2),
        )
    if masked:
        kwargs["encoder_attention_mask"] = torch.tensor([[True] * (s - 3) + [False] * 3])
    return kwargs


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("audio", [True, False])
@pytest.mark.parametrize("image", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_forward_matches_diffusers(audio: bool, image: bool, masked: bool) -> None:
    ref, ours = _pair()
    kwargs = _inputs(ours.cfg, audio=audio, image=image, masked=masked)
    with torch.no_grad():
        expected = ref(**kwargs, return_dict=False)
    video, audio_out = ours(**kwargs)
    assert video.shape == expected[0].shape
    assert _rel(video, expected[0]) <= 1e-5
    if audio:
        assert audio_out is not None and audio_out.shape == expected[1].shape
        assert _rel(audio_out, expected[1]) <= 1e-5
    else:
        assert audio_out is None and len(expected) == 1


@pytest.mark.parametrize("flags", [dict(cross_gates=False, fix_modulation=False, ca_rope=False)])
def test_forward_matches_diffusers_without_pro_flags(flags: dict) -> None:
    ref, ours = _pair(seed=3, **flags)
    kwargs = _inputs(ours.cfg, audio=True, image=False, masked=False)
    with torch.no_grad():
        expected = ref(**kwargs, return_dict=False)
    video, audio_out = ours(**kwargs)
    assert _rel(video, expected[0]) <= 1e-5
    assert _rel(audio_out, expected[1]) <= 1e-5


@pytest.mark.parametrize("audio", [True, False])
def test_switched_backend_equals_exact_backend(audio: bool, monkeypatch) -> None:
    _, ours = _pair()
    kwargs = _inputs(ours.cfg, audio=audio, image=False, masked=True)
    expected = ours(**kwargs)  # ExactBackend
    cpu = torch.device("cpu")

    def run(options: Options) -> tuple[torch.Tensor, torch.Tensor | None]:
        return K6DiT(ours.cfg, ours.weights, backend=SwitchedBackend(options, cpu))(**kwargs)

    results = {"switches off": run(Options())}
    # Fused on, with the fused kernels taken as for CUDA tensors: every pair of a residual and the modulation after
    # it, and every GELU, goes through the kernels' public ops (their CPU path is the reference).
    calls = Counter()

    def counted(module, name):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **kw: calls.update([name]) or original(*a, **kw))

    counted(adaln, "gated_residual_modulate")
    counted(gelu, "gelu")
    monkeypatch.setattr(SwitchedBackend, "fused_for", lambda self, t: self.fused)
    results["fused"] = run(Options().replace(fused_elementwise=True))
    for name, (video, audio_out) in results.items():
        assert torch.equal(video, expected[0]), name
        assert (audio_out is None) if not audio else torch.equal(audio_out, expected[1]), name
    # Two text branches (video, audio) of text blocks, one pair and one GELU each. A fused block: video
    # self-attention → text → (audio: → video←audio) → FFN modulation, the same on the audio stream; one GELU each.
    text, fused = 2 * ours.cfg.num_text_blocks, ours.cfg.num_visual_blocks
    assert calls == {
        "gated_residual_modulate": text + fused * (6 if audio else 2),
        "gelu": text + fused * (2 if audio else 1),
    }


def test_mask_changes_output() -> None:
    # Guards the parity test against a mask that is silently ignored on both sides.
    _, ours = _pair()
    plain = ours(**_inputs(ours.cfg, audio=True, image=False, masked=False))[0]
    masked = ours(**_inputs(ours.cfg, audio=True, image=False, masked=True))[0]
    assert (plain - masked).abs().max() > 1e-4


def test_expected_shapes_match_diffusers_state_dict() -> None:
    ref, ours = _pair()
    actual = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert expected_shapes(ours.cfg) == actual


def test_wrong_input_channels_is_a_clear_error() -> None:
    _, ours = _pair()
    kwargs = _inputs(ours.cfg, audio=False, image=False, masked=False)
    kwargs["hidden_states"] = kwargs["hidden_states"][..., :-1]
    with pytest.raises(ValueError, match="channels"):
        ours(**kwargs)
