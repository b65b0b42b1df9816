"""A tiny random LTX-2 (audio-video), written in the diffusers layout of Lightricks/LTX-2.

The real folder: model_index.json (LTX2Pipeline), scheduler/, transformer/
(LTX2VideoTransformer3DModel: a video and an audio stream per block with cross-attention between
them), vae/ (AutoencoderKLLTX2Video, 32x spatial, 8x temporal), audio_vae/ (AutoencoderKLLTX2Audio),
vocoder/ (LTX2Vocoder), connectors/ (LTX2TextConnectors: text-encoder layers -> prompt tokens),
text_encoder/ (Gemma3ForConditionalGeneration, Gemma-3-12B) and tokenizer/ (Gemma). Only the sizes
shrink. dpipe trains the video stream only; the audio parts are here because the pipeline (and the
transformer) need them to load and generate.

Sizes: 64x64 images (or 8k+1 frames, the real VAE's rule) -> VAE (8x spatial, 8x temporal, 8
channels) -> 8x8 latents per latent frame -> 64 video tokens of width 32.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from tokenizers import processors

from dpipe.models.common.shapes import round_up
from dpipe.models.common.tiny_files import save_parts, save_sharded
from dpipe.models.tiny_parts import learn_bpe, save_model_index, seeded, tiny_corpus, tiny_writer

LATENT_CHANNELS = 8
TEXT_DIM = 32  # Gemma 3 hidden size (3840 for the 12B)
TEXT_LAYERS = 2  # the connectors read every hidden state: layers + the embedding output
_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
_IMAGE_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]

# The tiny components' configs (LTX-2.0; `make_tiny_ltx2`'s overrides change them for LTX-2.3).
TRANSFORMER = {
    "in_channels": LATENT_CHANNELS, "out_channels": LATENT_CHANNELS, "patch_size": 1,
    "patch_size_t": 1, "num_attention_heads": 2, "attention_head_dim": 16,
    "cross_attention_dim": 32, "vae_scale_factors": (8, 8, 8),
    "audio_in_channels": 4, "audio_out_channels": 4,  # 2 channels x 2 mel bins
    "audio_num_attention_heads": 2, "audio_attention_head_dim": 8,
    "audio_cross_attention_dim": 16,
    # 4 blocks: the embedders outweigh a tiny block, and each of 2 stages needs blocks.
    "num_layers": 4, "caption_channels": TEXT_DIM, "qk_norm": "rms_norm_across_heads",
    "rope_type": "split",
}
CONNECTORS = {
    "caption_channels": TEXT_DIM, "text_proj_in_factor": TEXT_LAYERS + 1,
    "video_connector_num_attention_heads": 2, "video_connector_attention_head_dim": 16,
    "video_connector_num_layers": 1, "video_connector_num_learnable_registers": 8,
    "audio_connector_num_attention_heads": 2, "audio_connector_attention_head_dim": 16,
    "audio_connector_num_layers": 1, "audio_connector_num_learnable_registers": 8,
    "connector_rope_base_seq_len": 32, "rope_theta": 10000.0, "rope_type": "split",
}
VAE = {
    "in_channels": 3, "out_channels": 3, "latent_channels": LATENT_CHANNELS,
    "block_out_channels": (8, 16, 16), "down_block_types": ("LTX2VideoDownBlock3D",) * 3,
    "decoder_block_out_channels": (8, 16, 16), "layers_per_block": (1, 1, 1, 1),
    "decoder_layers_per_block": (1, 1, 1, 1), "spatio_temporal_scaling": (True, True, True),
    "decoder_spatio_temporal_scaling": (True, True, True), "decoder_inject_noise": (False,) * 4,
    # Three 2x spatio-temporal levels, no pixel patch: 8x spatial and 8x temporal (the real
    # VAE: 32x spatial with a 4x4 patch, 8x temporal).
    "downsample_type": ("spatiotemporal",) * 3, "upsample_residual": (False,) * 3,
    "upsample_factor": (1,) * 3, "timestep_conditioning": False, "patch_size": 1,
    "patch_size_t": 1,
}
# Upsampling by 160 in all, the audio VAE's mel hop, as the release's [6, 5, 2, 2, 2] = 240 is
# its 24 kHz over 100 mel frames per second: the waveform lasts as long as the clip.
VOCODER = {
    "in_channels": 2 * 8, "hidden_channels": 32, "out_channels": 2,
    "upsample_kernel_sizes": [8, 8, 20], "upsample_factors": [4, 4, 10], "resnet_kernel_sizes": [3],
    "resnet_dilations": [[1, 3, 5]], "leaky_relu_negative_slope": 0.1,
    "output_sampling_rate": 16000,
}


@lru_cache(maxsize=1)
def _gemma_bpe(num_merges: int = 512):
    """SentencePiece-style BPE as Gemma's: spaces become "▁" and nothing splits the text, so
    merges may span words; byte-fallback tokens <0x00>..<0xFF> spell anything else."""
    lines = ["▁" + line.replace(" ", "▁") for line in tiny_corpus()]
    merges = learn_bpe({tuple(line): 1 for line in lines} | {tuple(line): 2 for line in lines},
                        num_merges)
    chars = sorted({c for line in lines for c in line})
    vocab = _SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + chars + ["".join(m) for m in merges]
    return list(dict.fromkeys(vocab)), merges


def save_gemma_tokenizer(directory: Path) -> dict[str, int]:
    """A Gemma tokenizer folder (tokenizer.json + configs); returns {token: id} of the image tokens."""
    from transformers import GemmaTokenizer

    vocab, merges = _gemma_bpe()
    ids = {t: i for i, t in enumerate(vocab)}
    tok = GemmaTokenizer(vocab=ids, merges=list(merges))
    tok.add_special_tokens({"additional_special_tokens": _IMAGE_TOKENS})
    # Gemma's tokenizer.json puts <bos> in front of every sequence.
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", ids["<bos>"])])
    tok.model_max_length = 1048576
    tok.save_pretrained(directory)
    return {t: tok.convert_tokens_to_ids(t) for t in _IMAGE_TOKENS} | {"vocab_size": len(tok)}


@tiny_writer
def make_tiny_ltx2(out: Path, seed: int, **overrides: dict[str, Any]) -> None:
    """A tiny random LTX-2 diffusers folder. `overrides`: {part: config changes} for a later
    release of the same classes (LTX-2.3, `dpipe.models.ltx_video.ltx2.ltx23_tiny`):
    `transformer`, `connectors`, `vae`, `vocoder` (a `class` key there names another vocoder
    class of diffusers.pipelines.ltx2.vocoder)."""
    from diffusers import (
        AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline, LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2 import vocoder as vocoders
    from transformers import (
        Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, GemmaTokenizer,
        SiglipVisionConfig)

    tokens = save_gemma_tokenizer(out / "tokenizer")
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.95,
        max_shift=2.05, base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1)
    with seeded(seed):
        text_encoder = Gemma3ForConditionalGeneration(Gemma3Config(
            text_config=Gemma3TextConfig(
                vocab_size=round_up(tokens["vocab_size"], 64), hidden_size=TEXT_DIM,
                intermediate_size=64, num_hidden_layers=TEXT_LAYERS, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
                sliding_window=64),
            vision_config=SiglipVisionConfig(
                hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                image_size=32, patch_size=8),
            mm_tokens_per_image=4, boi_token_index=tokens["<start_of_image>"],
            eoi_token_index=tokens["<end_of_image>"],
            image_token_index=tokens["<image_soft_token>"]))
    with seeded(seed + 1):
        connectors = LTX2TextConnectors(**{**CONNECTORS, **overrides.get("connectors", {})})
    with seeded(seed + 2):
        transformer = LTX2VideoTransformer3DModel(
            **{**TRANSFORMER, **overrides.get("transformer", {})})
    with seeded(seed + 3):
        vae = AutoencoderKLLTX2Video(**{**VAE, **overrides.get("vae", {})})
        vae.latents_mean.copy_(torch.randn(LATENT_CHANNELS) * 0.1)
        vae.latents_std.copy_(torch.rand(LATENT_CHANNELS) + 0.5)
    with seeded(seed + 4):
        # ch_mult of 3 levels: 4x down in time and mel bins as the real VAE (8 -> 2 mel bins),
        # and base_channels = latent channels x latent mel bins, the size of latents_mean/std.
        audio_vae = AutoencoderKLLTX2Audio(
            base_channels=4, output_channels=2, ch_mult=(1, 2, 4), num_res_blocks=1,
            attn_resolutions=None, in_channels=2, resolution=32, latent_channels=2,
            norm_type="pixel", causality_axis="height", dropout=0.0,
            mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True,
            mel_bins=8)
        audio_vae.latents_mean.copy_(torch.randn(4) * 0.1)
        audio_vae.latents_std.copy_(torch.rand(4) + 0.5)
    with seeded(seed + 5):
        vocoder_config = {**VOCODER, **overrides.get("vocoder", {})}
        vocoder = getattr(vocoders, vocoder_config.pop("class", "LTX2Vocoder"))(**vocoder_config)

    save_parts(out, save_sharded, torch.bfloat16, scheduler, transformer=(transformer, 2),
               text_encoder=(text_encoder, 2), connectors=(connectors, 1), vae=(vae, 1),
               audio_vae=(audio_vae, 1), vocoder=(vocoder, 1))

    pipe = LTX2Pipeline(
        scheduler=scheduler, vae=vae, audio_vae=audio_vae, text_encoder=text_encoder,
        tokenizer=GemmaTokenizer.from_pretrained(out / "tokenizer"), connectors=connectors,
        transformer=transformer, vocoder=vocoder)
    # As the real folder names it.
    save_model_index(pipe, out, tokenizer=["transformers", "GemmaTokenizerFast"])


def write_single_file(folder: Path, file: Path, prefix: str = "model.diffusion_model.") -> Path:
    """The tiny folder's transformer as the single file Lightricks releases
    (ltx-2-19b-dev.safetensors): original names behind `prefix`, bf16, next to `vae.`,
    `audio_vae.` and `vocoder.` keys. Those are stand-ins (marker keys, not the tiny components
    in Lightricks' layout): loaders of the transformer must skip them."""
    from dpipe.models.ltx_video.ltx2.original import original_state_dict
    from dpipe.models.single_file import write_transformer_file

    others = {key: torch.zeros(LATENT_CHANNELS, dtype=torch.bfloat16) for key in (
        "vae.per_channel_statistics.mean-of-means",
        "audio_vae.per_channel_statistics.mean-of-means", "vocoder.conv_pre.weight")}
    return write_transformer_file(Path(folder) / "transformer", file, original_state_dict, prefix,
                                  torch.bfloat16, others, format_metadata=False)
