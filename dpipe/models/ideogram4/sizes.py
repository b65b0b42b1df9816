"""Ideogram 4 transformer configs for benchmarks with random weights: no download needed.

"9b": the released Ideogram 4 transformer (the conditional `transformer`; the pipeline's
`unconditional_transformer` has the same shape and does not train), 9.28B parameters. Where each
value comes from:
- diffusers' Ideogram4Transformer2DModel defaults, the same in its documented signature
  (huggingface.co/docs/diffusers v0.39.0 and v0.40.0, api/models/ideogram4_transformer2d) and in
  the venv's diffusers 0.42.1: 34 blocks, 18 heads of 256, SwiGLU 12288, AdaLN 512, text
  features 53248, MRoPE sections (24, 20, 20) at theta 5e6, eps 1e-5, 128 input channels.
- Third-party ports that quote the release's diffusers transformer config with exactly these
  values (a Swift/MLX runtime test decoding "the diffusers config", a golden-value generator's
  FULL_CONFIG; both found by code search, which did not name their repositories).
- Cross-checks against Ideogram's release notes (Ideogram 4.0 technical page, 2026-06-03, as
  quoted by the press): "a 9.3B single-stream Diffusion Transformer", "a 34-layer DiT", text
  from Qwen3-VL-8B-Instruct's hidden states at 13 intermediate layers (13 x 4096 = 53248), the
  FLUX.2 VAE (32 latent channels in 2x2 patches = 128), "native 2K resolution". The class built
  from this config has 9.28B parameters.
- Unconfirmed: the release's own transformer/config.json (ideogram-ai/ideogram-4-fp8, -nf4) was
  not readable offline; its code repository (github.com/ideogram-oss/ideogram-4) was not
  reachable either.
"""

Z_DIM = 4  # the tiny VAE's latent channels (32 in the real one); 4x after the 2x2 patches
TEXT_DIM = 16  # the tiny Qwen3-VL's hidden size (4096 for Qwen3-VL-8B)
TAPS = 13  # len(QWEN3_VL_ACTIVATION_LAYERS)

IDEOGRAM4_9B = {
    "_class_name": "Ideogram4Transformer2DModel",
    "in_channels": 128,  # the FLUX.2 VAE's 32 channels in 2x2 patches
    "num_layers": 34,
    "attention_head_dim": 256,
    "num_attention_heads": 18,
    "intermediate_size": 12288,
    "adaln_dim": 512,
    "llm_features_dim": 53248,  # 13 tapped Qwen3-VL-8B layers x 4096
    "rope_theta": 5_000_000,
    "mrope_section": [24, 20, 20],
    "norm_eps": 1e-5,
}

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

# "9b" at the pipeline's default 2048x2048, "9b-1024" the same model at 1024x1024 (the
# resolution the other families' real sizes train at).
SIZES = {"9b": IDEOGRAM4_9B, "9b-1024": IDEOGRAM4_9B, "tiny": IDEOGRAM4_TINY}
# Per-sample shapes. 9b: a 2048x2048 image (the VAE's 1/8 scale and the 2x2 patches: 128 x 128
# tokens of 128 channels); 9b-1024: 64 x 64 tokens. Text: the 13 tapped layers at the default
# model.max_text_tokens of 256, all of them real (Ideogram 4 trains on structured JSON captions,
# which fill that budget). tiny: 64x64 pixels -> 8x8 patches of 16 channels; text padded to 16
# tokens, 12 real.
_TEXT_9B = {"text": (256, 53248), "valid": 256}
SAMPLE_SHAPES = {"9b": {"latents": (128, 128, 128), **_TEXT_9B},
                 "9b-1024": {"latents": (128, 64, 64), **_TEXT_9B},
                 "tiny": {"latents": (4 * Z_DIM, 8, 8), "text": (16, TAPS * TEXT_DIM),
                          "valid": 12}}
