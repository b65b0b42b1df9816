"""Lumina-Image 2.0 transformer configs at real size (the published Alpha-VLLM/Lumina-Image-2.0
transformer folder, 2.61B parameters), for benchmarks with random weights: no download needed.
The tiny one is the test model's (`dpipe.models.lumina2.tiny` builds it)."""

# The tiny test model's sizes (dpipe.models.lumina2.tiny writes it).
LATENT_CHANNELS = 4
DIM = 48
TEXT_DIM = 32  # Gemma hidden size = the transformer's cap_feat_dim (2304 for Gemma-2 2B)

LUMINA2_2B = {
    "_class_name": "Lumina2Transformer2DModel",
    "axes_dim_rope": [32, 32, 32],
    "axes_lens": [300, 512, 512],
    "cap_feat_dim": 2304,  # Gemma-2-2B's hidden size
    "ffn_dim_multiplier": None,
    "hidden_size": 2304,
    "in_channels": 16,
    "multiple_of": 256,
    "norm_eps": 1e-05,
    "num_attention_heads": 24,
    "num_kv_heads": 8,
    "num_layers": 26,
    "num_refiner_layers": 2,
    "out_channels": None,
    "patch_size": 2,
    "sample_size": 128,
    "scaling_factor": 1.0,
}

LUMINA2_TINY = {
    **LUMINA2_2B, "axes_dim_rope": [8, 8, 8],  # sums to the head dim 24
    "cap_feat_dim": TEXT_DIM, "hidden_size": DIM, "in_channels": LATENT_CHANNELS,
    "multiple_of": 16, "num_attention_heads": 2, "num_kv_heads": 1, "num_layers": 2,
    "sample_size": 8,
}

SIZES = {"2b": LUMINA2_2B, "tiny": LUMINA2_TINY}
# Per-sample shapes. 2b: a 1024x1024 image (16-channel latents at 1/8 scale: 4096 tokens after
# 2x2 patches) and Gemma text padded to 256 tokens (model.max_text_tokens), the first
# `text_tokens` of them real (the pipeline's system prompt and a prompt of about 80 words).
SAMPLE_SHAPES = {
    "2b": {"latents": (16, 128, 128), "cap": (256, 2304), "text_tokens": 128},
    "tiny": {"latents": (LATENT_CHANNELS, 8, 8), "cap": (24, TEXT_DIM), "text_tokens": 10},
}
