"""k6fast's own Kandinsky 6 DiT forward: embeddings, text blocks, fused video/audio blocks, output heads.

Numerically it follows diffusers' `Kandinsky6Transformer3DModel` (checked to 1e-5 relative in fp32 by the parity
tests); it differs in what it is made of: plain functions over a weight mapping, so the runtime can stream, fuse and
quantize blocks without touching the maths.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from ..cancel import StopCheck, check_stop
from .backend import Backend, ExactBackend
from .blocks import FusedBlockInputs, fused_block, text_block
from .config import DiTConfig, block_prefix, video_gemm_shapes
from .ops import linear, modulation, text_embedding, time_embedding
from .rope import rope_1d, rope_3d
from .weights import PrefixView


class BlockSource(Protocol):
    """Where fused blocks' weights come from. `get(i)` before block i runs returns its weights (relative names);
    `release(i)` after its compute was issued lets the source reuse the memory. Resident sources return views;
    the streaming runtime returns the device slot the block was copied into."""

    def begin_forward(self) -> None: ...

    def get(self, block: int) -> Mapping[str, Tensor]: ...

    def release(self, block: int) -> None: ...

    def abort_forward(self) -> None:
        """The forward raised inside a block: drop whatever per-forward state `get` left behind."""
        ...


class ResidentBlocks:
    """Every fused block already on the device, addressed in the full weight mapping."""

    def __init__(self, weights: Mapping[str, Tensor]):
        self.weights = weights

    def begin_forward(self) -> None:
        return None

    def get(self, block: int) -> Mapping[str, Tensor]:
        return PrefixView(self.weights, block_prefix(block))

    def release(self, block: int) -> None:
        return None

    def abort_forward(self) -> None:
        return None


def patchify(x: Tensor, patch: tuple[int, int, int]) -> Tensor:
    """[B, T, H, W, C] → [B, T/pt, H/ph, W/pw, pt*ph*pw*C] (patch-major, channel-minor as the reference)."""
    b, t, h, w, c = x.shape
    pt, ph, pw = patch
    x = x.view(b, t // pt, pt, h // ph, ph, w // pw, pw, c).permute(0, 1, 3, 5, 2, 4, 6, 7)
    return x.flatten(4, 7)


def unpatchify(x: Tensor, patch: tuple[int, int, int]) -> Tensor:
    """[B, T', H', W', C*pt*ph*pw] (channel-major) → [B, T'*pt, H'*ph, W'*pw, C]."""
    b, t, h, w = x.shape[:4]
    pt, ph, pw = patch
    x = x.view(b, t, h, w, -1, pt, ph, pw).permute(0, 1, 5, 2, 6, 3, 7, 4)
    return x.flatten(1, 2).flatten(2, 3).flatten(3, 4)


class K6DiT:
    """The Kandinsky 6 transformer. `weights` maps full checkpoint names to tensors already on the compute device
    (modulation/time layers fp32, the rest the compute dtype); `blocks` says where fused blocks come from (default:
    `weights` itself)."""

    def __init__(
        self,
        cfg: DiTConfig,
        weights: Mapping[str, Tensor],
        backend: Backend | None = None,
        blocks: BlockSource | None = None,
    ):
        self.cfg = cfg
        self.weights = weights
        self.backend = backend or ExactBackend()
        self.blocks = blocks or ResidentBlocks(weights)
        self.dtype = weights["visual_embeddings.in_layer.weight"].dtype
        # What the forward runs for every fused block (compiled by `compile_blocks`): a caller may wrap it to count,
        # pause or stop the forward block by block.
        self.fused_block = fused_block
        self.compiled = False  # `compile_blocks` ran (a caller's wrapper around fused_block is not compiled by it)
        self.should_stop: StopCheck | None = None  # set per request by the pipeline: checked between fused blocks

    def compile_blocks(self) -> None:
        """torch.compile the fused block (one graph for all blocks: weights are inputs, not constants)."""
        self.fused_block = torch.compile(fused_block, dynamic=False)
        self.compiled = True

    def begin_step(self, step: int, num_steps: int | None = None) -> None:
        """The sampler announces each denoising step of a `num_steps` schedule (the attention policy keeps the first
        and last steps exact)."""
        self.backend.begin_step(step, num_steps)

    def _check_stop(self, block: int) -> None:
        check_stop(self.should_stop, "denoise", f"before fused block {block + 1} of {self.cfg.num_visual_blocks}")

    def _text_branch(
        self, prefix: str, text: Tensor, pooled: Tensor, timestep: Tensor, dims: tuple[int, int], mask: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """Text tokens through one modality's text branch; returns (text states [B,S,D], temb fp32 [B,time_dim])."""
        model_dim, head_dim = dims
        w, be = self.weights, self.backend
        temb = time_embedding(be, w, f"{prefix}_time_embeddings", timestep, model_dim)
        temb = temb + text_embedding(be, w, f"{prefix}_pooled_text_embeddings", pooled.float())
        x = text_embedding(be, w, f"{prefix}_text_embeddings", text.to(self.dtype))
        rope = rope_1d(torch.arange(text.shape[1], device=text.device), head_dim)
        for i in range(self.cfg.num_text_blocks):
            block = PrefixView(w, f"{prefix}_text_transformer_blocks.{i}.")
            x = text_block(be, block, x, temb, rope, mask, model_dim // head_dim)
        return x, temb

    @torch.no_grad()
    def __call__(
        self,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor,
        pooled_projections: Tensor,
        timestep: Tensor,
        audio_hidden_states: Tensor | None = None,
        visual_rope_pos: tuple[Tensor, Tensor, Tensor] | None = None,
        encoder_attention_mask: Tensor | None = None,
        visual_token_type_ids: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """hidden_states: [B, T, H, W, visual_in_channels]; encoder_hidden_states: [B, S, in_text_dim];
        pooled_projections: [B, in_text_dim2]; timestep: [B] on the [0, 1000] scale; audio_hidden_states:
        [B, L, in_audio_dim] or None; visual_rope_pos: per-axis positions of the patch grid (default arange);
        encoder_attention_mask: bool [B, S] or None; visual_token_type_ids: int [B, T] or None.
        Returns (video prediction [B, T, H, W, out_visual_dim], audio prediction [B, L, out_audio_dim] or None)."""
        cfg, w, be = self.cfg, self.weights, self.backend
        if visual_token_type_ids is not None and cfg.visual_token_type_num_embeddings == 0:
            raise ValueError("visual_token_type_ids were given but the checkpoint has no token type embeddings")
        if hidden_states.shape[-1] != cfg.visual_in_channels:
            raise ValueError(
                f"video input has {hidden_states.shape[-1]} channels, the transformer expects {cfg.visual_in_channels}"
            )
        device = hidden_states.device

        text_v, temb_v = self._text_branch(
            "video",
            encoder_hidden_states,
            pooled_projections,
            timestep,
            (cfg.model_dim, cfg.head_dim),
            encoder_attention_mask,
        )
        text_a, temb_a = self._text_branch(
            "audio",
            encoder_hidden_states,
            pooled_projections,
            timestep,
            (cfg.model_dim_a, cfg.head_dim_a),
            encoder_attention_mask,
        )

        vis = linear(be, w, "visual_embeddings.in_layer", patchify(hidden_states.to(self.dtype), cfg.patch_size))
        if visual_token_type_ids is not None:
            token_types = F.embedding(visual_token_type_ids, w["visual_token_type_embeddings.weight"])
            vis = vis + token_types[:, :, None, None, :]
        grid = vis.shape[1:4]
        if visual_rope_pos is None:
            visual_rope_pos = tuple(torch.arange(n, device=device) for n in grid)
        rope_v = rope_3d(visual_rope_pos, cfg.axes_dims, cfg.scale_factor)
        vis = vis.flatten(1, 3)
        # A sparse attention arm wants the video tokens in 3-D tiles. Every op but attention is per token and
        # cross-attention ignores token order, so the order changes once here (RoPE tables alike) and is undone before
        # the head; with no such arm the backend returns None and nothing moves.
        order = be.video_token_order(grid, visual_rope_pos)
        if order is not None:
            vis, rope_v = order.apply(vis, rope_v)

        aud = rope_a = None
        if audio_hidden_states is not None:
            aud = text_embedding(be, w, "audio_embeddings", audio_hidden_states.to(self.dtype))
            positions = torch.arange(audio_hidden_states.shape[1], device=device)
            rope_a = rope_1d(positions, cfg.head_dim_a, cfg.audio_freqs_scaling)

        inputs = FusedBlockInputs(text_v, text_a, temb_v, temb_a, rope_v, rope_a, encoder_attention_mask)
        if self.compiled:
            # Compiled: the prompt's token count changes with every prompt, so the compiled block takes it as a
            # symbol. Specialised, each new length compiled the block again (seconds each, with a warm cache too)
            # and past Dynamo's recompile limit a server's block would have run uncompiled.
            for tensor in (text_v, text_a, encoder_attention_mask):
                if tensor is not None:
                    torch._dynamo.maybe_mark_dynamic(tensor, 1)
        self.blocks.begin_forward()
        try:
            for i in range(cfg.num_visual_blocks):
                self._check_stop(i)
                be.begin_block(i, cfg.num_visual_blocks)
                vis, aud = self.fused_block(be, cfg, self.blocks.get(i), vis, aud, inputs)
                self.blocks.release(i)
        except BaseException:
            # The runtime outlives a failed or cancelled request (a server's next job): its block source must not
            # keep this forward's half-done bookkeeping.
            self.blocks.abort_forward()
            raise

        if order is not None:
            vis = order.undo(vis)
        video_out = self._video_head(vis.reshape(-1, *grid, vis.shape[-1]), temb_v)
        audio_out = self._audio_head(aud, temb_a) if aud is not None else None
        return video_out, audio_out

    def _video_head(self, vis: Tensor, temb: Tensor) -> Tensor:
        be, w = self.backend, self.weights
        shift, scale = modulation(be, w, "out_layer.modulation.out_layer", temb).chunk(2, dim=-1)
        x = be.modulate(vis, scale, shift)
        return unpatchify(linear(be, w, "out_layer.out_layer", x), self.cfg.patch_size)

    def _audio_head(self, aud: Tensor, temb: Tensor) -> Tensor:
        be, w = self.backend, self.weights
        shift, scale = modulation(be, w, "audio_out_layer.modulation.out_layer", temb).chunk(2, dim=-1)
        x = be.modulate(aud, scale, shift)
        # The reference audio head normalises again after the AdaLN affine (the weights were trained so).
        x = F.layer_norm(x, (x.shape[-1],), eps=1e-5)
        return linear(be, w, "audio_out_layer.out_layer", x)


def flops_per_block(cfg: DiTConfig, video_tokens: int, audio_tokens: int, text_tokens: int) -> float:
    """Approximate FLOPs of one fused block (GEMMs + attention), for TFLOP/s figures in benchmarks."""
    d, da = cfg.model_dim, cfg.model_dim_a
    # x2 for multiply-add. Per audio token: q/k/v/out of self-attention, q/out of text and cross-modal attention
    # (8 da^2), the video stream's k/v projections of it (2 da d), the feed-forward (2 da ff).
    gemm = 2 * video_tokens * sum(count * k * n for (k, n), count in video_gemm_shapes(cfg).items())
    gemm += 2 * audio_tokens * (8 * da * da + 2 * da * d + 2 * da * cfg.ff_dim_a)
    attn = 4 * video_tokens * (video_tokens + text_tokens + audio_tokens) * d
    attn += 4 * audio_tokens * (audio_tokens + text_tokens + video_tokens) * da
    return float(gemm + attn)
