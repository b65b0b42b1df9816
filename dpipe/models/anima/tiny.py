"""A tiny random Anima, written in the layout of circlestone-labs/Anima-Base-v1.0-Diffusers.

That repo is a modular-pipeline folder: `modular_model_index.json` (AnimaModularPipeline) names
each component with its loading spec (the hub repo and its subfolder), and the components sit in
their subfolders: `transformer` (CosmosTransformer3DModel, Cosmos-Predict2-2B-Text2Image's
architecture), `text_conditioner` (AnimaTextConditioner, the "LLM adapter"), `text_encoder`
(Qwen3Model, Qwen3-0.6B), `tokenizer` (Qwen2Tokenizer), `t5_tokenizer` (T5TokenizerFast: only
its token ids are used, as the adapter's queries), `vae` (AutoencoderKLQwenImage, the Wan 2.1
VAE's architecture, 8x spatial) and `scheduler` (FlowMatchEulerDiscreteScheduler). The index
points at the hub repo, as a local download (`hf download --local-dir`) keeps it; diffusers loads
every component found in the folder from the folder. Only the sizes shrink; weights are bf16,
the transformer and text encoder sharded with index files.

Sizes: 64x64 images -> 8x8 latents -> 2x2 patches -> 16 tokens; the adapter's output is padded
to 512 tokens as the real one (`min_sequence_length`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dpipe.models.common.shapes import round_up
from dpipe.models.common.tiny_files import save_component, save_parts
from dpipe.models.common.tiny_qwen_tokenizer import save_qwen_tokenizer
from dpipe.models.tiny_parts import save_modular_index, save_t5_tokenizer, seeded, tiny_writer

REPO = "circlestone-labs/Anima-Base-v1.0-Diffusers"
QWEN_DIM = 32  # Qwen3 hidden size (1024 in Qwen3-0.6B) = the adapter's source_dim
TEXT_DIM = 32  # the adapter's output = the transformer's text_embed_dim (1024 in the real one)
DTYPE = torch.bfloat16
# The schedule: a fixed shift of 3 (ComfyUI's and the Anima model card's sampling shift).
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)

TRANSFORMER = dict(
    in_channels=16, out_channels=16, num_attention_heads=2, attention_head_dim=16, num_layers=2,
    mlp_ratio=2.0, text_embed_dim=TEXT_DIM, adaln_lora_dim=8, max_size=(128, 240, 240),
    patch_size=(1, 2, 2), rope_scale=(1.0, 4.0, 4.0), concat_padding_mask=True,
    extra_pos_embed_type=None)
TEXT_CONDITIONER = dict(
    source_dim=QWEN_DIM, target_dim=TEXT_DIM, model_dim=32, num_layers=2, num_attention_heads=2,
    mlp_ratio=2.0, use_self_attention=True, use_layer_norm=False, min_sequence_length=512)
COMPONENTS = {  # name -> (library, class), as modular_model_index.json lists them
    "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
    "t5_tokenizer": ("transformers", "T5TokenizerFast"),
    "text_conditioner": ("diffusers", "AnimaTextConditioner"),
    "text_encoder": ("transformers", "Qwen3Model"),
    "tokenizer": ("transformers", "Qwen2Tokenizer"),
    "transformer": ("diffusers", "CosmosTransformer3DModel"),
    "vae": ("diffusers", "AutoencoderKLQwenImage"),
}


@tiny_writer(marker="modular_model_index.json")
def make_tiny_anima(out: Path, seed: int) -> None:
    """A tiny random Anima folder."""
    from diffusers import (AnimaTextConditioner, AutoencoderKLQwenImage, CosmosTransformer3DModel,
                           FlowMatchEulerDiscreteScheduler)
    from transformers import Qwen3Config, Qwen3Model

    added = save_qwen_tokenizer(out / "tokenizer", "qwen3", model_max_length=131072)
    t5_vocab = save_t5_tokenizer(out / "t5_tokenizer", model_max_length=512)
    with seeded(seed):
        text_encoder = Qwen3Model(Qwen3Config(
            vocab_size=round_up(max(added.values()) + 1, 128), hidden_size=QWEN_DIM,
            intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6,
            rope_theta=1_000_000.0, tie_word_embeddings=True,
            bos_token_id=added["<|endoftext|>"], eos_token_id=added["<|endoftext|>"]))
    with seeded(seed + 1):
        # The real adapter's vocabulary is T5's (32128): every T5 token id has a query embedding.
        conditioner = AnimaTextConditioner(**TEXT_CONDITIONER,
                                           target_vocab_size=round_up(t5_vocab, 128))
    with seeded(seed + 2):
        transformer = CosmosTransformer3DModel(**TRANSFORMER)
    with seeded(seed + 3):
        vae = AutoencoderKLQwenImage(
            base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
            temperal_downsample=[False, True, True])
    save_parts(out, save_component, DTYPE, FlowMatchEulerDiscreteScheduler(**SCHEDULER),
               transformer=(transformer, 2), text_conditioner=(conditioner, 1),
               text_encoder=(text_encoder, 2), vae=(vae, 1))
    save_modular_index(out, "AnimaModularPipeline", "AnimaAutoBlocks", REPO, COMPONENTS)


# Anima's single file (circlestone-labs/Anima split_files/diffusion_models/*.safetensors, as
# ComfyUI loads it): the transformer under NVIDIA's Cosmos names and the adapter under
# `llm_adapter.`, with `net.` in front.
def write_single_file(folder: Path, file: Path, prefix: str = "net.") -> Path:
    """The tiny folder's transformer and text adapter as Anima's single file, bf16."""
    from safetensors.torch import save_file

    from dpipe.models.anima.comfyui import original_state_dict
    from dpipe.models.anima.model import load_anima_denoiser

    denoiser = load_anima_denoiser(folder, None, torch.float32)
    tensors = {prefix + k: v.to(DTYPE).contiguous()
               for k, v in original_state_dict(denoiser.state_dict()).items()}
    save_file(tensors, file, metadata={"format": "pt"})
    return file
