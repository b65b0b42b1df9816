"""A tiny random HiDream-I1, written in the layout of HiDream-ai/HiDream-I1-Full (Dev, Fast: same).

The real repo: `HiDreamImagePipeline` in model_index.json, a FlowMatch scheduler, the sparse-MoE
`HiDreamImageTransformer2DModel` (16 dual-stream + 32 single-stream blocks, 4 routed experts with 2
active plus a shared one, patch 2, per-block projections of Llama hidden states), the FLUX VAE
(`AutoencoderKL`, 16 channels, scale 0.3611, shift 0.1159), two long-context CLIPs
(`CLIPTextModelWithProjection`, 248 positions) and T5-XXL. Llama-3.1-8B-Instruct (text encoder 4)
is not in that repo (Meta's license): users load it themselves. dpipe reads it from
`text_encoder_4/` and `tokenizer_4/` inside the model folder (a copy or a symlink of the Llama
folder); the tiny model puts a tiny Llama there, and model_index.json leaves both entries empty as
the real one does.

Not reproduced: the real vocabularies (the Llama tokenizer is a byte-level BPE learnt on the test
captions, as `dpipe.models.common.tiny_llama3_tokenizer` writes it).

Sizes: 64x64 images -> VAE (4x, 16 channels) -> 16x16 latents -> 2x2 patches -> 64 tokens of 32.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dpipe.models.common.shapes import round_up
from dpipe.models.common.tiny_files import save_exact_shards, save_parts
from dpipe.models.common.tiny_vae import tiny_flux_vae
from dpipe.models.hidream.sizes import (
    CLIP_G, CLIP_L, HIDREAM_TINY, LATENT_CHANNELS, LLAMA_DIM, LLAMA_LAYERS, T5_DIM)
from dpipe.models.tiny_parts import (
    save_clip_tokenizer, save_model_index, save_t5_tokenizer, seeded, tiny_clip_text_config,
    tiny_t5_encoder, tiny_writer)

TEXT_TOKENS = 128  # HiDreamImagePipeline's max_sequence_length for all four encoders
CLIP_POSITIONS = 248  # HiDream's CLIPs are long-context (Long-CLIP)


@tiny_writer
def make_tiny_hidream(out: Path, seed: int) -> None:
    """A tiny random HiDream-I1 folder (with a tiny Llama in text_encoder_4/)."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler, HiDreamImagePipeline, HiDreamImageTransformer2DModel)
    from transformers import (
        CLIPTextModelWithProjection, CLIPTokenizer, LlamaConfig, LlamaForCausalLM,
        T5TokenizerFast)

    from dpipe.models.common.tiny_llama3_tokenizer import save_llama3_tokenizer

    clip_vocab = save_clip_tokenizer(out / "tokenizer", model_max_length=CLIP_POSITIONS)
    save_clip_tokenizer(out / "tokenizer_2", model_max_length=CLIP_POSITIONS)
    t5_vocab = save_t5_tokenizer(out / "tokenizer_3", model_max_length=512)
    llama_vocab = save_llama3_tokenizer(out / "tokenizer_4")
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    with seeded(seed):
        text_encoder = CLIPTextModelWithProjection(
            tiny_clip_text_config(clip_vocab, CLIP_L, positions=CLIP_POSITIONS))
    with seeded(seed + 1):
        text_encoder_2 = CLIPTextModelWithProjection(
            tiny_clip_text_config(clip_vocab, CLIP_G, heads=3, positions=CLIP_POSITIONS))
    with seeded(seed + 2):
        text_encoder_3 = tiny_t5_encoder(t5_vocab, T5_DIM, d_ff=64)
    with seeded(seed + 3):
        text_encoder_4 = LlamaForCausalLM(LlamaConfig(
            vocab_size=round_up(llama_vocab, 64), hidden_size=LLAMA_DIM, intermediate_size=64,
            num_hidden_layers=LLAMA_LAYERS, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
            bos_token_id=llama_vocab - 5, eos_token_id=llama_vocab - 4))
    with seeded(seed + 4):
        transformer = HiDreamImageTransformer2DModel.from_config(HIDREAM_TINY)
    with seeded(seed + 5):
        vae = tiny_flux_vae(LATENT_CHANNELS)

    save_parts(out, save_exact_shards, torch.float32, scheduler, transformer=(transformer, 1),
               vae=(vae, 1), text_encoder=(text_encoder, 1), text_encoder_2=(text_encoder_2, 1),
               text_encoder_3=(text_encoder_3, 1), text_encoder_4=(text_encoder_4, 1))
    pipe = HiDreamImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder,
        tokenizer=CLIPTokenizer.from_pretrained(out / "tokenizer"), text_encoder_2=text_encoder_2,
        tokenizer_2=CLIPTokenizer.from_pretrained(out / "tokenizer_2"),
        text_encoder_3=text_encoder_3, tokenizer_3=T5TokenizerFast.from_pretrained(out / "tokenizer_3"),
        text_encoder_4=None, tokenizer_4=None, transformer=transformer)
    save_model_index(pipe, out, tokenizer_3=["transformers", "T5TokenizerFast"])


def write_single_file(folder: Path, file: Path, prefix: str = "") -> Path:
    """The transformer of the tiny folder at `folder` as one file as ComfyUI holds HiDream-I1
    (hidream_i1_full_fp16.safetensors: the original module names, which are diffusers'), keys
    behind `prefix` ("model.diffusion_model." as ComfyUI saves it)."""
    from dpipe.models.single_file import write_transformer_file

    return write_transformer_file(Path(folder) / "transformer", file, dict, prefix)
