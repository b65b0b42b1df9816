"""A tiny random Z-Image, written in the layout of Tongyi-MAI/Z-Image-Turbo.

Same components and classes as the real repo's model_index.json (ZImagePipeline:
FlowMatchEulerDiscreteScheduler, AutoencoderKL, Qwen3Model, Qwen2Tokenizer,
ZImageTransformer2DModel), bf16 safetensors, the transformer and text encoder sharded with index
files; only the sizes shrink. The tokenizer is a small byte-level BPE with Qwen's added tokens and a
chat template reduced to text turns (see `dpipe.models.common.tiny_qwen_tokenizer`).

Sizes: 64x64 images -> VAE (4x, 4 latent channels) -> 16x16 latents -> 2x2 patches -> 64 image
tokens of width 32; text: Qwen3 (hidden 32, 2 layers; the pipeline takes the second-to-last hidden
state). 2 noise-refiner, 2 context-refiner and 2 main blocks.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dpipe.models.common.shapes import round_up
from dpipe.models.common.tiny_files import save_component, save_parts
from dpipe.models.common.tiny_qwen_tokenizer import save_qwen_tokenizer
from dpipe.models.common.tiny_vae import tiny_flux_vae
from dpipe.models.tiny_parts import save_model_index, seeded, tiny_writer
from dpipe.models.z_image.sizes import LATENT_CHANNELS, TEXT_DIM, Z_IMAGE_TINY

DTYPE = torch.bfloat16  # as the real repo stores its weights


@tiny_writer
def make_tiny_z_image(out: Path, seed: int) -> None:
    """A tiny random Z-Image diffusers folder."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel)
    from transformers import AutoTokenizer, Qwen3Config, Qwen3Model

    added = save_qwen_tokenizer(out / "tokenizer", "qwen3", model_max_length=40960)
    vocab = max(added.values()) + 1

    # Z-Image-Turbo's scheduler: a fixed shift of 3, no resolution-dependent shift.
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0,
                                                use_dynamic_shifting=False)
    with seeded(seed):
        text_encoder = Qwen3Model(Qwen3Config(
            vocab_size=round_up(vocab, 128), hidden_size=TEXT_DIM, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            bos_token_id=added["<|endoftext|>"], eos_token_id=added["<|im_end|>"]))
    with seeded(seed + 1):
        transformer = ZImageTransformer2DModel.from_config(Z_IMAGE_TINY)
        # Zero-initialised in the real class: random here, so tests see them at work.
        torch.nn.init.normal_(transformer.x_pad_token, std=0.5)
        torch.nn.init.normal_(transformer.cap_pad_token, std=0.5)
    with seeded(seed + 2):
        vae = tiny_flux_vae(LATENT_CHANNELS)

    save_parts(out, save_component, DTYPE, scheduler, transformer=(transformer, 2),
               text_encoder=(text_encoder, 3), vae=(vae, 1))

    pipe = ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                          tokenizer=AutoTokenizer.from_pretrained(out / "tokenizer"),
                          transformer=transformer)
    index = save_model_index(pipe, out)
    assert index["tokenizer"] == ["transformers", "Qwen2Tokenizer"], index
    assert index["text_encoder"] == ["transformers", "Qwen3Model"], index


def write_single_file(folder: Path, file: Path, prefix: str = "") -> Path:
    """The tiny folder's transformer as the original single file holds it (`z_image_turbo_bf16`:
    the original names, `comfyui.native_state_dict`), bf16, each key after `prefix`."""
    from dpipe.models.single_file import write_transformer_file
    from dpipe.models.z_image.comfyui import native_state_dict

    return write_transformer_file(folder / "transformer", file, native_state_dict, prefix, DTYPE)
