"""ERNIE-Image transformer configs for benchmarks with random weights: no download needed.

"8b": the released ERNIE-Image transformer (baidu/ERNIE-Image; ERNIE-Image-Turbo shares it),
8.03B parameters. diffusers' ErnieImageTransformer2DModel defaults describe a smaller model
(3072 wide, 24 layers): these values are the release's. Where each value comes from:
- baidu/ERNIE-Image's `transformer/config.json` as quoted verbatim by two independent ports: the
  "Configs (oracle)" section of dgrauet/ernie-image-mlx `CLAUDE.md` (commit cbc61d3f487a), and
  the RELEASED_TRANSFORMER_CONFIG of an invoke-ai/InvokeAI single-file loader test ("baidu/
  ERNIE-Image's released transformer/config.json, verbatim"). Both give hidden 4096, 32 heads,
  36 layers, FFN 12288, 128 in/out channels at patch 1, text_in_dim 3072, RoPE axes
  (32, 48, 48) at theta 256, eps 1e-6, qk_layernorm.
- Cross-checks: Baidu's model card (baidu/ERNIE-Image `docs/huggingface_model_cards/
  ernie_image_model_card_en.md`, commit d39288bf0e95) says "8B DiT parameters" (8.03B here);
  text_in_dim 3072 is the Mistral3 (Ministral 3B) text encoder's hidden size; 128 channels are
  the FLUX.2 VAE's 32 latent channels in 2x2 patches; RoPE axes sum to the head dim 128.
- Unconfirmed: the config.json itself was not readable offline, only the two quotations.
"""

from dpipe.models.ernie_image.tiny import LATENT_CHANNELS, TEXT_DIM

ERNIE_IMAGE_8B = {
    "_class_name": "ErnieImageTransformer2DModel",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_layers": 36,
    "ffn_hidden_size": 12288,
    "in_channels": 128,  # the FLUX.2 VAE's 32 channels, 2x2-patchified
    "out_channels": 128,
    "patch_size": 1,
    "text_in_dim": 3072,  # Ministral 3B's hidden size
    "rope_theta": 256,
    "rope_axes_dim": [32, 48, 48],
    "eps": 1e-6,
    "qk_layernorm": True,
}

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

SIZES = {"8b": ERNIE_IMAGE_8B, "tiny": ERNIE_IMAGE_TINY}
# Per-sample shapes. 8b: a 1024x1024 image (the pipeline's default; 1/16 scale with the 2x2
# patches: 64 x 64 tokens of 128 channels) and Mistral text cached at model.max_text_tokens (512),
# the first `valid` of them real (<s> and a prompt of about 100 words; a batch is cut after its
# longest prompt). tiny: 64x64 pixels -> 8x8 patchified latents; text padded to 16 tokens, 12 real.
SAMPLE_SHAPES = {
    "8b": {"latents": (128, 64, 64), "text": (512, 3072), "valid": 128},
    "tiny": {"latents": (4 * LATENT_CHANNELS, 8, 8), "text": (16, TEXT_DIM), "valid": 12},
}
