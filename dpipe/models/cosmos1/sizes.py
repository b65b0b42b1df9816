"""Cosmos 1.0 Text2World transformer configs at real size (diffusers' convert_cosmos_to_diffusers.py
for nvidia/Cosmos-1.0-Diffusion-7B-Text2World and -14B-Text2World), for benchmarks with random
weights: no download needed."""

COSMOS1_7B = {
    "_class_name": "CosmosTransformer3DModel",
    "in_channels": 16, "out_channels": 16, "num_attention_heads": 32, "attention_head_dim": 128,
    "num_layers": 28, "mlp_ratio": 4.0, "text_embed_dim": 1024, "adaln_lora_dim": 256,
    "max_size": [128, 240, 240], "patch_size": [1, 2, 2], "rope_scale": [2.0, 1.0, 1.0],
    "concat_padding_mask": True, "extra_pos_embed_type": "learnable",
}
COSMOS1_14B = {**COSMOS1_7B, "num_attention_heads": 40, "num_layers": 36,
               "rope_scale": [2.0, 2.0, 2.0]}
# The tiny test model's transformer (dpipe.models.cosmos1.tiny), for CPU smoke tests.
COSMOS1_TINY = {**COSMOS1_7B, "num_attention_heads": 2, "attention_head_dim": 16, "num_layers": 2,
                "mlp_ratio": 2.0, "text_embed_dim": 32, "adaln_lora_dim": 8}

SIZES = {"7b": COSMOS1_7B, "14b": COSMOS1_14B, "tiny": COSMOS1_TINY}
# Per-sample shapes. 7b / 14b: a 33-frame 704x1280 clip (the pipeline's default size; 16-channel
# latents, 8x temporal and spatial compression: 5 x 88 x 160, 17600 tokens after 2x2 patches) and
# T5 states padded to 512 tokens (model.max_text_tokens).
SAMPLE_SHAPES = {
    "7b": {"latents": (16, 5, 88, 160), "t5": (512, 1024)},
    "14b": {"latents": (16, 5, 88, 160), "t5": (512, 1024)},
    "tiny": {"latents": (16, 2, 8, 8), "t5": (16, 32)},
}
