"""Krea 2 transformer configs for benchmarks with random weights: no download needed.

"12b": the released Krea 2 transformer (Raw and Turbo share it), 12.82B parameters in diffusers'
Krea2Transformer2DModel. Where each value comes from:
- Krea's own inference code, krea-ai/krea-2 `src/krea2/inference/bf16.py` at commit 630cb5955d6c
  (`single_mmdit_large_wide`: features 6144, heads 48, kvheads 12, multiplier 4, layers 28,
  patch 2, channels 16, tdim 256, txtdim 2560, txtheads 20, txtkvheads 20, txtlayers 12), read
  with its `src/krea2/models/transformer.py` (same commit): head dim 6144 / 48 = 128, RoPE axes
  (128 - 12 * 8, 48, 48) = (32, 48, 48), theta 1e3, SwiGLU width 128-rounded
  int(2 * 6144 / 3) * 4 = 16384 (text blocks: int(2 * 2560 / 3) * 4 -> 6912), 2 + 2 text-fusion
  blocks, RMSNorm eps 1e-5.
- The same mapping, as a diffusers config, in a community conversion script
  (`scripts/convert_krea2_community_to_diffusers.py`, "all values verified against the original
  weight shapes"), and diffusers 0.42.1's class defaults: all three agree on every field.
- Cross-checks: the text features are Qwen3-VL-4B-Instruct's (hidden size 2560; the pipeline taps
  12 of its hidden states), the latents the Qwen-Image VAE's 16 channels in 2x2 patches (64).
  Parameter count: 12.82B here; Krea's report says "12B", the diffusers model cards of
  CalamitousFelicitousness/Krea-2-{Base,Turbo}-Diffusers say 12.9B. Unconfirmed: no
  transformer/config.json of Krea's own was read (Krea's README points at single safetensors
  files), so the diffusers config is the mapping above, not a quoted file.
"""

# The tiny test model's sizes (dpipe.models.krea2.tiny writes it).
Z_DIM = 4  # latent channels (16 in the real VAE)
TEXT_DIM = 32  # Qwen3-VL hidden size = the transformer's text_hidden_dim (2560 for Qwen3-VL-4B)
SELECT_LAYERS = (1, 2, 4)  # hidden_states taps (0 is the embedding output), as (2, 5, ..., 35)
NUM_TEXT_LAYERS = len(SELECT_LAYERS)

KREA2_12B = {
    "_class_name": "Krea2Transformer2DModel",
    "in_channels": 64,  # 16 latent channels in 2x2 patches
    "num_layers": 28,
    "attention_head_dim": 128,
    "num_attention_heads": 48,
    "num_key_value_heads": 12,
    "intermediate_size": 16384,
    "timestep_embed_dim": 256,
    "text_hidden_dim": 2560,  # Qwen3-VL-4B's hidden size
    "num_text_layers": 12,  # the pipeline's 12 tapped hidden states
    "text_num_attention_heads": 20,
    "text_num_key_value_heads": 20,
    "text_intermediate_size": 6912,
    "num_layerwise_text_blocks": 2,
    "num_refiner_text_blocks": 2,
    "axes_dims_rope": [32, 48, 48],
    "rope_theta": 1000.0,
    "norm_eps": 1e-5,
}

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

SIZES = {"12b": KREA2_12B, "tiny": KREA2_TINY}
# Per-sample shapes. 12b: a 1024x1024 image (the pipeline's default; 16-channel latents at 1/8
# scale: 4096 tokens after 2x2 patches) and the 12 tapped Qwen3-VL layers at the fixed 512 tokens
# every prompt is padded to (model.max_text_tokens), `valid` of them real (a prompt of about 100
# words). tiny: 64x64 pixels -> 16x16 latents; text padded to 16 tokens, 12 of them real.
SAMPLE_SHAPES = {
    "12b": {"latents": (16, 128, 128), "text": (512, 12, 2560), "valid": 128},
    "tiny": {"latents": (Z_DIM, 16, 16), "text": (16, NUM_TEXT_LAYERS, TEXT_DIM), "valid": 12},
}
