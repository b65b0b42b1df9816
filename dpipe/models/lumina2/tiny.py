"""A tiny random Lumina-Image 2.0, written in the layout of Alpha-VLLM/Lumina-Image-2.0.

Same components and classes as the real model_index.json (Lumina2Pipeline:
FlowMatchEulerDiscreteScheduler, AutoencoderKL, Gemma2Model, GemmaTokenizerFast,
Lumina2Transformer2DModel), bf16 safetensors with the large parts sharded; only the sizes shrink.
The tokenizer is a small BPE with byte fallback in Gemma's form ("▁" for spaces, <bos> first,
<pad>/<eos>/<bos>/<unk>/<mask> at ids 0-4), whose merges are learnt on the test captions and the
pipeline's system prompt. Not reproduced: tokenizer.model (tokenizer.json suffices to load).

Sizes: 64x64 images -> VAE (8x, as Lumina2Pipeline assumes; 4 latent channels) -> 8x8 latents ->
2x2 patches -> 16 image tokens of width 48 (2 heads of 24, 1 key/value head as the real model's
grouped-query attention); text: Gemma 2 (hidden 32, 2 layers). 2 context-refiner, 2 noise-refiner
and 2 main blocks.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from dpipe.models.common.shapes import round_up
from dpipe.models.common.tiny_files import save_component, save_parts
from dpipe.models.common.tiny_vae import tiny_flux_vae
from dpipe.models.lumina2.sizes import LATENT_CHANNELS, TEXT_DIM, LUMINA2_TINY
from dpipe.models.tiny_parts import (
    learn_bpe, save_model_index, seeded, tiny_corpus, tiny_writer, write_json)

DTYPE = torch.bfloat16
# Lumina2Pipeline's default system prompt: in the tokenizer's corpus so that it costs few tokens.
SYSTEM_PROMPT = ("You are an assistant designed to generate superior images with the superior degree"
                 " of image-text alignment based on textual prompts or user prompts.")
_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]


def save_gemma_tokenizer(directory: Path, model_max_length: int = 8192) -> int:
    """A Gemma-style tokenizer folder (tokenizer.json, tokenizer_config.json,
    special_tokens_map.json), loadable by GemmaTokenizer(Fast). Returns the vocabulary size."""
    from transformers import GemmaTokenizer

    # Gemma turns spaces into "▁" and does not split words; merges are learnt within "▁word"
    # pieces here, so that tokens stay word-sized as Gemma's are.
    lines = tiny_corpus() + [SYSTEM_PROMPT + " <Prompt Start> "] * 4
    seqs = Counter(tuple(w) for line in lines
                   for w in line.replace(" ", " ▁").split(" ") if w)
    merges = learn_bpe(dict(seqs), 600)
    vocab = {t: i for i, t in enumerate(_SPECIAL)}
    for b in range(256):  # byte fallback pieces, as in Gemma's vocab
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in sorted({c for s in seqs for c in s}):
        vocab.setdefault(ch, len(vocab))
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = GemmaTokenizer(vocab=vocab, merges=list(merges), add_bos_token=True)
    directory.mkdir(parents=True, exist_ok=True)
    tok.backend_tokenizer.save(str(directory / "tokenizer.json"))
    plain = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    write_json(directory / "special_tokens_map.json", {
        "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"],
        "bos_token": {"content": "<bos>", **plain}, "eos_token": {"content": "<eos>", **plain},
        "pad_token": {"content": "<pad>", **plain}, "unk_token": {"content": "<unk>", **plain},
    })
    write_json(directory / "tokenizer_config.json", {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": {str(i): {"content": t, **plain, "special": True}
                                 for i, t in enumerate(_SPECIAL)},
        "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"],
        "bos_token": "<bos>",
        "clean_up_tokenization_spaces": False,
        "eos_token": "<eos>",
        "model_max_length": model_max_length,
        "pad_token": "<pad>",
        "padding_side": "left",  # as Gemma's; Lumina2Pipeline sets "right"
        "sp_model_kwargs": {},
        "spaces_between_special_tokens": False,
        "tokenizer_class": "GemmaTokenizer",
        "unk_token": "<unk>",
        "use_default_system_prompt": False,
    })
    return len(vocab)


@tiny_writer
def make_tiny_lumina2(out: Path, seed: int) -> None:
    """A tiny random Lumina 2 diffusers folder."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler, Lumina2Pipeline, Lumina2Transformer2DModel)
    from transformers import AutoTokenizer, Gemma2Config, Gemma2Model

    vocab = save_gemma_tokenizer(out / "tokenizer")
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=6.0)
    with seeded(seed):
        text_encoder = Gemma2Model(Gemma2Config(
            vocab_size=round_up(vocab, 128), hidden_size=TEXT_DIM, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            max_position_embeddings=8192, query_pre_attn_scalar=16, sliding_window=64,
            pad_token_id=0, eos_token_id=1, bos_token_id=2))
    with seeded(seed + 1):
        transformer = Lumina2Transformer2DModel.from_config(LUMINA2_TINY)
    with seeded(seed + 2):
        vae = tiny_flux_vae(LATENT_CHANNELS, levels=4)  # Lumina2Pipeline hard-codes 8x

    save_parts(out, save_component, DTYPE, scheduler, transformer=(transformer, 2),
               text_encoder=(text_encoder, 2), vae=(vae, 1))

    pipe = Lumina2Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                           tokenizer=AutoTokenizer.from_pretrained(out / "tokenizer"),
                           transformer=transformer)
    # The real repo names the Fast class (transformers 5 folds it into GemmaTokenizer).
    save_model_index(pipe, out, tokenizer=["transformers", "GemmaTokenizerFast"])
