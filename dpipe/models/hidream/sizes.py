"""HiDream-I1 transformer configs at real size (the published HiDream-ai/HiDream-I1-Full folder;
Dev and Fast share it), for benchmarks with random weights: no download needed."""

# The tiny test model's sizes (dpipe.models.hidream.tiny writes it).
LATENT_CHANNELS = 16
CLIP_L, CLIP_G, T5_DIM, LLAMA_DIM = 32, 48, 32, 32
LLAMA_LAYERS = 4

HIDREAM_I1 = {
    "_class_name": "HiDreamImageTransformer2DModel",
    "attention_head_dim": 128,
    "axes_dims_rope": [64, 32, 32],
    "caption_channels": [4096, 4096],
    "in_channels": 16,
    # Which of Llama-3.1-8B's 32 hidden layers each of the 48 blocks reads.
    "llama_layers": list(range(32)) + [31] * 16,
    "max_resolution": [128, 128],
    "num_activated_experts": 2,
    "num_attention_heads": 20,
    "num_layers": 16,
    "num_routed_experts": 4,
    "num_single_layers": 32,
    "out_channels": 16,
    "patch_size": 2,
    "text_emb_dim": 2048,
}

# The tiny test model's transformer (dpipe.models.hidream.tiny builds it), for CPU smoke tests.
HIDREAM_TINY = {
    **HIDREAM_I1, "attention_head_dim": 16, "axes_dims_rope": [8, 4, 4],
    "caption_channels": [T5_DIM, LLAMA_DIM], "in_channels": LATENT_CHANNELS,
    "llama_layers": list(range(LLAMA_LAYERS)), "max_resolution": [32, 32],
    "num_attention_heads": 2, "num_layers": 2, "num_single_layers": 2,
    "out_channels": LATENT_CHANNELS, "text_emb_dim": CLIP_L + CLIP_G,
}

SIZES = {"i1": HIDREAM_I1, "tiny": HIDREAM_TINY}
# Per-sample shapes. i1: a 1024x1024 image (16-channel latents at 1/8 scale: 4096 tokens after
# 2x2 patches), T5-XXL and every Llama layer at 128 tokens (model.max_text_tokens), the two CLIPs'
# pooled 768 + 1280.
SAMPLE_SHAPES = {
    "i1": {"latents": (16, 128, 128), "t5": (128, 4096), "llama": (32, 128, 4096),
           "pooled": (2048,)},
    "tiny": {"latents": (LATENT_CHANNELS, 16, 16), "t5": (32, T5_DIM),
             "llama": (LLAMA_LAYERS, 32, LLAMA_DIM), "pooled": (CLIP_L + CLIP_G,)},
}
