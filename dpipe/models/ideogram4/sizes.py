"""Ideogram 4 transformer configs for benchmarks with random weights. Only the tiny test model's:
the release's transformer config is not readable offline (the class defaults, 34 blocks of
18 x 256, are diffusers', not confirmed against the checkpoint)."""

from dpipe.models.ideogram4.tiny import TAPS, TEXT_DIM, Z_DIM

IDEOGRAM4_TINY = {
    "_class_name": "Ideogram4Transformer2DModel",
    "in_channels": 4 * Z_DIM,  # 2x2 patches of the latents
    "num_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "intermediate_size": 48,
    "adaln_dim": 16,
    "llm_features_dim": TAPS * TEXT_DIM,
    "rope_theta": 5_000_000,
    "mrope_section": [4, 2, 2],  # sums to half the head dim, as (24, 20, 20) to 64
    "norm_eps": 1e-5,
}

SIZES = {"tiny": IDEOGRAM4_TINY}
# Per-sample shapes: 64x64 pixels -> 8x8 patches of 16 channels; text padded to 16 tokens, 12 real.
SAMPLE_SHAPES = {"tiny": {"latents": (4 * Z_DIM, 8, 8), "text": (16, TAPS * TEXT_DIM),
                          "valid": 12}}
