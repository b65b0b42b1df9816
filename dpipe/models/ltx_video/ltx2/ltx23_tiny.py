"""A tiny random LTX-2.3, written in the diffusers layout of the LTX-2.3 release
(diffusers/LTX-2.3-Diffusers, converted from Lightricks/LTX-2.3).

The folder is LTX-2's (`dpipe.models.ltx_video.ltx2.tiny`: LTX2Pipeline with transformer, connectors, VAE,
audio VAE, vocoder, Gemma 3 text encoder and tokenizer) with LTX-2.3's switches on, as diffusers'
conversion of the 2.3 checkpoints sets them:
  * transformer: `gated_attn` / `audio_gated_attn` (a per-head gate in every attention,
    `to_gate_logits`), `cross_attn_mod` / `audio_cross_attn_mod` (9 modulation rows per block:
    the text cross-attention's query modulated and gated, the text keys and values modulated by
    the sigma through `prompt_adaln` and the blocks' `prompt_scale_shift_table`),
    `use_prompt_embeddings=False` (no caption_projection: the connectors give each stream its
    prompt at its own width), `perturbed_attn` (spatio-temporal guidance's attention skip);
  * connectors: per-modality projections with bias (`video_text_proj_in`,
    `audio_text_proj_in`) and gated attention;
  * VAE: the 2.3 decoder's zero padding, not causal;
  * vocoder: LTX2VocoderWithBWE (SnakeBeta activations, anti-aliasing, a bandwidth-extension
    generator up to 48 kHz), as the release ships it.
Only the sizes shrink, as in the LTX-2 tiny model: 64x64 images or 8k+1 frames -> 8x8 latents
of 8 channels per latent frame -> 64 video tokens of width 32.
"""

from __future__ import annotations

from pathlib import Path

from dpipe.models.ltx_video.ltx2.tiny import TRANSFORMER, make_tiny_ltx2

VIDEO_WIDTH = TRANSFORMER["num_attention_heads"] * TRANSFORMER["attention_head_dim"]  # 32
AUDIO_WIDTH = TRANSFORMER["audio_num_attention_heads"] * TRANSFORMER["audio_attention_head_dim"]

TRANSFORMER_23 = {
    "gated_attn": True, "cross_attn_mod": True, "audio_gated_attn": True,
    "audio_cross_attn_mod": True, "use_prompt_embeddings": False, "perturbed_attn": True,
    # The connectors' video / audio widths are the streams' (4096 and 2048 in the release).
    "cross_attention_dim": VIDEO_WIDTH, "audio_cross_attention_dim": AUDIO_WIDTH,
}
CONNECTORS_23 = {
    "per_modality_projections": True, "proj_bias": True, "video_gated_attn": True,
    "audio_gated_attn": True, "video_hidden_dim": VIDEO_WIDTH, "audio_hidden_dim": AUDIO_WIDTH,
    # Each connector runs at its stream's width: 2 heads of 16 (video) and of 8 (audio).
    "video_connector_num_attention_heads": 2, "video_connector_attention_head_dim": 16,
    "audio_connector_num_attention_heads": 2, "audio_connector_attention_head_dim": 8,
}
VAE_23 = {"decoder_spatial_padding_mode": "zeros", "decoder_causal": False}
MEL_BINS = 8  # the tiny audio VAE's
VOCODER_23 = {
    "class": "LTX2VocoderWithBWE", "in_channels": 2 * MEL_BINS, "hidden_channels": 32,
    # Upsampling by 160, the audio VAE's mel hop: 16 kHz for as long as the clip (the release's
    # first stage too).
    "out_channels": 2, "upsample_kernel_sizes": [8, 8, 20], "upsample_factors": [4, 4, 10],
    "resnet_kernel_sizes": [3], "resnet_dilations": [[1, 3, 5]], "act_fn": "snakebeta",
    "antialias": True, "final_act_fn": None, "final_bias": False,
    # The extension generator reads the mel spectrogram of the first stage's waveform, hop 80
    # samples as the release's, and upsamples each frame by hop x 2 (16 kHz -> 32 kHz here;
    # x 3, 48 kHz, in the release).
    "bwe_in_channels": 2 * MEL_BINS, "bwe_hidden_channels": 16, "bwe_out_channels": 2,
    "bwe_upsample_kernel_sizes": [8, 8, 20], "bwe_upsample_factors": [4, 4, 10],
    "bwe_resnet_kernel_sizes": [3], "bwe_resnet_dilations": [[1, 3, 5]],
    "filter_length": 256, "hop_length": 80, "window_length": 256, "num_mel_channels": MEL_BINS,
    "input_sampling_rate": 16000, "output_sampling_rate": 32000,
}


def make_tiny_ltx23(path: Path, seed: int = 0) -> Path:
    """Write (once) a tiny random LTX-2.3 diffusers folder at `path` and return `path`."""
    return make_tiny_ltx2(path, seed, transformer=TRANSFORMER_23, connectors=CONNECTORS_23,
                          vae=VAE_23, vocoder=VOCODER_23)

