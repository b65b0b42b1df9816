"""LTX-2.3 transformer configs at real size, for benchmarks with random weights: no download
needed. "22b": the published transformer of Lightricks/LTX-2.3 (ltx-2.3-22b-dev), as diffusers'
LTX-2 conversion (`--version 2.3`) writes its transformer/config.json: LTX-2's 48 blocks of a
4096-wide video and a 2048-wide audio stream, with 2.3's gated attention, cross-attention
modulation and connector-side prompt projections; 18.99B parameters (the release's "22B" counts
its text connectors too, which dpipe does not train). The tiny one is the test model's
(`dpipe.models.ltx_video.ltx2.ltx23_tiny`)."""

from dpipe.models.ltx_video.ltx2.tiny import TRANSFORMER as LTX2_TINY, VAE as LTX2_TINY_VAE
from dpipe.models.ltx_video.ltx2.ltx23_tiny import TRANSFORMER_23, VAE_23

LTX23_22B = {
    "_class_name": "LTX2VideoTransformer3DModel",
    "activation_fn": "gelu-approximate",
    "attention_bias": True,
    "attention_head_dim": 128,
    "attention_out_bias": True,
    "audio_attention_head_dim": 64,
    "audio_cross_attention_dim": 2048,
    "audio_cross_attn_mod": True,
    "audio_gated_attn": True,
    "audio_hop_length": 160,
    "audio_in_channels": 128,
    "audio_num_attention_heads": 32,
    "audio_out_channels": 128,
    "audio_patch_size": 1,
    "audio_patch_size_t": 1,
    "audio_pos_embed_max_pos": 20,
    "audio_sampling_rate": 16000,
    "audio_scale_factor": 4,
    "base_height": 2048,
    "base_width": 2048,
    "caption_channels": 3840,  # Gemma 3 12B's width
    "causal_offset": 1,
    "cross_attention_dim": 4096,
    "cross_attn_mod": True,
    "cross_attn_timestep_scale_multiplier": 1000,
    "gated_attn": True,
    "in_channels": 128,
    "norm_elementwise_affine": False,
    "norm_eps": 1e-06,
    "num_attention_heads": 32,
    "num_layers": 48,
    "out_channels": 128,
    "patch_size": 1,
    "patch_size_t": 1,
    "perturbed_attn": True,
    "pos_embed_max_pos": 20,
    "qk_norm": "rms_norm_across_heads",
    "rope_double_precision": True,
    "rope_theta": 10000.0,
    "rope_type": "split",
    "timestep_scale_multiplier": 1000,
    "use_prompt_embeddings": False,
    "vae_scale_factors": [8, 32, 32],
}
LTX23_TINY = {"_class_name": "LTX2VideoTransformer3DModel", **LTX2_TINY, **TRANSFORMER_23}

SIZES = {"22b": LTX23_22B, "tiny": LTX23_TINY}
# What the VAE config says about the latents (`_ratios`: 32x spatial, 8x temporal), per size.
VAES = {
    "22b": {"patch_size": 4, "patch_size_t": 1, "spatial_compression_ratio": 32,
            "temporal_compression_ratio": 8, "spatio_temporal_scaling": [True] * 4},
    "tiny": {**LTX2_TINY_VAE, **VAE_23},
}
# Per-sample shapes. 22b: LTX2Pipeline's default clip, 121 frames at 512x768 (128-channel
# latents, 8x temporal and 32x spatial compression: 16 x 16 x 24, 6144 tokens), and the video
# connector's 1024 prompt tokens at the stream's 4096 width (max_sequence_length 1024: the
# connector's learnable registers fill the padding, so every token is attended).
# With model.audio=true also the clip's sound: the audio VAE's (8 channels, L, 16 mel bins)
# latents, L = round(121 / 24 s x 25 latents per second) = 126 as LTX2Pipeline computes it, and
# the audio connector's prompt tokens at the audio stream's 2048 width.
SAMPLE_SHAPES = {
    "22b": {"latents": (128, 16, 16, 24), "video_text": (1024, 4096),
            "audio": (8, 126, 16), "audio_text": (1024, 2048)},
    "tiny": {"latents": (LTX2_TINY["in_channels"], 2, 8, 8),
             "video_text": (32, LTX2_TINY["num_attention_heads"] * LTX2_TINY["attention_head_dim"]),
             "audio": (2, 9, 2),  # audio_in_channels 4 = 2 channels x 2 mel bins
             "audio_text": (32, LTX2_TINY["audio_num_attention_heads"]
                            * LTX2_TINY["audio_attention_head_dim"])},
}
