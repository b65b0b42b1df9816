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

import json
from pathlib import Path

from dpipe.models.common.shapes import round_up
from dpipe.models.common.tiny_vae import tiny_flux_vae
from dpipe.models.tiny_parts import (
    save_clip_tokenizer, save_t5_tokenizer, seeded, tiny_t5_config, write_once)

LATENT_CHANNELS = 16
CLIP_L, CLIP_G, T5_DIM, LLAMA_DIM = 32, 48, 32, 32
LLAMA_LAYERS = 4
TEXT_TOKENS = 128  # HiDreamImagePipeline's max_sequence_length for all four encoders
CLIP_POSITIONS = 248  # HiDream's CLIPs are long-context (Long-CLIP)


def make_tiny_hidream(path: Path, seed: int = 0) -> Path:
    """Write (once) a tiny random HiDream-I1 folder (with a tiny Llama in text_encoder_4/)."""
    return write_once(path, "model_index.json", lambda tmp: _write(tmp, seed), "make_tiny_hidream")


def _write(out: Path, seed: int) -> None:
    from diffusers import (
        FlowMatchEulerDiscreteScheduler, HiDreamImagePipeline,
        HiDreamImageTransformer2DModel)
    from transformers import (
        CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer, LlamaConfig, LlamaForCausalLM,
        T5Config, T5EncoderModel, T5TokenizerFast)

    from dpipe.models.common.tiny_llama3_tokenizer import save_llama3_tokenizer

    clip_vocab = save_clip_tokenizer(out / "tokenizer", model_max_length=CLIP_POSITIONS)
    save_clip_tokenizer(out / "tokenizer_2", model_max_length=CLIP_POSITIONS)
    t5_vocab = save_t5_tokenizer(out / "tokenizer_3", model_max_length=512)
    llama_vocab = save_llama3_tokenizer(out / "tokenizer_4")
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)

    def clip(width: int, heads: int) -> CLIPTextConfig:
        return CLIPTextConfig(
            vocab_size=clip_vocab, hidden_size=width, intermediate_size=4 * width,
            num_hidden_layers=2, num_attention_heads=heads, max_position_embeddings=CLIP_POSITIONS,
            hidden_act="quick_gelu", projection_dim=width, bos_token_id=0, eos_token_id=2,
            pad_token_id=1)

    with seeded(seed):
        text_encoder = CLIPTextModelWithProjection(clip(CLIP_L, 2))
    with seeded(seed + 1):
        text_encoder_2 = CLIPTextModelWithProjection(clip(CLIP_G, 3))
    with seeded(seed + 2):
        text_encoder_3 = T5EncoderModel(T5Config(**tiny_t5_config(
            round_up(t5_vocab, 128), T5_DIM, d_ff=64)))
    with seeded(seed + 3):
        text_encoder_4 = LlamaForCausalLM(LlamaConfig(
            vocab_size=round_up(llama_vocab, 64), hidden_size=LLAMA_DIM, intermediate_size=64,
            num_hidden_layers=LLAMA_LAYERS, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
            bos_token_id=llama_vocab - 5, eos_token_id=llama_vocab - 4))
    with seeded(seed + 4):
        transformer = HiDreamImageTransformer2DModel(
            patch_size=2, in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_layers=2,
            num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
            caption_channels=[T5_DIM, LLAMA_DIM], text_emb_dim=CLIP_L + CLIP_G,
            num_routed_experts=4, num_activated_experts=2, axes_dims_rope=(8, 4, 4),
            max_resolution=(32, 32), llama_layers=list(range(LLAMA_LAYERS)))
    with seeded(seed + 5):
        vae = tiny_flux_vae(LATENT_CHANNELS)

    scheduler.save_pretrained(out / "scheduler")
    transformer.save_pretrained(out / "transformer")
    vae.save_pretrained(out / "vae")
    for name, model in (("text_encoder", text_encoder), ("text_encoder_2", text_encoder_2),
                        ("text_encoder_3", text_encoder_3), ("text_encoder_4", text_encoder_4)):
        model.save_pretrained(out / name)
    pipe = HiDreamImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder,
        tokenizer=CLIPTokenizer.from_pretrained(out / "tokenizer"), text_encoder_2=text_encoder_2,
        tokenizer_2=CLIPTokenizer.from_pretrained(out / "tokenizer_2"),
        text_encoder_3=text_encoder_3, tokenizer_3=T5TokenizerFast.from_pretrained(out / "tokenizer_3"),
        text_encoder_4=None, tokenizer_4=None, transformer=transformer)
    pipe.save_config(out)
    index = json.loads((out / "model_index.json").read_text())
    index["tokenizer_3"] = ["transformers", "T5TokenizerFast"]
    (out / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_single_file(folder: Path, file: Path, prefix: str = "") -> Path:
    """The transformer of the tiny folder at `folder` as one file as ComfyUI holds HiDream-I1
    (hidream_i1_full_fp16.safetensors: the original module names, which are diffusers'), keys
    behind `prefix` ("model.diffusion_model." as ComfyUI saves it)."""
    from dpipe.models.single_file import write_transformer_file

    return write_transformer_file(Path(folder) / "transformer", file, dict, prefix)
