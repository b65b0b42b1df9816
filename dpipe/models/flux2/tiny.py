"""A tiny random FLUX.2-dev, in the diffusers layout of black-forest-labs/FLUX.2-dev.

CI cannot download the real checkpoint, so tests run the real loading code
(`Flux2Pipeline.from_pretrained`, `Flux2Transformer2DModel.from_pretrained(subfolder=...)`) on this
folder. Kept as in the real repo: the component classes in model_index.json; the text encoder is a
`Mistral3ForConditionalGeneration` (Mistral language model + Pixtral vision tower, as Mistral Small
3.1) whose `tokenizer` is a `PixtralProcessor` with a Mistral-style chat template ([SYSTEM_PROMPT],
[INST], [IMG] tokens); the language model has 30 layers, because Flux2Pipeline stacks the hidden
states of layers 10, 20 and 30; the VAE is an `AutoencoderKLFlux2` whose latents are 2x2-patchified
and normalised by its BatchNorm running statistics (random here, so the normalisation is not an
identity); transformer and text encoder weights are sharded with index files.

Not reproduced: the real tokenizer is Mistral's "tekken" byte-level BPE with 131k tokens; this one
is a byte-level BPE learnt on the test captions and the pipeline's system message, saved as a
tokenizers `tokenizer.json` (loaded by PreTrainedTokenizerFast), so prompts go through the same
chat template, special tokens, padding and truncation code.

Sizes: 64x64 images -> VAE (4x downscale, 4 latent channels) -> 16x16 -> 2x2 patches -> 8x8
latents of 16 channels -> 64 image tokens; text: hidden 16 x 3 stacked layers = 48 channels.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from dpipe.models.common.tiny_vae import tiny_flux2_vae
from dpipe.models.common.tiny_files import save_exact_shards, save_parts
from dpipe.models.tiny_parts import (
    FLUX_SCHEDULER, save_model_index, seeded, tiny_corpus, tiny_mistral3_config, tiny_writer,
    write_config)

LATENT_CHANNELS = 4
TEXT_HIDDEN = 16
TEXT_LAYERS = 30  # Flux2Pipeline reads hidden_states[10], [20] and [30]
DTYPE = torch.bfloat16
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]",
                  "[/SYSTEM_PROMPT]", "[IMG]", "[IMG_BREAK]", "[IMG_END]", "<pad>"]
# Mistral Small 3.1's chat format for the messages Flux2Pipeline builds (a system message, then
# user messages whose content is a list of text/image parts).
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}"
    "{%- set parts = [{'type': 'text', 'text': message['content']}] %}"
    "{%- else %}{%- set parts = message['content'] %}{%- endif %}"
    "{%- if message['role'] == 'system' %}"
    "{{- '[SYSTEM_PROMPT]' }}{%- for p in parts %}{{- p['text'] }}{%- endfor %}"
    "{{- '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}"
    "{{- '[INST]' }}{%- for p in parts %}"
    "{%- if p['type'] == 'text' %}{{- p['text'] }}{%- else %}{{- '[IMG]' }}{%- endif %}"
    "{%- endfor %}{{- '[/INST]' }}"
    "{%- else %}"
    "{%- for p in parts %}{{- p['text'] }}{%- endfor %}{{- eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
)


@tiny_writer
def make_tiny_flux2(out: Path, seed: int) -> None:
    """A tiny random FLUX.2-dev diffusers folder."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler, Flux2Pipeline,
        Flux2Transformer2DModel)
    from transformers import Mistral3ForConditionalGeneration

    tokenizer = save_processor(out / "tokenizer")
    vocab_size = len(tokenizer)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    token_ids = dict(bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"])

    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER)
    with seeded(seed):
        text_encoder = Mistral3ForConditionalGeneration(tiny_mistral3_config(
            TEXT_HIDDEN, TEXT_LAYERS, ids["[IMG]"], dict(
                vocab_size=vocab_size, max_position_embeddings=1024, rope_theta=1000000000.0,
                sliding_window=None, **token_ids), **token_ids))
    with seeded(seed + 1):
        transformer = Flux2Transformer2DModel(
            patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=2, num_single_layers=2,
            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=3 * TEXT_HIDDEN,
            timestep_guidance_channels=256, mlp_ratio=3.0, axes_dims_rope=(4, 4, 4, 4),
            rope_theta=2000, guidance_embeds=True)
    with seeded(seed + 2):
        vae = tiny_flux2_vae(LATENT_CHANNELS)

    save_parts(out, save_exact_shards, DTYPE, scheduler, transformer=(transformer, 3),
               text_encoder=(text_encoder, 2), vae=(vae, 1))
    pipe = Flux2Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                         tokenizer=tokenizer, transformer=transformer)
    # As the real repo names it.
    save_model_index(pipe, out, tokenizer=["transformers", "PixtralProcessor"])


def save_processor(directory: Path):
    """Write a PixtralProcessor folder (tokenizer files, chat_template.jinja, processor and image
    processor configs) around a byte-level BPE tokenizer with Mistral's special tokens, and return
    the tokenizer. The processor's own files are written as JSON: building a PixtralProcessor
    object needs torchvision, which dpipe does not require (it only ever encodes text with it)."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from dpipe.models.tiny_parts import bytes_to_unicode, learn_bpe

    split = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # The system message starts every prompt: weighted so that its words become single tokens
    # (as in the real vocabulary) and a short max_sequence_length still reaches the caption.
    lines = tiny_corpus() + SYSTEM_MESSAGE.splitlines() * 8
    words = Counter(w for line in lines for w, _ in split.pre_tokenize_str(line))
    merges = learn_bpe({tuple(w): n for w, n in words.items()}, 600)
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for token in list(bytes_to_unicode().values()) + ["".join(m) for m in merges]:
        vocab.setdefault(token, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=list(merges), fuse_unk=False))
    backend.pre_tokenizer = split
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>", model_max_length=131072, padding_side="right")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)  # tokenizer.json, configs, chat_template.jinja
    write_config(directory / "processor_config.json", {
        "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]",
        "image_token": "[IMG]", "patch_size": 8, "processor_class": "PixtralProcessor",
        "spatial_merge_size": 2})
    write_config(directory / "preprocessor_config.json", {
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_processor_type": "PixtralImageProcessor",
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "patch_size": {"height": 8, "width": 8}, "resample": 3,
        "rescale_factor": 0.00392156862745098, "size": {"longest_edge": 64}})
    return tokenizer

