"""MiniMax H3's configs for benchmarks with random weights (dpipe-bench --size).

"33b": the released `transformer/` (MiniMaxH3Transformer3DModel's defaults, which are the
MiniMaxAI/MiniMax-H3 config: 50 blocks of width 5376, 56 heads of 128, SwiGLU 14336, 2 text-refiner
blocks, Qwen3-VL's 5120-wide text, 24 video and 32 audio latent channels, patch (1, 2, 2)). A
sample: 22 frames at 512x896 (24 x 7 x 32 x 56 latents, 3136 video rows), its stereo soundtrack
(2 x round(22 / 24 x 40) = 74 audio rows of 32 channels, with model.audio=true) and a 512-token
prompt, 120 tokens of it real. "tiny": the test model's (`dpipe.models.minimax_h3.tiny`).
"""

from dpipe.models.minimax_h3.tiny import AUDIO_CHANNELS, LATENT_CHANNELS, TEXT_DIM, TRANSFORMER

TRANSFORMER_33B = dict(
    num_attention_heads=56, attention_head_dim=128, hidden_size=5376, num_layers=50,
    num_refiner_layers=2, ffn_dim=14336, in_channels=24, audio_in_channels=32,
    patch_size=(1, 2, 2), text_dim=5120, freq_dim=256, time_embed_hidden_dim=5376,
    time_embed_dim=2688, rope_freq_dim=16, rope_theta=10000.0, norm_eps=1e-5, qk_norm_eps=1e-5,
    final_norm_eps=1e-5)

SIZES = {
    "33b": {"_class_name": "MiniMaxH3Transformer3DModel", **TRANSFORMER_33B},
    "tiny": {"_class_name": "MiniMaxH3Transformer3DModel", **TRANSFORMER},
}
SAMPLE_SHAPES = {
    "33b": {"latents": (24, 7, 32, 56), "audio": (74, 32), "text": 512, "valid": 120,
            "text_dim": 5120},
    "tiny": {"latents": (LATENT_CHANNELS, 7, 4, 4), "audio": (74, AUDIO_CHANNELS), "text": 512,
             "valid": 12, "text_dim": TEXT_DIM},
}
