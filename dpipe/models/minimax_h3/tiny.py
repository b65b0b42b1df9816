"""A tiny random MiniMax H3, written in the layout of MiniMaxAI/MiniMax-H3.

That repo is a modular-pipeline folder: `modular_model_index.json` (MiniMaxH3ModularPipeline,
MiniMaxH3Blocks) names each component with its loading spec (the hub repo and its subfolder):
`transformer` (MiniMaxH3Transformer3DModel, the t2va/fl2va partition), `transformer_ref` (the
same class, the ref2va partition), `vae` (AutoencoderKLMiniMaxH3), `audio_vae`
(AutoencoderKLMiniMaxH3Audio), `text_encoder` (Qwen3VLForConditionalGeneration, read at
`hidden_states[50]`, so it keeps more than 50 decoder layers), `tokenizer` (Qwen2Tokenizer),
`processor` (Qwen3VLProcessor), `scheduler` and `audio_scheduler` (MiniMaxH3Scheduler, shift 12
and 3). Only the sizes shrink: the transformer keeps the release's mixed precision (the patch
projections, the timestep MLP and the output heads float32, the rest bf16), the video VAE its
16x spatial and 4x temporal compression with 17-frame chunks, the audio VAE its 800-sample hop at
32 kHz (40 latents per second), so the pipeline's own frame and canvas arithmetic applies as is.

Sizes: 64x64 frames -> 4x4 latents -> 2x2 patches: 4 rows per latent frame.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dpipe.models.common.tiny_files import save_component
from dpipe.models.common.tiny_qwen_tokenizer import save_qwen_tokenizer
from dpipe.models.common.tiny_qwen_vl import tiny_qwen3_vl_config
from dpipe.models.tiny_parts import save_modular_index, seeded, tiny_writer

REPO = "MiniMaxAI/MiniMax-H3"
INDEX = "modular_model_index.json"
TEXT_DIM = 32  # Qwen3-VL's hidden size (5120 in the release) = the transformer's text_dim
TEXT_LAYERS = 51  # the conditioning is hidden_states[50]: one layer more
LATENT_CHANNELS = 8  # video latents (24 in the release)
AUDIO_CHANNELS = 8  # audio latents (32 in the release)
DTYPE = torch.bfloat16

TRANSFORMER = dict(
    num_attention_heads=2, attention_head_dim=24, hidden_size=32, num_layers=2,
    num_refiner_layers=2, ffn_dim=64, in_channels=LATENT_CHANNELS,
    audio_in_channels=AUDIO_CHANNELS, patch_size=(1, 2, 2), text_dim=TEXT_DIM, freq_dim=32,
    time_embed_hidden_dim=32, time_embed_dim=16, rope_freq_dim=4)  # 2 * 3 * 4 <= head dim 24
VAE = dict(
    latent_channels=LATENT_CHANNELS, block_out_channels=(8, 8, 8, 8, 8, 8), layers_per_block=1,
    norm_num_groups=4, decoder_num_layers=1, decoder_num_attention_heads=2,
    decoder_attention_head_dim=8, decoder_num_register_tokens=1, decoder_ffn_mult=2,
    latents_mean=tuple(0.1 * i for i in range(LATENT_CHANNELS)),
    latents_std=tuple(1.0 + 0.1 * i for i in range(LATENT_CHANNELS)))
# The hop stays 800 (encoder 2*4*4*5*5, decoder 8*10*10): 40 latents per second at 32 kHz.
AUDIO_VAE = dict(
    encoder_dim=4, latent_dim=32, latent_channels=AUDIO_CHANNELS, num_attention_heads=2,
    decoder_dim=16, decoder_rates=(8, 10, 10), decoder_kernel_sizes=(16, 20, 20),
    resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1,),),
    latents_mean=[0.05 * i for i in range(AUDIO_CHANNELS)],
    latents_std=[1.0 + 0.05 * i for i in range(AUDIO_CHANNELS)])
COMPONENTS = {  # name -> (library, class), as modular_model_index.json lists them
    "audio_scheduler": ("diffusers", "MiniMaxH3Scheduler"),
    "audio_vae": ("diffusers", "AutoencoderKLMiniMaxH3Audio"),
    "processor": ("transformers", "Qwen3VLProcessor"),
    "scheduler": ("diffusers", "MiniMaxH3Scheduler"),
    "text_encoder": ("transformers", "Qwen3VLForConditionalGeneration"),
    "tokenizer": ("transformers", "Qwen2Tokenizer"),
    "transformer": ("diffusers", "MiniMaxH3Transformer3DModel"),
    "transformer_ref": ("diffusers", "MiniMaxH3Transformer3DModel"),
    "vae": ("diffusers", "AutoencoderKLMiniMaxH3"),
}


def save_transformer(transformer: torch.nn.Module, directory: Path) -> None:
    """bf16 but for the modules the release keeps in float32 (`_keep_in_fp32_modules`)."""
    torch.nn.Module.to(transformer, DTYPE)
    keep = transformer._keep_in_fp32_modules
    for name, module in transformer.named_modules():
        if any(part in keep for part in name.split(".")):
            torch.nn.Module.to(module, torch.float32)
    transformer.save_pretrained(directory, max_shard_size="100KB")


def _random_transformer(seed: int) -> torch.nn.Module:
    from diffusers import MiniMaxH3Transformer3DModel

    with seeded(seed):
        transformer = MiniMaxH3Transformer3DModel(**TRANSFORMER)
        # Zero-initialised biases and unit norm scales would leave a random model blind to the
        # timestep and the modality: small random values, as a trained checkpoint has.
        for name, param in transformer.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.data.add_(torch.randn_like(param) * 0.1)
    return transformer


@tiny_writer(marker=INDEX)
def make_tiny_minimax_h3(out: Path, seed: int) -> None:
    """A tiny random MiniMax H3 folder."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Scheduler
    from transformers import Qwen3VLForConditionalGeneration

    added = save_qwen_tokenizer(out / "tokenizer", "qwen3", model_max_length=262144)
    with seeded(seed):
        text_encoder = Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config(
            added, TEXT_DIM, TEXT_LAYERS, tie_word_embeddings=True))
    transformer = _random_transformer(seed + 1)
    transformer_ref = _random_transformer(seed + 2)
    with seeded(seed + 3):
        vae = AutoencoderKLMiniMaxH3(**VAE)
    with seeded(seed + 4):
        audio_vae = AutoencoderKLMiniMaxH3Audio(**AUDIO_VAE)

    MiniMaxH3Scheduler(shift=12.0).save_pretrained(out / "scheduler")
    MiniMaxH3Scheduler(shift=3.0).save_pretrained(out / "audio_scheduler")
    save_transformer(transformer, out / "transformer")
    save_transformer(transformer_ref, out / "transformer_ref")
    save_component(text_encoder, out / "text_encoder", shards=2, dtype=DTYPE)
    save_component(vae, out / "vae", shards=1, dtype=torch.float32)  # the release's VAEs: fp32
    save_component(audio_vae, out / "audio_vae", shards=1, dtype=torch.float32)
    _save_processor(out / "processor")
    save_modular_index(out, "MiniMaxH3ModularPipeline", "MiniMaxH3Blocks", REPO, COMPONENTS)


