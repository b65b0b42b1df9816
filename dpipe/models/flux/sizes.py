"""FLUX.1 transformer configs at real size (from the published FLUX.1-dev / schnell folders), for
benchmarks with random weights: no download needed."""

FLUX1_DEV = {
    "_class_name": "FluxTransformer2DModel",
    "attention_head_dim": 128,
    "axes_dims_rope": [16, 56, 56],
    "guidance_embeds": True,
    "in_channels": 64,
    "joint_attention_dim": 4096,
    "num_attention_heads": 24,
    "num_layers": 19,
    "num_single_layers": 38,
    "patch_size": 1,
    "pooled_projection_dim": 768,
}
FLUX1_SCHNELL = {**FLUX1_DEV, "guidance_embeds": False}

# The tiny test model's transformer (dpipe.models.flux.tiny builds it), for CPU smoke tests.
FLUX1_TINY = {
    **FLUX1_DEV, "attention_head_dim": 16,
    "axes_dims_rope": [4, 6, 6],  # sums to attention_head_dim, as (16, 56, 56) sums to 128
    "in_channels": 16,  # 2x2 patches of 4 latent channels packed per token
    "joint_attention_dim": 32, "num_attention_heads": 2, "num_layers": 2, "num_single_layers": 2,
    "pooled_projection_dim": 32,
}

SIZES = {"dev": FLUX1_DEV, "schnell": FLUX1_SCHNELL, "tiny": FLUX1_TINY}
# Per-sample shapes: at 1024x1024, 16-channel latents at 1/8 scale, T5-XXL 512 x 4096, CLIP 768.
_REAL_SHAPES = {"latents": (16, 128, 128), "t5": (512, 4096), "pooled": (768,)}
SAMPLE_SHAPES = {"dev": _REAL_SHAPES, "schnell": _REAL_SHAPES,
                 "tiny": {"latents": (4, 16, 16), "t5": (32, 32), "pooled": (32,)}}
