"""Wan transformer configs at real size (the published Wan-AI/Wan2.1-T2V-14B-Diffusers transformer
folder, 14.29B parameters), for benchmarks with random weights: no download needed. The tiny one
is the tiny text-to-video model's (`dpipe.models.wan.tiny` builds every tiny variant from it)."""

# The tiny model's widths (`dpipe.models.wan.tiny` writes its folders from WAN_TINY).
TEXT_DIM = 32  # UMT5 d_model = the transformer's text_dim
HEADS, HEAD_DIM = 2, 12  # head_dim 12 splits into rotary parts 4 (t) + 4 (h) + 4 (w)

WAN21_T2V_14B = {
    "_class_name": "WanTransformer3DModel",
    "added_kv_proj_dim": None,
    "attention_head_dim": 128,
    "cross_attn_norm": True,
    "eps": 1e-06,
    "ffn_dim": 13824,
    "freq_dim": 256,
    "image_dim": None,
    "in_channels": 16,
    "num_attention_heads": 40,
    "num_layers": 40,
    "out_channels": 16,
    "patch_size": [1, 2, 2],
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 1024,
    "text_dim": 4096,  # UMT5-XXL's width
}

WAN_TINY = {
    **WAN21_T2V_14B, "attention_head_dim": HEAD_DIM, "ffn_dim": 32, "freq_dim": 32,
    "num_attention_heads": HEADS, "num_layers": 2, "text_dim": TEXT_DIM,
}

SIZES = {"14b": WAN21_T2V_14B, "tiny": WAN_TINY}
# What the rest of a Wan 2.1 text-to-video folder says about the model (`read_variant`'s reads):
# a benchmark size stands for that variant.
T2V_FOLDER = {"model_index.json": {"_class_name": "WanPipeline"},
              "vae/config.json": {"z_dim": 16}}
# Per-sample shapes. 14b: a 33-frame 480x832 clip (16-channel latents, 4x temporal and 8x spatial
# compression: 9 x 60 x 104, 14040 tokens after 1x2x2 patches) and UMT5 text at Wan's 512
# tokens, padding included (its pipeline pads every prompt with zeros, attended).
SAMPLE_SHAPES = {
    "14b": {"latents": (16, 9, 60, 104), "umt5": (512, 4096)},
    "tiny": {"latents": (16, 3, 8, 8), "umt5": (32, TEXT_DIM)},
}
