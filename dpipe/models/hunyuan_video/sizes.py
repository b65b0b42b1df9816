"""HunyuanVideo transformer configs at real size (the published hunyuanvideo-community/HunyuanVideo
transformer folder), for benchmarks with random weights: no download needed."""

HUNYUAN_VIDEO_13B = {
    "_class_name": "HunyuanVideoTransformer3DModel",
    "attention_head_dim": 128,
    "guidance_embeds": True,
    "in_channels": 16,
    "mlp_ratio": 4.0,
    "num_attention_heads": 24,
    "num_layers": 20,
    "num_refiner_layers": 2,
    "num_single_layers": 40,
    "out_channels": 16,
    "patch_size": 2,
    "patch_size_t": 1,
    "pooled_projection_dim": 768,
    "qk_norm": "rms_norm",
    "rope_axes_dim": [16, 56, 56],
    "rope_theta": 256.0,
    "text_embed_dim": 4096,
}

# The tiny test model's transformer (dpipe.models.hunyuan_video.tiny builds it), for CPU smoke
# tests.
HUNYUAN_VIDEO_TINY = {
    **HUNYUAN_VIDEO_13B, "attention_head_dim": 16, "in_channels": 4, "num_attention_heads": 2,
    "num_layers": 2, "num_refiner_layers": 1, "num_single_layers": 2, "out_channels": 4,
    "pooled_projection_dim": 32,
    "rope_axes_dim": [4, 6, 6],  # sums to attention_head_dim, as (16, 56, 56) sums to 128
    "text_embed_dim": 32,
}

SIZES = {"13b": HUNYUAN_VIDEO_13B, "tiny": HUNYUAN_VIDEO_TINY}
# Per-sample shapes. 13b: a 33-frame 512x512 clip (16-channel latents, 4x temporal and 8x spatial
# compression: 9 x 64 x 64, 9216 tokens after 2x2 patches) and LLaMA text padded to 256 tokens
# (model.max_text_tokens), the first `text_tokens` of them real; CLIP's pooled 768.
SAMPLE_SHAPES = {
    "13b": {"latents": (16, 9, 64, 64), "llama": (256, 4096), "text_tokens": 96, "pooled": (768,)},
    "tiny": {"latents": (4, 3, 8, 8), "llama": (16, 32), "text_tokens": 10, "pooled": (32,)},
}
