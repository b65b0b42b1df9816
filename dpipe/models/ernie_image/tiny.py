"""Tiny random ERNIE-Image, written in the layout of baidu/ERNIE-Image: model_index.json
(ErnieImagePipeline), scheduler/, vae/ (AutoencoderKLFlux2, with its BatchNorm statistics),
text_encoder/ (transformers' Mistral3Model: a Mistral language model and a Pixtral vision tower),
tokenizer/ (a tokenizers `tokenizer.json`, class TokenizersBackend as the real one names it) and
transformer/ (ErnieImageTransformer2DModel), bf16 safetensors with the large parts sharded. The
optional prompt enhancer (pe/, pe_tokenizer/) is left out: dpipe encodes prompts as given
(`use_pe=False`), and the pipeline loads without it.

Not reproduced: the real tokenizer is Mistral's 131k-token "tekken" byte-level BPE; this one is a
byte-level BPE learnt on the test captions with Mistral's <unk>/<s>/</s> at ids 0-2 and a
post-processor that puts <s> first, as tekken's does, so `encode_prompt` (add_special_tokens,
truncation at model_max_length) runs the same code.

Sizes: 64x64 images -> VAE (4x, 4 latent channels) -> 16x16 -> 2x2 patchify -> 8x8 latents of 16
channels (the pipeline's vae_scale_factor 8; the real one 16 with 128 channels) -> 64 image
tokens; transformer 2 blocks of 2 heads x 16; text: Mistral with 3 layers of width 32, the
pipeline reads hidden_states[-2].
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dpipe.models.common.tiny_vae import tiny_flux2_vae
from dpipe.models.common.tiny_files import save_component, save_parts
from dpipe.models.common.tiny_llama3_tokenizer import train_llama3_bpe
from dpipe.models.tiny_parts import seeded, tiny_mistral3_config, tiny_writer

LATENT_CHANNELS = 4  # the VAE's (32 in the real one); the transformer sees 4x after patchify
TEXT_DIM = 32  # Mistral hidden size = the transformer's text_in_dim
DTYPE = torch.bfloat16
SPECIALS = ("<unk>", "<s>", "</s>", "<pad>", "[IMG]")  # Mistral's order: bos 1, eos 2
# A fixed shift, no dynamic shifting: the pipeline passes no mu, so a real config has none; the
# real shift value is not confirmed offline (3.0 here).
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)


def save_tokenizer(directory: Path) -> int:
    """A byte-level BPE tokenizer folder with Mistral's special tokens; returns its size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab_tokens, merges = train_llama3_bpe()
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for token in vocab_tokens:
        vocab.setdefault(token, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges), ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
              "model_max_length": 1000000000000000019884624838656,
              "tokenizer_class": "TokenizersBackend", "clean_up_tokenization_spaces": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok.get_vocab_size()


@tiny_writer
def make_tiny_ernie_image(out: Path, seed: int) -> None:
    """A tiny random ERNIE-Image diffusers folder."""
    from diffusers import (
        ErnieImagePipeline, ErnieImageTransformer2DModel,
        FlowMatchEulerDiscreteScheduler)
    from transformers import AutoTokenizer, Mistral3Model

    from dpipe.models.ernie_image.sizes import ERNIE_IMAGE_TINY  # imports this module's sizes

    vocab = save_tokenizer(out / "tokenizer")
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER)
    with seeded(seed):
        text_encoder = Mistral3Model(tiny_mistral3_config(
            TEXT_DIM, 3, SPECIALS.index("[IMG]"), dict(
                vocab_size=vocab, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)))
    with seeded(seed + 1):
        transformer = ErnieImageTransformer2DModel.from_config(ERNIE_IMAGE_TINY)
        # The modulation and output projections start at zero: a random model would output
        # zeros and ignore its input; small random values, as a trained checkpoint has.
        for name, param in transformer.named_parameters():
            if name.startswith(("adaLN_modulation", "final_linear")):
                param.data.normal_(0.0, 0.1)
    with seeded(seed + 2):
        vae = tiny_flux2_vae(LATENT_CHANNELS)

    save_parts(out, save_component, DTYPE, scheduler, transformer=(transformer, 2),
               text_encoder=(text_encoder, 1), vae=(vae, 1))
    tokenizer = AutoTokenizer.from_pretrained(out / "tokenizer")
    ErnieImagePipeline(transformer=transformer, vae=vae, text_encoder=text_encoder,
                       tokenizer=tokenizer, scheduler=scheduler).save_config(out)
