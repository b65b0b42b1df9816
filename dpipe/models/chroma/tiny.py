"""A tiny random Chroma, in the diffusers layout of lodestones/Chroma1-HD.

CI cannot download the real checkpoint, so tests run the real loading code
(`ChromaPipeline.from_pretrained`, `ChromaTransformer2DModel.from_pretrained(subfolder=...)`) on
this folder. Kept as in the real repo: the component classes in model_index.json (with the unused
`image_encoder` / `feature_extractor` slots as nulls), FLUX.1's scheduler config and VAE (16
channels with shift and scale in the real one), one T5 tokenizer and encoder (sharded with an
index), and a transformer sharded with an index. Only the sizes shrink; the modulation
approximator (`distilled_guidance_layer`) keeps its structure (input = 4 x the timestep channels).

Sizes: 64x64 images -> VAE (4x downscale, 4 latent channels) -> 16x16 latents -> 2x2 packing ->
64 image tokens of 16 channels; text: T5 (d_model 32, up to 512 tokens).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dpipe.models.common.tiny_vae import tiny_flux_vae
from dpipe.models.common.tiny_files import save_exact_shards, save_parts
from dpipe.models.tiny_parts import (
    FLUX_SCHEDULER, save_model_index, save_t5_tokenizer, seeded, tiny_t5_encoder, tiny_writer)

LATENT_CHANNELS = 4
TEXT_DIM = 32
T5_MAX_LENGTH = 512
DTYPE = torch.bfloat16


@tiny_writer
def make_tiny_chroma(out: Path, seed: int) -> None:
    """A tiny random Chroma diffusers folder."""
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler
    from transformers import T5TokenizerFast

    t5_vocab = save_t5_tokenizer(out / "tokenizer", model_max_length=T5_MAX_LENGTH)
    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER)
    with seeded(seed):
        text_encoder = tiny_t5_encoder(t5_vocab, TEXT_DIM, d_ff=80)
    with seeded(seed + 1):
        transformer = ChromaTransformer2DModel(
            patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=2, num_single_layers=2,
            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=TEXT_DIM,
            axes_dims_rope=(4, 6, 6), approximator_num_channels=16, approximator_hidden_dim=32,
            approximator_layers=2)
    with seeded(seed + 2):
        vae = tiny_flux_vae(LATENT_CHANNELS)

    save_parts(out, save_exact_shards, DTYPE, scheduler, transformer=(transformer, 2),
               text_encoder=(text_encoder, 2), vae=(vae, 1))
    pipe = ChromaPipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder,
        tokenizer=T5TokenizerFast.from_pretrained(out / "tokenizer"), transformer=transformer)
    save_model_index(pipe, out, tokenizer=["transformers", "T5TokenizerFast"],
                     image_encoder=[None, None], feature_extractor=[None, None])


def write_single_file(folder: Path, file: Path, prefix: str = "") -> Path:
    """The transformer of the tiny folder at `folder` as one file in the original layout
    (Chroma1-HD.safetensors: lodestones' FLUX-style names), keys behind `prefix`
    ("model.diffusion_model." as ComfyUI saves it)."""
    from dpipe.models.chroma.original import original_state_dict
    from dpipe.models.single_file import write_transformer_file

    return write_transformer_file(Path(folder) / "transformer", file, original_state_dict, prefix)
