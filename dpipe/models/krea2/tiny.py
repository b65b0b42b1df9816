"""Tiny random Krea 2, written in the layout `Krea2Pipeline.save_pretrained` gives a converted
Krea 2 checkpoint: model_index.json (with the pipeline's `text_encoder_select_layers`,
`is_distilled` and `patch_size`), scheduler/, vae/ (AutoencoderKLQwenImage), text_encoder/
(transformers' Qwen3VLModel), tokenizer/ (a Qwen tokenizer) and transformer/
(Krea2Transformer2DModel). bf16 safetensors with the large parts sharded; only the sizes shrink.

The tokenizer's merges make every word of the Qwen-Image prompt template one token, as in the
real vocabulary, so the pipeline's fixed template lengths (a 34-token prefix it drops, a 5-token
suffix after the padding) hold.

Sizes: 64x64 images -> VAE (4x, 4 latent channels; the real one: 8x, 16) -> 16x16 latents -> 2x2
packing -> 64 image tokens of 16 channels; transformer 2 blocks of 2 heads x 16 (1 key/value
head); text: Qwen3-VL with 4 decoder layers of width 32, three hidden states tapped (the real
pipeline taps 12 of Qwen3-VL-4B's 37).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dpipe.models.common.tiny_vae import tiny_qwen_image_vae
from dpipe.models.common.tiny_files import save_component, save_parts
from dpipe.models.common.tiny_qwen_tokenizer import save_qwen_tokenizer
from dpipe.models.common.tiny_qwen_vl import tiny_qwen3_vl_config
from dpipe.models.krea2.sizes import KREA2_TINY, SELECT_LAYERS, TEXT_DIM, Z_DIM
from dpipe.models.tiny_parts import seeded, tiny_writer

DTYPE = torch.bfloat16
# The scheduler config the pipeline's docstring requires: dynamic (exponential) shifting with the
# Krea 2 parameters.
SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
                 max_shift=1.15, base_image_seq_len=256, max_image_seq_len=6400)


@tiny_writer
def make_tiny_krea2(out: Path, seed: int) -> None:
    """A tiny random Krea 2 diffusers folder."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler, Krea2Pipeline,
        Krea2Transformer2DModel)
    from transformers import Qwen2Tokenizer, Qwen3VLModel

    added = save_qwen_tokenizer(out / "tokenizer", "qwen3", model_max_length=262144)
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER)
    with seeded(seed):
        text_encoder = Qwen3VLModel(tiny_qwen3_vl_config(added, TEXT_DIM, layers=4))
    with seeded(seed + 1):
        transformer = Krea2Transformer2DModel.from_config(KREA2_TINY)
        # The zero-initialised modulation tables and norm scales would make a random model
        # blind to parts of its input: small random values, as a trained checkpoint has.
        for name, param in transformer.named_parameters():
            if "scale_shift_table" in name or name.endswith("norm.weight") or ".norm" in name:
                param.data.normal_(0.0, 0.1)
    with seeded(seed + 2):
        vae = tiny_qwen_image_vae(Z_DIM)

    save_parts(out, save_component, DTYPE, scheduler, transformer=(transformer, 3),
               text_encoder=(text_encoder, 2), vae=(vae, 1))
    tokenizer = Qwen2Tokenizer.from_pretrained(out / "tokenizer")
    Krea2Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                  transformer=transformer, text_encoder_select_layers=SELECT_LAYERS,
                  is_distilled=False, patch_size=2).save_config(out)
