"""A tiny FLUX.1-dev (and FLUX.1 Kontext), random but for its VAE, in exactly the layout of black-forest-labs/FLUX.1-dev.

Tests and CI cannot download the real 12B checkpoint, so they run the real loading code
(`FluxPipeline.from_pretrained`, `FluxTransformer2DModel.from_pretrained(subfolder=...)`) on this
folder instead. Everything the loaders look at is kept as in the real repo: the same classes in
model_index.json, the scheduler config, tokenizer files, bf16 safetensors, sharded transformer and
T5 weights with their index files; only the sizes shrink. Not reproduced: tokenizer_2/spiece.model
(tokenizer.json suffices) and the transformers/diffusers versions recorded in the configs.

As with the real repo, pass a dtype when loading (`torch_dtype=torch.float32` on CPU): without one,
transformers 5 keeps the text encoders in their stored bf16 while diffusers loads fp32.

The VAE is not random: it encodes a picture's colours (dpipe.models.common.colour_vae), so what
the demo's model learns shows in its samples.

Sizes: 64x64 images -> VAE (4x downscale, 4 latent channels) -> 16x16 latents -> Flux's 2x2 packing
-> 64 image tokens of 16 channels; text: CLIP (77 tokens, hidden 32 = pooled size) and T5 (d_model
32, up to 512 tokens).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dpipe.models.common.colour_vae import colour_flux_vae
from dpipe.models.common.tiny_files import save_exact_shards, save_parts
from dpipe.models.flux.sizes import FLUX1_TINY
from dpipe.models.tiny_parts import (
    FLUX_SCHEDULER, save_clip_tokenizer, save_model_index, save_t5_tokenizer, seeded,
    tiny_clip_text_config, tiny_t5_encoder, tiny_writer)

TEXT_DIM = 32  # CLIP hidden size (pooled projection input) and T5 d_model (joint attention input)
CLIP_MAX_LENGTH = 77  # FluxPipeline pads CLIP prompts to tokenizer.model_max_length
T5_MAX_LENGTH = 512  # FLUX.1-dev's tokenizer_2 limit; pipelines ask for less (max_sequence_length)
# The real repo stores every component in bf16; loaders must pass the compute dtype themselves.
DTYPE = torch.bfloat16


@tiny_writer
def make_tiny_flux(out: Path, seed: int) -> None:
    """A tiny random FLUX.1-dev diffusers folder."""
    _write(out, seed, "FluxPipeline")


@tiny_writer
def make_tiny_flux_kontext(out: Path, seed: int) -> None:
    """A tiny random FLUX.1-Kontext-dev diffusers folder.

    black-forest-labs/FLUX.1-Kontext-dev has exactly FLUX.1-dev's layout and architecture (the
    same component classes, scheduler and VAE; a FluxTransformer2DModel with guidance embedding);
    only model_index.json names the FluxKontextPipeline. So this is the tiny FLUX.1-dev with the
    Kontext pipeline named in its model_index.json."""
    _write(out, seed, "FluxKontextPipeline")


def _write(out: Path, seed: int, pipeline: str) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel, CLIPTokenizer, T5TokenizerFast

    clip_vocab = save_clip_tokenizer(out / "tokenizer", model_max_length=CLIP_MAX_LENGTH)
    t5_vocab = save_t5_tokenizer(out / "tokenizer_2", model_max_length=T5_MAX_LENGTH)

    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER)

    # Each component gets its own seed, so resizing one leaves the others' weights unchanged.
    with seeded(seed):
        text_encoder = CLIPTextModel(tiny_clip_text_config(clip_vocab, TEXT_DIM))
    with seeded(seed + 1):
        text_encoder_2 = tiny_t5_encoder(t5_vocab, TEXT_DIM, d_ff=80)
    with seeded(seed + 2):
        transformer = FluxTransformer2DModel.from_config(FLUX1_TINY)
    vae = colour_flux_vae()  # set, not drawn: its latents are the picture's colours

    # The real transformer (3 shards) and T5 (2 shards) come sharded with an index file: keep that,
    # so code that reads the weight files finds the same names as on the real repo.
    save_parts(out, save_exact_shards, DTYPE, scheduler, transformer=(transformer, 3),
               text_encoder_2=(text_encoder_2, 2), text_encoder=(text_encoder, 1), vae=(vae, 1))

    pipe = FluxPipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2,
        tokenizer=CLIPTokenizer.from_pretrained(out / "tokenizer"),
        tokenizer_2=T5TokenizerFast.from_pretrained(out / "tokenizer_2"), transformer=transformer)
    # transformers 5 folds T5TokenizerFast into T5Tokenizer; the real repo names the Fast class,
    # which every transformers version can load.
    save_model_index(pipe, out, _class_name=pipeline,
                     tokenizer_2=["transformers", "T5TokenizerFast"])


def write_bfl_single_file(folder: Path, file: Path, prefix: str = "") -> Path:
    """The transformer of a tiny FLUX.1 / Kontext / FLUX.2 diffusers folder as one safetensors file
    in Black Forest Labs' layout (`flux1-dev.safetensors`, `flux2-dev.safetensors`), each key
    after `prefix` ("model.diffusion_model." gives ComfyUI's layout), in the folder's dtype."""
    from dpipe.models.common.bfl_layout import save_bfl_file

    return save_bfl_file(Path(folder) / "transformer", file, prefix)
