"""Video VAE decode (diffusers' HunyuanVideo VAE) without the redundant work of diffusers' tiled decode.

What in the decoder is local in time, and what is not (diffusers 0.42.1, `autoencoder_kl_hunyuan_video.py`):
- Every convolution is causal: replicate-padded by kt-1 frames in front, so output frame t reads input frames
  t-2..t. Carrying the last kt-1 input frames of each convolution from one chunk of frames to the next reproduces
  the whole-clip convolution exactly.
- The upsamplers repeat frames (nearest); the clip's first frame is upsampled in space only. Exact per chunk once a
  chunk knows whether it holds the clip's first frame.
- The mid-block attention is causal by frame (a token attends to its own frame and earlier frames) but global in
  space; it runs at latent resolution, so it is computed over the whole clip, query frame by query frame.
- Every GroupNorm (30 in the default decoder, the attention's included) normalises over the WHOLE clip: all frames,
  all positions. So no chunked or tiled decode equals the untiled one unless every GroupNorm sees whole-clip
  statistics; decoding the first 3 latent frames alone gives other pixels than the first 9 frames of the whole
  decode. diffusers' tiled decode gives each tile its own statistics (17 frames x 256x256 px), and so does its
  framewise decode, which is on even with tiling off (`use_framewise_decoding`): `vae.disable_tiling()` alone is
  not an untiled decode.

The decode here runs the decoder's modules (diffusers' weights, no copies) as a list of ops in two segments:
- ops[:split] over the whole clip at once, layer by layer: exact (whole-clip statistics). Each GroupNorm's
  statistics are reduced first (fp32 per channel over blocks of frames or rows, merged in fp64), then the
  normalisation + SiLU is applied chunk of frames by chunk straight into the next convolution's padded input; a
  resnet writes conv2 + shortcut over conv1's output as conv2 consumes it. So an op holds its input and its output
  (a resnet: its input and conv1's output) plus chunk temporaries. The mid-block attention (and all before it) is
  always in this segment.
- ops[split:] streamed: in slabs of `slab_latent_frames` latent frames that carry each convolution's last input
  frames, layer by layer within a slab over the full frame, or over budget-sized spatial tiles (each an independent
  stream; blended across the middle of their overlap, outside the convolutions' reach of the tile edge).
  Within a stream a GroupNorm uses running statistics: those of all frames decoded so far, this slab's included.
When the streamed segment is a single slab and a single tile (the budget holds the whole decode), the result equals
diffusers' untiled decode up to float rounding; otherwise only the GroupNorm statistics differ from it.

The lean whole-clip decode (`UpsampleFusion`): the largest tensor of a whole-clip decode is an upsampler's output U
at full resolution (256 channels x 121 x 480 x 864 at W1, 25.7 GB in bf16), which only the next resnet reads (its
norm1 + conv1 and its 256 → 128 shortcut). Fused, that pair never stores U: pass 1 computes U chunk by chunk for
norm1's whole-clip statistics and drops it; pass 2 computes it again and feeds silu(norm1(U)) to conv1 and U to the
shortcut, chunk by chunk (the upsampler's causal conv re-upsamples its kt-1 frames of history from its input
instead of carrying them). The shortcut's output is stored ("stored"), or recomputed from U a third time next to
conv2 ("recomputed": one more upsampler conv, one fewer full-size tensor). Same arithmetic, so still exact.
`plan_video_decode` picks the plain whole-clip decode if it fits the budget, else fuses the pair at the peak
(stored, then recomputed) until it fits; else the latest split, then the largest slab, then the fewest tiles.
At W1 in bf16 the plain whole-clip decode is planned at 41.3 GiB (36.9 GiB of activations); the lean one fits a
32 GiB budget with the shortcut stored (31.4 GiB planned, 28.3 GiB of activations) and a 28 GiB one with it
recomputed (27.7 GiB planned). Planned peaks include the fp32 output and 8% of the budget for cuDNN and rounding.

Modules: `decoder` (the decoder as ops and their geometry), `plan` (`plan_video_decode`, `VideoDecodePlan` and
the memory estimates behind them), `norm_stats` (GroupNorm statistics, whole-clip and running), `run_ops` (the ops
over a slab of frames in chunks, and the fused upsampler + resnet), `decode` (`decode_video_fast`: the whole-clip
ops, then the streamed slabs and tiles).

Check: `pytest tests/test_video_decode.py`. Benchmark: `python measurements/bench_vae_decode.py --out vae.json`.
"""

from .decode import LAYOUTS, decode_video_fast, decode_with_plan
from .decoder import decoder_geometry, decoder_ops
from .plan import UPSAMPLE_FUSION, UpsampleFusion, VideoDecodePlan, plan_video_decode, whole_clip_peak

__all__ = [
    "LAYOUTS",
    "UPSAMPLE_FUSION",
    "UpsampleFusion",
    "VideoDecodePlan",
    "decode_video_fast",
    "decode_with_plan",
    "decoder_geometry",
    "decoder_ops",
    "plan_video_decode",
    "whole_clip_peak",
]
