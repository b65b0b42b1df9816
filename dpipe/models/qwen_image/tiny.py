"""Tiny random Qwen-Image, Qwen-Image-Edit and Qwen-Image-Edit-2511, written in the layouts of
Qwen/Qwen-Image, Qwen/Qwen-Image-Edit and Qwen/Qwen-Image-Edit-2511.

The same components and classes as the real model_index.json files: QwenImagePipeline
(FlowMatchEulerDiscreteScheduler, AutoencoderKLQwenImage, Qwen2_5_VLForConditionalGeneration,
Qwen2Tokenizer, QwenImageTransformer2DModel) and QwenImageEditPipeline (the same, plus a
Qwen2VLProcessor in processor/, whose image processor feeds the reference image to the
vision-language encoder), and QwenImageEditPlusPipeline (the same parts; its transformer sets
`zero_cond_t`, as 2511's does). bf16 safetensors with the large parts sharded; only the sizes shrink.
The tokenizer's merges make every word of the pipelines' prompt templates one token, as in the real
vocabulary, so the pipelines' fixed template lengths (34 and 64 tokens, which they cut off) hold.

Sizes: 64x64 images -> VAE (4x, 4 latent channels; the real one: 8x, 16) -> 16x16 latents -> 2x2
packing -> 64 image tokens of 16 channels; transformer 2 blocks of 2 heads x 16; text: Qwen2.5-VL
(hidden 32 = joint_attention_dim, 2 layers, a 2-block vision tower with the real 14-pixel patches).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dpipe.models.common.tiny_vae import tiny_qwen_image_vae
from dpipe.models.common.tiny_files import save_component, save_parts
from dpipe.models.common.tiny_qwen_vl import save_qwen25_vl_processor, tiny_qwen25_vl
from dpipe.models.common.tiny_qwen_tokenizer import save_qwen_tokenizer
from dpipe.models.qwen_image.sizes import QWEN_IMAGE_TINY, TEXT_DIM, Z_DIM
from dpipe.models.tiny_parts import save_model_index, seeded, tiny_writer

DTYPE = torch.bfloat16
# The real Qwen-Image scheduler: resolution-dependent (exponential) shift.
SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
                 max_shift=0.9, base_image_seq_len=256, max_image_seq_len=8192,
                 shift_terminal=0.02, time_shift_type="exponential")


@tiny_writer
def make_tiny_qwen_image(out: Path, seed: int) -> None:
    """A tiny random Qwen-Image (text-to-image) diffusers folder."""
    _write(out, seed, edit=False)


@tiny_writer
def make_tiny_qwen_image_edit(out: Path, seed: int) -> None:
    """A tiny random Qwen-Image-Edit diffusers folder."""
    _write(out, seed, edit=True)


@tiny_writer
def make_tiny_qwen_image_edit_plus(out: Path, seed: int) -> None:
    """A tiny random Qwen-Image-Edit-2511 diffusers folder (2509's layout but for the
    transformer's `zero_cond_t`, which 2511 sets)."""
    _write(out, seed, edit=True, plus=True)


def _write(out: Path, seed: int, edit: bool, plus: bool = False) -> None:
    from diffusers import (
        FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline,
        QwenImageEditPlusPipeline, QwenImagePipeline, QwenImageTransformer2DModel)
    from transformers import Qwen2Tokenizer

    added = save_qwen_tokenizer(out / "tokenizer", "qwen2.5-vl", model_max_length=131072)
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER)
    with seeded(seed):
        text_encoder = tiny_qwen25_vl(added, TEXT_DIM)
    with seeded(seed + 1):
        transformer = QwenImageTransformer2DModel.from_config(
            {**QWEN_IMAGE_TINY, **({"zero_cond_t": True} if plus else {})})
    with seeded(seed + 2):
        vae = tiny_qwen_image_vae(Z_DIM)

    save_parts(out, save_component, DTYPE, scheduler, transformer=(transformer, 3),
               text_encoder=(text_encoder, 2), vae=(vae, 1))
    tokenizer = Qwen2Tokenizer.from_pretrained(out / "tokenizer")
    parts = dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                 transformer=transformer)
    if edit:
        from dpipe.models.qwen_image.edit import load_processor

        save_qwen25_vl_processor(out / "processor")
        parts["processor"] = load_processor(out / "processor")
        pipe = (QwenImageEditPlusPipeline if plus else QwenImageEditPipeline)(**parts)
    else:
        pipe = QwenImagePipeline(**parts)
    # The processor named as in the real repo, whichever processor object stood in while writing.
    index = save_model_index(pipe, out, **(
        {"processor": ["transformers", "Qwen2VLProcessor"]} if edit else {}))
    assert index["text_encoder"] == ["transformers", "Qwen2_5_VLForConditionalGeneration"], index
