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
