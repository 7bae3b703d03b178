"""The Kandinsky 6 release's constants, in one table, for the checkpoint factories and the tests that need them.

What the released checkpoints' configs say (the Pro and Lite transformers, their schedulers and audio VAEs): the
synthetic checkpoints copy them whole, the tiny one keeps everything but the widths. The runtime itself never reads
this module: it takes every figure from the checkpoint it loads.
"""

from __future__ import annotations

from typing import Any

# Transformer widths and depths of the released sizes (Diffusers `Kandinsky6Transformer3DModel` config keys).
SIZES: dict[str, dict[str, Any]] = {
    "pro": dict(
        model_dim=4096, ff_dim=16384, time_dim=1024, num_text_blocks=4, num_visual_blocks=60,
        axes_dims=(32, 48, 48), model_dim_a=2048, ff_dim_a=7168, time_dim_a=1024,
    ),
    "lite": dict(
        model_dim=1792, ff_dim=7168, time_dim=512, num_text_blocks=2, num_visual_blocks=32,
        axes_dims=(16, 24, 24), model_dim_a=896, ff_dim_a=3584, time_dim_a=512,
    ),
}  # fmt: skip

# Transformer flags every release sets (the tiny model sets them too, so the code paths users hit run in the tests).
FLAGS: dict[str, Any] = {
    "patch_size": (1, 2, 2),
    "audio_freqs_scaling": 0.144,
    "scale_factor": (1.0, 2.0, 2.0),
    "visual_cond": True,
    "text_token_padding": True,
    "ca_rope": True,
    "cross_gates": True,
    "fix_modulation": True,
    "visual_token_type_num_embeddings": 2,
}

# The pipeline's components as model_index.json names them (class per folder), the scheduler aside: distilled
# checkpoints sample with PiFlow, base ones with flow-matching Euler. What diffusers' save_pretrained writes for the
# tiny pipeline and the synthetic factory writes by hand.
PIPELINE_COMPONENTS: dict[str, list[str]] = {
    "transformer": ["diffusers", "Kandinsky6Transformer3DModel"],
    "vae": ["diffusers", "AutoencoderKLHunyuanVideo"],
    "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
    "tokenizer": ["transformers", "Qwen2_5_VLProcessor"],
    "text_encoder_2": ["transformers", "CLIPTextModel"],
    "tokenizer_2": ["transformers", "CLIPTokenizer"],
    "audio_vae": ["diffusers", "MMAudioVAE"],
    "vocoder": ["diffusers", "MMAudioVocoder"],
}

SCHEDULERS = {"distill": "PiflowScheduler", "base": "FlowMatchEulerDiscreteScheduler"}

VIDEO_LATENT_CHANNELS = 16  # the video VAE's latent channels (in_visual_dim)
AUDIO_LATENT_CHANNELS = 40  # the audio VAE's latent channels (in_audio_dim)
QWEN_HIDDEN = 3584  # Qwen2.5-VL-7B's hidden width (in_text_dim)
CLIP_HIDDEN = 768  # CLIP ViT-L's text width (in_text_dim2)
N_GRID = 10  # PiFlow's grid: a distilled checkpoint's heads are N_GRID x the latent channels

AUDIO_SAMPLE_RATE = 44_100
AUDIO_SAMPLES_PER_LATENT = 1024

# The audio VAE's scaling factor: distilled (Pro-distill) and base (Pro) checkpoints differ.
AUDIO_VAE_SCALING = {"distill": 0.417, "base": 0.5302}

# Scheduler configs: distilled checkpoints sample with PiFlow, base ones with flow-matching Euler.
PIFLOW_SCHEDULER: dict[str, Any] = dict(
    num_train_timesteps=1000, shift=5.0, n_grid=N_GRID, eps=1e-6, final_step_size_scale=0.5, num_policy_substeps=128
)
FLOW_MATCH_SCHEDULER: dict[str, Any] = dict(num_train_timesteps=1000, shift=5.0)

# The released text encoders' configurations (Kandinsky 6's `text_encoder/` and `text_encoder_2/`): Qwen2.5-VL-7B-
# Instruct with its vision tower, and CLIP ViT-L/14's text model. transformers' own defaults differ (e.g. the
# vision tower's intermediate size and tokens_per_second), so every release value is stated.
QWEN_7B_TEXT: dict[str, Any] = dict(
    vocab_size=152064, hidden_size=QWEN_HIDDEN, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
    num_key_value_heads=4, hidden_act="silu", max_position_embeddings=128000, rms_norm_eps=1e-6,
    use_sliding_window=False, sliding_window=32768, max_window_layers=28, attention_dropout=0.0,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [16, 24, 24]},
)  # fmt: skip
QWEN_7B_VISION: dict[str, Any] = dict(
    depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, in_channels=3, out_hidden_size=QWEN_HIDDEN,
    patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
    tokens_per_second=2, hidden_act="silu",
)  # fmt: skip
QWEN_7B_TIE_WORD_EMBEDDINGS = False
# Qwen2.5-VL-7B-Instruct's parameter count, vision tower and lm_head included (its index's total_size is twice this).
QWEN_7B_PARAMETERS = 8_292_166_656
CLIP_L_TEXT: dict[str, Any] = dict(
    vocab_size=49408, hidden_size=CLIP_HIDDEN, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
    max_position_embeddings=77, projection_dim=CLIP_HIDDEN, hidden_act="quick_gelu", layer_norm_eps=1e-5,
)  # fmt: skip
CLIP_L_TEXT_PARAMETERS = 123_060_480
