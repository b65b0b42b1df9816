"""Tiny Qwen tokenizers (Qwen2.5-VL for Qwen-Image, Qwen3 for Z-Image), saved as the real repos ship them.

Both are GPT-2-style byte-level BPE (`Qwen2Tokenizer`) with the same pre-tokenizer regex; they differ
only in their added tokens and chat template. The merges are learnt on `tiny_corpus()` with the
Qwen splits (deterministic, as in `dpipe.models.tiny_parts`), the byte alphabet comes first as in
the real vocab, and the special tokens follow the BPE vocabulary in the real order, so ids such as
`<|image_pad|>` sit at the end of the vocabulary as they do at 151655 in the real one.
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache
from pathlib import Path

from tokenizers import Regex, normalizers, pre_tokenizers

from dpipe.models.tiny_parts import bytes_to_unicode, learn_bpe, tiny_corpus, write_json

# transformers' Qwen2Tokenizer pre-tokenizer (the real tokenizer.json has the same regex).
QWEN_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")

# Added tokens in the order of the real Qwen2 / Qwen2.5-VL vocab (151643 ...); `special` as there.
QWEN2_ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False),
]
# Qwen3 adds these after them.
_QWEN3_EXTRA = [("<tool_response>", False), ("</tool_response>", False), ("<think>", False),
                ("</think>", False)]

# The text-only part of the Qwen chat templates: system / user / assistant turns and the generation
# prompt. The real templates also render tools and images; Qwen3's `enable_thinking=False` inserts
# an empty think block, as here.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# QwenImagePipeline's and QwenImageEditPipeline's prompt templates, and Qwen3 chat turns.
TEMPLATES = [
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
    "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
    "<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
    "objects, background), then explain how the user's text instruction should alter or modify the "
    "image. Generate a new image that meets the user's requirements while maintaining consistency "
    "with the original input where appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|>"
    "<|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n",
    "You are a helpful assistant.",
]


# The pipelines' prompt templates, twice (BPE merges need a pair to occur twice): each of their
# words becomes one token as in the real vocab, so the templates have their real token counts,
# which the pipelines rely on (they drop the first 34 or 64 tokens of the encoding).
_TEMPLATE_LINES = tuple(t.replace("{}", "") for t in TEMPLATES) * 2


@lru_cache(maxsize=2)
def train_qwen_bpe(num_merges: int = 512, extra_lines: tuple[str, ...] = _TEMPLATE_LINES
                   ) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """(vocab, merges): the 256 byte symbols, then one token per merge, learnt on `tiny_corpus()`
    plus `extra_lines` (the chat-template words) split as Qwen splits text."""
    splitter = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    normalizer = normalizers.NFC()
    lines = tiny_corpus() + list(extra_lines)
    words = Counter(word for line in lines
                    for word, _ in splitter.pre_tokenize_str(normalizer.normalize_str(line)))
    merges = learn_bpe({tuple(w): n for w, n in words.items()}, num_merges)
    vocab = list(bytes_to_unicode().values()) + ["".join(m) for m in merges]
    return tuple(vocab), merges


def save_vocab_files(directory: Path, vocab, merges, added: list[str]) -> dict[str, int]:
    """vocab.json, merges.txt and the backend (tokenizer.json, as transformers builds it from
    vocab and merges) of a Qwen tokenizer, with the `added` tokens after the vocabulary.
    Returns {added token: id}."""
    from transformers import Qwen2Tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    vocab_ids = {t: i for i, t in enumerate(vocab)}
    write_json(directory / "vocab.json", vocab_ids)
    (directory / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    tok = Qwen2Tokenizer(vocab=vocab_ids, merges=list(merges))
    tok.add_tokens(added)
    tok.backend_tokenizer.save(str(directory / "tokenizer.json"))
    return {t: len(vocab) + i for i, t in enumerate(added)}


def save_qwen_tokenizer(directory: Path, flavor: str, model_max_length: int = 131072) -> dict[str, int]:
    """Write a Qwen tokenizer folder (vocab.json, merges.txt, tokenizer.json, tokenizer_config.json)
    as Qwen-Image's tokenizer/ (flavor "qwen2.5-vl") or Z-Image's tokenizer/ (flavor "qwen3") ship
    it. Returns {token: id} of the added tokens; the vocabulary size is the largest id + 1."""
    if flavor not in ("qwen2.5-vl", "qwen3"):
        raise ValueError(f"unknown Qwen tokenizer flavor {flavor!r}")
    vocab, merges = train_qwen_bpe()
    added = QWEN2_ADDED + (_QWEN3_EXTRA if flavor == "qwen3" else [])
    ids = save_vocab_files(directory, vocab, merges, [t for t, _ in added])
    plain = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(ids[t]): {"content": t, **plain, "special": s} for t, s in added},
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
                                      "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
                                      "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                                      "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
                                      "<|video_pad|>"],
        "bos_token": None,
        "chat_template": QWEN3_CHAT_TEMPLATE if flavor == "qwen3" else QWEN2_VL_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>" if flavor == "qwen3" else "<|endoftext|>",
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    write_json(directory / "tokenizer_config.json", config)
    return ids
