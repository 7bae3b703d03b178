"""The DiT's two block types as functions of (weights, activations): a text block and a fused video/audio block.

A block is a self-contained unit: everything it reads comes in through its weight mapping (names relative to the
block) and its arguments, so the caller may hand it resident, streamed or quantized weights alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .backend import Backend
from .config import DiTConfig
from .ops import Weights, attention, feed_forward, modulation

Rope = tuple[Tensor, Tensor]


def text_block(
    backend: Backend, w: Weights, x: Tensor, temb: Tensor, rope: Rope, mask: Tensor | None, num_heads: int
) -> Tensor:
    """Text self-attention + feed-forward with AdaLN. x: [B, S, D]; temb: fp32 [B, time_dim]; mask: bool [B, S]."""
    sa, ff = modulation(backend, w, "text_modulation.out_layer", temb).chunk(2, dim=-1)
    shift, scale, gate = sa.chunk(3, dim=-1)
    h = backend.modulate(x, scale, shift)
    out = attention(backend, w, "attn", h, None, num_heads, site="text_self", rope_q=rope, rope_k=rope, mask=mask)
    ff_shift, ff_scale, ff_gate = ff.chunk(3, dim=-1)
    x, h = backend.gated_add_modulate(x, out, gate, ff_scale, ff_shift)
    return backend.gated_add(x, feed_forward(backend, w, "feed_forward", h), ff_gate)


@dataclass(frozen=True)
class FusedBlockInputs:
    """What every fused block reads besides its own weights and the two residual streams."""

    text_v: Tensor  # [B, S, D] video text branch output
    text_a: Tensor  # [B, S, Da] audio text branch output
    temb_v: Tensor  # fp32 [B, time_dim]
    temb_a: Tensor  # fp32 [B, time_dim_a]
    rope_v: Rope  # video tokens, fp32 [N, head_dim // 2] each
    rope_a: Rope | None  # audio tokens
    text_mask: Tensor | None  # bool [B, S]


def fused_block(
    backend: Backend, cfg: DiTConfig, w: Weights, vis: Tensor, aud: Tensor | None, inp: FusedBlockInputs
) -> tuple[Tensor, Tensor | None]:
    """One fused block. vis: [B, N, D]; aud: [B, L, Da] or None (video only). Returns the updated streams.

    Order of operations follows the reference exactly: video self-attention, video←text (held back), audio
    self-attention and audio←text, then the two cross-modal attentions, which read the *pre-text-attention*
    normalised streams of the other modality as keys/values, then the feed-forwards. Each residual update that the
    reference follows with a modulation of the same stream goes through `backend.gated_add_modulate` (one pass on
    the fused backend; the same two steps on the reference one)."""
    heads_v, heads_a = cfg.model_dim // cfg.head_dim, cfg.model_dim_a // cfg.head_dim_a
    vw, aw = "video_dec_block", "audio_dec_block"

    sa_p, ca_p, ff_p = modulation(backend, w, f"{vw}.visual_modulation.out_layer", inp.temb_v).chunk(3, dim=-1)
    shift, scale, gate = sa_p.chunk(3, dim=-1)
    h = backend.modulate(vis, scale, shift)
    out = attention(
        backend, w, f"{vw}.self_attention", h, None, heads_v, site="video_self", rope_q=inp.rope_v, rope_k=inp.rope_v
    )
    shift, scale, gate_v = ca_p.chunk(3, dim=-1)
    vis, vis_pre_ca = backend.gated_add_modulate(vis, out, gate, scale, shift)
    vis_from_text = attention(
        backend, w, f"{vw}.cross_attention", vis_pre_ca, inp.text_v, heads_v, site="video_text", mask=inp.text_mask
    )
    ff_shift, ff_scale, ff_gate = ff_p.chunk(3, dim=-1)

    if aud is None:
        vis, vis_for_ff = backend.gated_add_modulate(vis, vis_from_text, gate_v, ff_scale, ff_shift)
    else:
        sa_p, ca_p, ff_p_a = modulation(backend, w, f"{aw}.visual_modulation.out_layer", inp.temb_a).chunk(3, dim=-1)
        shift, scale, gate = sa_p.chunk(3, dim=-1)
        h = backend.modulate(aud, scale, shift)
        out = attention(
            backend,
            w,
            f"{aw}.self_attention",
            h,
            None,
            heads_a,
            site="audio_self",
            rope_q=inp.rope_a,
            rope_k=inp.rope_a,
        )
        shift, scale, gate_a = ca_p.chunk(3, dim=-1)
        aud, aud_pre_ca = backend.gated_add_modulate(aud, out, gate, scale, shift)
        aud_from_text = attention(
            backend, w, f"{aw}.cross_attention", aud_pre_ca, inp.text_a, heads_a, site="audio_text", mask=inp.text_mask
        )

        # fix_modulation: each cross-modal modulation reads its own modality's time embedding.
        t_va, t_av = (inp.temb_v, inp.temb_a) if cfg.fix_modulation else (inp.temb_a, inp.temb_v)
        va_params = modulation(backend, w, "va_modulation.out_layer", t_va)
        av_params = modulation(backend, w, "av_modulation.out_layer", t_av)
        if cfg.cross_gates:
            va_shift, va_scale, va_gate = va_params.split([cfg.model_dim, cfg.model_dim, cfg.model_dim_a], dim=-1)
            av_shift, av_scale, av_gate = av_params.split([cfg.model_dim_a, cfg.model_dim_a, cfg.model_dim], dim=-1)
            # With cross gates each modulation carries the *other* stream's gate.
            gate_into_vis, gate_into_aud = av_gate, va_gate
        else:
            va_shift, va_scale, va_gate = va_params.chunk(3, dim=-1)
            av_shift, av_scale, av_gate = av_params.chunk(3, dim=-1)
            gate_into_vis, gate_into_aud = va_gate, av_gate
        # The text residuals wait for the cross-modal modulations they are fused with (independent work, same values).
        vis, vis_for_va = backend.gated_add_modulate(vis, vis_from_text, gate_v, va_scale, va_shift)
        aud, aud_for_av = backend.gated_add_modulate(aud, aud_from_text, gate_a, av_scale, av_shift)
        rope_v, rope_a = (inp.rope_v, inp.rope_a) if cfg.ca_rope else (None, None)
        vis_from_aud = attention(
            backend,
            w,
            "va_cross_attention",
            vis_for_va,
            aud_pre_ca,
            heads_v,
            site="video_audio",
            rope_q=rope_v,
            rope_k=rope_a,
        )
        aud_from_vis = attention(
            backend,
            w,
            "av_cross_attention",
            aud_for_av,
            vis_pre_ca,
            heads_a,
            site="audio_video",
            rope_q=rope_a,
            rope_k=rope_v,
        )
        vis, vis_for_ff = backend.gated_add_modulate(vis, vis_from_aud, gate_into_vis, ff_scale, ff_shift)
        ff_shift_a, ff_scale_a, ff_gate_a = ff_p_a.chunk(3, dim=-1)
        aud, aud_for_ff = backend.gated_add_modulate(aud, aud_from_vis, gate_into_aud, ff_scale_a, ff_shift_a)

    # The FFN's 4x-wide hidden state is the block's memory peak: drop the video-sized intermediates first (eager runs
    # would otherwise hold them to the end; a compiled block frees by last use anyway). With audio, h and out are
    # audio-sized.
    del h, out, vis_pre_ca, vis_from_text
    if aud is not None:
        del vis_for_va, vis_from_aud
    vis = backend.gated_add(vis, feed_forward(backend, w, f"{vw}.feed_forward", vis_for_ff), ff_gate)
    if aud is not None:
        aud = backend.gated_add(aud, feed_forward(backend, w, f"{aw}.feed_forward", aud_for_ff), ff_gate_a)
    return vis, aud
