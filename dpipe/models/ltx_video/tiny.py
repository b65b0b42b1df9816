"""A tiny random LTX-Video, written in the diffusers layout of Lightricks/LTX-Video.

The real folder: model_index.json (LTXPipeline), scheduler/ (flow matching with resolution-
dependent shift), transformer/ (LTXVideoTransformer3DModel, sharded bf16 + index), vae/
(AutoencoderKLLTXVideo with per-channel `latents_mean`/`latents_std` buffers), text_encoder/
(T5EncoderModel, sharded + index) and tokenizer/ (T5). Only the sizes shrink. Not reproduced: the
tokenizer's spiece.model (a tokenizer.json stands in, as for FLUX's T5).

Sizes: 64x64 images (or 8k+1 frames of them, the real VAE's rule) -> VAE (8x spatial, 8x temporal,
8 channels; the real one: 32x, 8x, 128) -> 8x8 latents per latent frame -> 64 tokens of width 16.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dpipe.models.common.tiny_files import save_parts, save_sharded
from dpipe.models.tiny_parts import (
    save_model_index, save_t5_tokenizer, seeded, tiny_t5_encoder, tiny_writer)

LATENT_CHANNELS = 8
TEXT_DIM = 32  # T5 d_model (caption_channels)
T5_MAX_LENGTH = 128  # LTXPipeline's default max_sequence_length


@tiny_writer
def make_tiny_ltx_video(out: Path, seed: int) -> None:
    """A tiny random LTX-Video diffusers folder."""
    from diffusers import (
        AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXPipeline,
        LTXVideoTransformer3DModel)
    from transformers import T5TokenizerFast

    t5_vocab = save_t5_tokenizer(out / "tokenizer", model_max_length=T5_MAX_LENGTH)
    # LTX-Video's scheduler config: the shift grows with the video token count.
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False, base_shift=0.95,
        max_shift=2.05, base_image_seq_len=1024, max_image_seq_len=4096)
    with seeded(seed):
        text_encoder = tiny_t5_encoder(t5_vocab, TEXT_DIM, d_ff=80)
    with seeded(seed + 1):
        transformer = LTXVideoTransformer3DModel(
            in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, patch_size=1,
            patch_size_t=1, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
            # 4 blocks: with 2 the embedder alone outweighs a block and a 2-stage split leaves
            # the first stage without LoRA weights.
            num_layers=4, caption_channels=TEXT_DIM, qk_norm="rms_norm_across_heads")
    with seeded(seed + 2):
        vae = AutoencoderKLLTXVideo(
            in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS,
            block_out_channels=(8, 16, 16, 16), decoder_block_out_channels=(8, 16, 16, 16),
            layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1),
            # Three 2x spatio-temporal levels and no pixel patching: 8x spatial, 8x temporal
            # (the real VAE: a 4x4 pixel patch in front, so 32x spatial).
            spatio_temporal_scaling=(True, True, True, False),
            decoder_spatio_temporal_scaling=(True, True, True, False),
            decoder_inject_noise=(False,) * 5, patch_size=1, patch_size_t=1,
            timestep_conditioning=False, scaling_factor=1.0)
        # Per-channel statistics as the real VAE has them, so normalisation is exercised.
        vae.latents_mean.copy_(torch.randn(LATENT_CHANNELS) * 0.1)
        vae.latents_std.copy_(torch.rand(LATENT_CHANNELS) + 0.5)

    save_parts(out, save_sharded, torch.bfloat16, scheduler, transformer=(transformer, 2),
               text_encoder=(text_encoder, 2), vae=(vae, 1))

    pipe = LTXPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                       tokenizer=T5TokenizerFast.from_pretrained(out / "tokenizer"),
                       transformer=transformer)
    # As the real folder names it.
    save_model_index(pipe, out, tokenizer=["transformers", "T5TokenizerFast"])


def write_single_file(folder: Path, file: Path, prefix: str = "model.diffusion_model.") -> Path:
    """The tiny folder's transformer as the single file users download
    (ltx-video-2b-v0.9.5.safetensors): original names behind `prefix`, bf16, next to `vae.` keys.
    The VAE part is a stand-in (its marker keys, not the tiny VAE in LTX's own layout): loaders
    of the transformer must skip it, and the VAE is read from the diffusers folder."""
    from dpipe.models.ltx_video.original import original_state_dict
    from dpipe.models.single_file import write_transformer_file

    vae = {key: torch.zeros(LATENT_CHANNELS, dtype=torch.bfloat16) for key in (
        "vae.decoder.last_scale_shift_table", "vae.per_channel_statistics.mean-of-means",
        "vae.per_channel_statistics.std-of-means")}
    return write_transformer_file(Path(folder) / "transformer", file, original_state_dict, prefix,
                                  torch.bfloat16, vae, format_metadata=False)