def write_single_file(folder: Path, file: Path, prefix: str = "") -> Path:
    """The tiny folder's transformer as the published single files hold it: the original names
    (`comfyui.original_state_dict`), q, k, v stacked, the release's dtypes."""
    from dpipe.models.minimax_h3.comfyui import original_state_dict
    from dpipe.models.single_file import write_transformer_file

    return write_transformer_file(folder / "transformer", file,
                                  lambda weights: original_state_dict(weights, TRANSFORMER), prefix)


# Qwen3-VL's pixel conventions (patch 16, 2x2 merge, 2-frame temporal patches, mean = std = 0.5).
_VISION = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5, 0.5, 0.5],
               image_std=[0.5, 0.5, 0.5])


def _save_processor(directory: Path) -> None:
    """processor/ as the release ships it: the tokenizer files, the image processor's
    preprocessor_config.json and the video processor's video_preprocessor_config.json (written
    as JSON: transformers builds a video processor only with torchvision)."""
    from transformers import Qwen2VLImageProcessor

    save_qwen_tokenizer(directory, "qwen3", model_max_length=262144)
    Qwen2VLImageProcessor(**_VISION).save_pretrained(directory)
    config = json.loads((directory / "preprocessor_config.json").read_text())
    config.update(image_processor_type="Qwen2VLImageProcessorFast",
                  processor_class="Qwen3VLProcessor")
    (directory / "preprocessor_config.json").write_text(json.dumps(config, indent=2) + "\n")
    video = {**_VISION, "video_processor_type": "Qwen3VLVideoProcessor",
             "processor_class": "Qwen3VLProcessor", "do_sample_frames": True, "fps": 2,
             "min_frames": 4, "max_frames": 768, "do_resize": True, "do_rescale": True,
             "do_normalize": True, "do_convert_rgb": True, "rescale_factor": 1 / 255,
             "size": {"shortest_edge": 4096, "longest_edge": 25165824}}
    (directory / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")
