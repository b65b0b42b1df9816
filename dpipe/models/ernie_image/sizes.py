"""ERNIE-Image transformer configs for benchmarks with random weights."""

from dpipe.models.ernie_image.tiny import LATENT_CHANNELS, TEXT_DIM

ERNIE_IMAGE_TINY = {
    "_class_name": "ErnieImageTransformer2DModel",
    "hidden_size": 32,
    "num_attention_heads": 2,
    "num_layers": 2,
    "ffn_hidden_size": 48,
    "in_channels": 4 * LATENT_CHANNELS,  # 2x2-patchified latents
    "out_channels": 4 * LATENT_CHANNELS,
    "patch_size": 1,
    "text_in_dim": TEXT_DIM,
    "rope_theta": 256,
    "rope_axes_dim": [4, 6, 6],  # sums to the head dim, as (32, 48, 48) sums to 128
    "eps": 1e-6,
    "qk_layernorm": True,
}

SIZES = {"tiny": ERNIE_IMAGE_TINY}
# Per-sample shapes: 64x64 pixels -> 8x8 patchified latents; text padded to 16 tokens, 12 real.
SAMPLE_SHAPES = {"tiny": {"latents": (4 * LATENT_CHANNELS, 8, 8), "text": (16, TEXT_DIM),
                          "valid": 12}}
