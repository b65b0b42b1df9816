"""Tiny random Ideogram 4, written in the layout `Ideogram4Pipeline.save_pretrained` gives it:
model_index.json, scheduler/, vae/ (AutoencoderKLFlux2 with its BatchNorm statistics),
text_encoder/ (transformers' Qwen3VLModel), tokenizer/ (a Qwen3 tokenizer with its chat
template), transformer/ and unconditional_transformer/ (two Ideogram4Transformer2DModel: the
pipeline's asymmetric guidance runs a separate unconditional model). bf16 safetensors with the
large parts sharded; only the sizes shrink. The optional prompt enhancer head is left out, as the
pipeline allows: dpipe trains prompts as given.

Sizes: 64x64 images -> VAE (4x, 4 latent channels; the real Flux 2 VAE: 8x, 32) -> 16x16 ->
2x2 patches -> 64 image tokens of 16 channels; transformer 2 blocks of 2 heads x 16; text:
Qwen3-VL with 36 decoder layers of width 16 (the pipeline taps layers 0, 3, ..., 33, 35 of the
real 36, a fixed list, so the depth stays), 13 x 16 = 208 text features per token.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dpipe.models.common.tiny_vae import tiny_flux2_vae
from dpipe.models.common.tiny_files import save_component, save_parts
from dpipe.models.common.tiny_qwen_tokenizer import save_qwen_tokenizer
from dpipe.models.common.tiny_qwen_vl import tiny_qwen3_vl_config
from dpipe.models.ideogram4.sizes import IDEOGRAM4_TINY, TEXT_DIM, Z_DIM
from dpipe.models.tiny_parts import seeded, tiny_writer

TEXT_LAYERS = 36  # as Qwen3-VL-8B: the pipeline's tapped layers go up to 35
DTYPE = torch.bfloat16
# The pipeline replaces the sigmas (its logit-normal schedule), so only an unshifted scheduler
# keeps them as given.
# Qwen3-VL-Instruct's chat template, reduced to what the pipeline renders: one user turn whose
# content is a list of typed parts, the text parts concatenated (images, videos and tools, which
# the real template also handles, never occur), then the assistant prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)


def _transformer(seed: int):
    from diffusers import Ideogram4Transformer2DModel

    with seeded(seed):
        return Ideogram4Transformer2DModel.from_config(IDEOGRAM4_TINY)


@tiny_writer
def make_tiny_ideogram4(out: Path, seed: int) -> None:
    """A tiny random Ideogram 4 diffusers folder."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Ideogram4Pipeline
    from transformers import Qwen2Tokenizer, Qwen3VLModel

    added = save_qwen_tokenizer(out / "tokenizer", "qwen3", model_max_length=262144)
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER)
    with seeded(seed):
        text_encoder = Qwen3VLModel(tiny_qwen3_vl_config(added, TEXT_DIM, TEXT_LAYERS, mlp=32,
                                                         vision_blocks=1))
    transformer, unconditional = _transformer(seed + 1), _transformer(seed + 3)
    with seeded(seed + 2):
        vae = tiny_flux2_vae(Z_DIM)

    save_parts(out, save_component, DTYPE, scheduler, transformer=(transformer, 2),
               unconditional_transformer=(unconditional, 2), text_encoder=(text_encoder, 2),
               vae=(vae, 1))
    tokenizer = Qwen2Tokenizer.from_pretrained(out / "tokenizer")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out / "tokenizer")
    Ideogram4Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                      tokenizer=tokenizer, transformer=transformer,
                      unconditional_transformer=unconditional).save_config(out)
