"""Qwen-Image transformer configs at real size (the published Qwen/Qwen-Image transformer folder,
20.4B parameters), for benchmarks with random weights: no download needed. The tiny one is the
test model's (`dpipe.models.qwen_image.tiny` builds it)."""

Z_DIM = 4  # the tiny VAE's latent channels (16 in the real VAE)
TEXT_DIM = 32  # the tiny Qwen2.5-VL's hidden size = joint_attention_dim (3584 for Qwen2.5-VL-7B)

QWEN_IMAGE_20B = {
    "_class_name": "QwenImageTransformer2DModel",
    "attention_head_dim": 128,
    "axes_dims_rope": [16, 56, 56],
    "guidance_embeds": False,
    "in_channels": 64,
    "joint_attention_dim": 3584,  # Qwen2.5-VL-7B's hidden size
    "num_attention_heads": 24,
    "num_layers": 60,
    "out_channels": 16,
    "patch_size": 2,
}

QWEN_IMAGE_TINY = {
    **QWEN_IMAGE_20B, "attention_head_dim": 16,
    "axes_dims_rope": [4, 6, 6],  # sums to the head dim, as (16, 56, 56) sums to 128
    "in_channels": 4 * Z_DIM, "joint_attention_dim": TEXT_DIM, "num_attention_heads": 2,
    "num_layers": 2, "out_channels": Z_DIM,
}

SIZES = {"20b": QWEN_IMAGE_20B, "tiny": QWEN_IMAGE_TINY}
# Per-sample shapes. 20b: a 1024x1024 image (16-channel latents at 1/8 scale: 4096 tokens after
# 2x2 patches) and Qwen2.5-VL text padded to 512 tokens (model.max_text_tokens), the first
# `text_tokens` of them real (a prompt of about 100 words, the template's system prompt dropped).
SAMPLE_SHAPES = {
    "20b": {"latents": (16, 128, 128), "text": (512, 3584), "text_tokens": 128},
    "tiny": {"latents": (Z_DIM, 16, 16), "text": (24, TEXT_DIM), "text_tokens": 10},
}
