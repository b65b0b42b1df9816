"""Z-Image transformer configs at real size (the published Tongyi-MAI/Z-Image-Turbo transformer
folder, 6.15B parameters; the base Z-Image shares it), for benchmarks with random weights: no
download needed. The tiny one is the test model's (`dpipe.models.z_image.tiny` builds it)."""

# The tiny test model's sizes (dpipe.models.z_image.tiny writes it).
LATENT_CHANNELS = 4
DIM = 32  # transformer width
TEXT_DIM = 32  # Qwen3 hidden size = the transformer's cap_feat_dim (2560 for Qwen3-4B)

Z_IMAGE_6B = {
    "_class_name": "ZImageTransformer2DModel",
    "all_f_patch_size": [1],
    "all_patch_size": [2],
    "axes_dims": [32, 48, 48],
    "axes_lens": [1536, 512, 512],
    "cap_feat_dim": 2560,  # Qwen3-4B's hidden size
    "dim": 3840,
    "in_channels": 16,
    "n_heads": 30,
    "n_kv_heads": 30,
    "n_layers": 30,
    "n_refiner_layers": 2,
    "norm_eps": 1e-05,
    "qk_norm": True,
    "rope_theta": 256.0,
    "t_scale": 1000.0,
}

Z_IMAGE_TINY = {
    **Z_IMAGE_6B, "axes_dims": [4, 6, 6],  # sums to the head dim 16, as [32, 48, 48] to 128
    "cap_feat_dim": TEXT_DIM, "dim": DIM, "in_channels": LATENT_CHANNELS, "n_heads": 2,
    "n_kv_heads": 2, "n_layers": 2,
}

SIZES = {"6b": Z_IMAGE_6B, "tiny": Z_IMAGE_TINY}
# Per-sample shapes. 6b: a 1024x1024 image (16-channel latents at 1/8 scale: 4096 tokens after
# 2x2 patches) and Qwen3 text padded to 512 tokens (model.max_text_tokens), the first
# `text_tokens` of them real (the chat template and a prompt of about 100 words). tiny: 48 image
# tokens, padded to 64 as diffusers pads them, so that its pad token trains too.
SAMPLE_SHAPES = {
    "6b": {"latents": (16, 128, 128), "cap": (512, 2560), "text_tokens": 128},
    "tiny": {"latents": (LATENT_CHANNELS, 12, 16), "cap": (40, TEXT_DIM), "text_tokens": 12},
}
