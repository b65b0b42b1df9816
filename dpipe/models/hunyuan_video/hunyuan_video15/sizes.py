"""HunyuanVideo 1.5 transformer configs at real size (the published 480p text-to-video transformer
folder of hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v, 8.33B parameters), for
benchmarks with random weights: no download needed. `target_size` and `task_type` inform only
the pipeline. The tiny one is the test model's (`dpipe.models.hunyuan_video.hunyuan_video15.tiny` builds it)."""

# The tiny test model's sizes (its real counterparts in brackets).
LATENT_CHANNELS = 4
TEXT_DIM = 32  # Qwen2.5-VL hidden size (text_embed_dim; 3584 for the 7B)
BYT5_DIM = 24  # ByT5 d_model (text_embed_2_dim; 1472 for Glyph-SDXL-v2's byt5-small)
IMAGE_DIM = 16  # SigLIP width (image_embed_dim; 1152): unused by text-to-video, part of the model

HUNYUAN_VIDEO15_8B = {
    "_class_name": "HunyuanVideo15Transformer3DModel",
    "attention_head_dim": 128,
    "image_embed_dim": 1152,  # SigLIP's width
    "in_channels": 65,  # noisy latents, condition latents and the condition mask
    "mlp_ratio": 4.0,
    "num_attention_heads": 16,
    "num_layers": 54,
    "num_refiner_layers": 2,
    "out_channels": 32,
    "patch_size": 1,
    "patch_size_t": 1,
    "qk_norm": "rms_norm",
    "rope_axes_dim": [16, 56, 56],
    "rope_theta": 256.0,
    "target_size": 480,
    "task_type": "t2v",
    "text_embed_2_dim": 1472,  # Glyph-SDXL-v2's ByT5
    "text_embed_dim": 3584,  # Qwen2.5-VL-7B's hidden size
    "use_meanflow": False,
}

HUNYUAN_VIDEO15_TINY = {
    **HUNYUAN_VIDEO15_8B, "attention_head_dim": 16, "image_embed_dim": IMAGE_DIM,
    "in_channels": 2 * LATENT_CHANNELS + 1, "num_attention_heads": 2, "num_layers": 4,
    "num_refiner_layers": 1, "out_channels": LATENT_CHANNELS, "rope_axes_dim": [4, 6, 6],
    "target_size": 64, "text_embed_2_dim": BYT5_DIM, "text_embed_dim": TEXT_DIM,
}

SIZES = {"8b": HUNYUAN_VIDEO15_8B, "tiny": HUNYUAN_VIDEO15_TINY}
# Per-sample shapes. 8b: a 33-frame 480x832 clip (32-channel latents, 4x temporal and 16x spatial
# compression: 9 x 30 x 52, 14040 tokens), Qwen2.5-VL text padded to 1000 tokens
# (model.max_text_tokens), the first `text_tokens` of them real, and ByT5's 256 glyph tokens,
# none real (a prompt without quoted text).
SAMPLE_SHAPES = {
    "8b": {"latents": (32, 9, 30, 52), "qwen": (1000, 3584), "text_tokens": 128,
           "byt5": (256, 1472)},
    "tiny": {"latents": (LATENT_CHANNELS, 3, 8, 8), "qwen": (24, TEXT_DIM), "text_tokens": 10,
             "byt5": (8, BYT5_DIM)},
}
