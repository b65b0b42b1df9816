"""OmniGen2 transformer configs at real size, for benchmarks with random weights: no download.

"4b" is the transformer of OmniGen2/OmniGen2 (3.97B parameters), its fields as the reference's
training options (VectorSpaceLab/OmniGen2 options/ft.yml `model.arch_opt`, commit 0f72fa9) give
them: hidden 2520, 32 layers, 2 refiner layers, 21 heads of 120 (7 key/value heads), RoPE axes
(40, 40, 40), text features 2048 (Qwen2.5-VL-3B's hidden size), timestep_scale 1000. The tiny one
is the test model's (`dpipe.models.omnigen2.tiny` builds it)."""

LATENT_CHANNELS = 4  # the tiny VAE's (16 in the real one)
DIM = 48  # the tiny transformer's width
TEXT_DIM = 32  # the tiny Qwen2.5-VL's hidden size = text_feat_dim (2048 for the 3B)

OMNIGEN2_4B = {
    "_class_name": "OmniGen2Transformer2DModel",
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": None,
    "hidden_size": 2520,
    "num_layers": 32,
    "num_refiner_layers": 2,
    "num_attention_heads": 21,
    "num_kv_heads": 7,
    "multiple_of": 256,
    "ffn_dim_multiplier": None,
    "norm_eps": 1e-05,
    "axes_dim_rope": [40, 40, 40],
    "axes_lens": [10000, 10000, 10000],
    "text_feat_dim": 2048,
    "timestep_scale": 1000.0,
}

OMNIGEN2_TINY = {
    **OMNIGEN2_4B, "hidden_size": DIM, "in_channels": LATENT_CHANNELS, "num_layers": 2,
    "num_refiner_layers": 1, "num_attention_heads": 2, "num_kv_heads": 1, "multiple_of": 16,
    "axes_dim_rope": [8, 8, 8], "axes_lens": [1024, 64, 64], "text_feat_dim": TEXT_DIM,
}

SIZES = {"4b": OMNIGEN2_4B, "tiny": OMNIGEN2_TINY}
# Per-sample shapes. 4b: a 1024x1024 image (16-channel latents at 1/8 scale: 4096 tokens after
# 2x2 patches) and Qwen2.5-VL text padded to 256 tokens (model.max_text_tokens), the first
# `text_tokens` of them real (the chat template's system turn and a prompt of about 80 words).
SAMPLE_SHAPES = {
    "4b": {"latents": (16, 128, 128), "cap": (256, 2048), "text_tokens": 128},
    "tiny": {"latents": (LATENT_CHANNELS, 8, 8), "cap": (24, TEXT_DIM), "text_tokens": 10},
}
