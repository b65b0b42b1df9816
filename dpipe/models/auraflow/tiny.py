"""A tiny random AuraFlow, written in the layout of fal/AuraFlow (v0.1-v0.3).

The real repo: `AuraFlowPipeline` in model_index.json, a FlowMatchEulerDiscreteScheduler (shift
1.73), an `AuraFlowTransformer2DModel` (4 joint MMDiT blocks + 32 single DiT blocks, patch 2), the
SDXL VAE (`AutoencoderKL`, 4 latent channels, scaling 0.13025, no shift) and Pile-T5-XL as a
`UMT5EncoderModel` with a SentencePiece-style Llama tokenizer (`LlamaTokenizerFast`, 32k pieces plus
T5's sentinels). Everything the loaders look at is kept; only the sizes shrink.

Not reproduced: the real tokenizer's exact pieces and files (tokenizer.model) -- this one is a
byte-fallback BPE learnt on the test captions, saved as tokenizer.json, with the special-token ids
of Pile-T5 (`</s>`=2 ends a prompt, `<pad>`=1 pads it); the fp16 `variant` files of v0.3.

Sizes: 64x64 images -> VAE (4x downscale, 4 channels) -> 16x16 latents -> 2x2 patches -> 64 image
tokens of width 32, plus 8 register tokens and the prompt's tokens (UMT5 d_model 32).
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache
from pathlib import Path

import torch

from dpipe.models.common.shapes import round_up
from dpipe.models.common.tiny_files import save_exact_shards, save_parts
from dpipe.models.common.tiny_vae import tiny_sdxl_vae
from dpipe.models.tiny_parts import (
    learn_bpe, save_model_index, seeded, tiny_corpus, tiny_writer)

LATENT_CHANNELS = 4
TEXT_DIM = 32  # UMT5 d_model = transformer joint_attention_dim
HEADS, HEAD_DIM = 2, 16  # inner dim 32 = caption_projection_dim (register tokens share it)
MAX_TOKENS = 256  # AuraFlowPipeline's default max_sequence_length
SP = "\u2581"  # SentencePiece's word-start marker


@tiny_writer
def make_tiny_auraflow(out: Path, seed: int) -> None:
    """A tiny random AuraFlow diffusers folder."""
    from diffusers import (
        AuraFlowPipeline, AuraFlowTransformer2DModel, FlowMatchEulerDiscreteScheduler)
    from transformers import LlamaTokenizerFast, UMT5Config, UMT5EncoderModel

    vocab_size = save_sentencepiece_bpe_tokenizer(out / "tokenizer", MAX_TOKENS)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.73)
    with seeded(seed):
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=round_up(vocab_size, 128), d_model=TEXT_DIM, d_kv=16, d_ff=64,
            num_layers=2, num_heads=2, feed_forward_proj="gated-silu", layer_norm_epsilon=1e-6,
            relative_attention_num_buckets=32, relative_attention_max_distance=128,
            pad_token_id=1, eos_token_id=2, decoder_start_token_id=0))
    with seeded(seed + 1):
        transformer = AuraFlowTransformer2DModel(
            sample_size=16, patch_size=2, in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS,
            num_mmdit_layers=2, num_single_dit_layers=2, attention_head_dim=HEAD_DIM,
            num_attention_heads=HEADS, joint_attention_dim=TEXT_DIM,
            caption_projection_dim=HEADS * HEAD_DIM,
            pos_embed_max_size=256)  # a 16x16 grid of patch positions: up to 128x128 pixels
    with seeded(seed + 2):
        vae = tiny_sdxl_vae()  # the SDXL VAE's design, as the real one

    # fp32; the transformer in two files, as the real one is sharded.
    save_parts(out, save_exact_shards, torch.float32, scheduler, transformer=(transformer, 2),
               text_encoder=(text_encoder, 1), vae=(vae, 1))
    pipe = AuraFlowPipeline(
        tokenizer=LlamaTokenizerFast.from_pretrained(out / "tokenizer"), text_encoder=text_encoder,
        vae=vae, transformer=transformer, scheduler=scheduler)
    # As the real repo names it.
    save_model_index(pipe, out, tokenizer=["transformers", "LlamaTokenizerFast"])


# ---- a SentencePiece-style BPE tokenizer (Llama / Pile-T5 layout) ------------------------------

@lru_cache(maxsize=2)
def train_sentencepiece_bpe(num_merges: int = 400) -> tuple[list[str], list[tuple[str, str]]]:
    """(vocab, merges) of a byte-fallback BPE over `tiny_corpus()` words written as "▁word".

    Layout as Llama/Pile-T5's: <unk>=0, <pad>=1, </s>=2, the 256 byte pieces <0x00>..<0xFF>, single
    characters, then one piece per merge. Ties between equally frequent pairs go to the smallest
    pair, so every process learns the same tokenizer.
    """
    words = Counter(SP + w for line in tiny_corpus() for w in line.split())
    chars = sorted({c for w in words for c in w} | set(map(chr, range(33, 127))))
    merges = list(learn_bpe({tuple(w): n for w, n in words.items()}, num_merges))
    vocab = ["<unk>", "<pad>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + chars
    seen = set(vocab)
    for a, b in merges:
        if a + b not in seen:
            vocab.append(a + b)
            seen.add(a + b)
    return vocab, merges


def save_sentencepiece_bpe_tokenizer(directory: Path, model_max_length: int) -> int:
    """Write a LlamaTokenizerFast folder (tokenizer.json + configs) that ends each prompt with
    </s> and pads with <pad>, as AuraFlow's Pile-T5 tokenizer does. Returns the vocabulary size."""
    from transformers import LlamaTokenizerFast

    vocab, merges = train_sentencepiece_bpe()
    tok = LlamaTokenizerFast(
        vocab={t: i for i, t in enumerate(vocab)}, merges=list(merges), unk_token="<unk>",
        bos_token=None, eos_token="</s>", pad_token="<pad>", add_bos_token=False,
        add_eos_token=True, model_max_length=model_max_length, padding_side="right")
    tok.save_pretrained(directory)
    return len(vocab)


def write_single_file(folder: Path, file: Path, prefix: str = "") -> Path:
    """The transformer of the tiny folder at `folder` as one file in fal's original layout
    (the transformer of aura_flow_0.3.safetensors: original names), keys behind `prefix`
    ("model.diffusion_model." as ComfyUI's checkpoints have them)."""
    from dpipe.models.auraflow.comfyui import native_state_dict
    from dpipe.models.single_file import write_transformer_file

    return write_transformer_file(Path(folder) / "transformer", file, native_state_dict, prefix)
