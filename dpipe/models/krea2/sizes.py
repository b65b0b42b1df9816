"""Krea 2 transformer configs for benchmarks with random weights. Only the tiny test model's:
diffusers 0.42.1 ships no published Krea 2 transformer config (its docs say the converted
checkpoint has no hub repo yet), and the class defaults are not confirmed to be the release's."""

from dpipe.models.krea2.tiny import NUM_TEXT_LAYERS, TEXT_DIM, Z_DIM

KREA2_TINY = {
    "_class_name": "Krea2Transformer2DModel",
    "in_channels": 4 * Z_DIM,  # 2x2 patches of the latents
    "num_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,  # grouped-query attention, as the real 48 heads over 12
    "intermediate_size": 48,
    "timestep_embed_dim": 32,
    "text_hidden_dim": TEXT_DIM,
    "num_text_layers": NUM_TEXT_LAYERS,
    "text_num_attention_heads": 2,
    "text_num_key_value_heads": 2,
    "text_intermediate_size": 48,
    "num_layerwise_text_blocks": 2,
    "num_refiner_text_blocks": 2,
    "axes_dims_rope": [4, 6, 6],  # sums to the head dim, as (32, 48, 48) sums to 128
    "rope_theta": 1000.0,
    "norm_eps": 1e-5,
}

SIZES = {"tiny": KREA2_TINY}
# Per-sample shapes: 64x64 pixels -> 16x16 latents; text padded to 16 tokens, 12 of them real.
SAMPLE_SHAPES = {
    "tiny": {"latents": (Z_DIM, 16, 16), "text": (16, NUM_TEXT_LAYERS, TEXT_DIM), "valid": 12},
}
