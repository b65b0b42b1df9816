"""Tiny stand-ins for the byte-level BPE tokenizers of LLaMA-3-style text encoders, and how to load
the real ones correctly with transformers 5.

HunyuanVideo's text encoder (llava-llama-3-8b) ships a Llama-3 `tokenizer.json`: byte-level BPE with
a regex split, a `<|begin_of_text|>` post-processor and chat special tokens. Its `model_index.json`
names the class `LlamaTokenizerFast`, which in transformers 5 is the SentencePiece-style
`LlamaTokenizer`: it replaces the file's byte-level pre-tokenizer with a Metaspace one and silently
drops every space (transformers issue #45488). `load_byte_level_tokenizer` loads the folder as
`PreTrainedTokenizerFast` instead, which keeps `tokenizer.json` as written.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from dpipe.models.tiny_parts import bytes_to_unicode, learn_bpe, tiny_corpus, write_json

# Llama-3's pre-tokenizer split (as in its tokenizer.json).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
                r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>")


def _llama3_pre_tokenizer():
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])


@lru_cache(maxsize=4)
def train_llama3_bpe(extra_text: tuple[str, ...] = (), num_merges: int = 768):
    """Byte-level BPE merges learnt (deterministically, see tiny_parts.learn_bpe) on the test
    captions plus `extra_text` (e.g. a prompt template), split exactly as Llama-3 splits text."""
    splitter = _llama3_pre_tokenizer()
    words: dict[tuple[str, ...], int] = {}
    for line in list(tiny_corpus()) + list(extra_text):
        for word, _ in splitter.pre_tokenize_str(line):
            key = tuple(word)
            words[key] = words.get(key, 0) + 1
    merges = learn_bpe(words, num_merges)
    vocab = list(bytes_to_unicode().values()) + ["".join(m) for m in merges]
    return tuple(vocab), merges


def save_llama3_tokenizer(directory: Path, extra_text: tuple[str, ...] = (),
                          tokenizer_class: str = "PreTrainedTokenizerFast") -> int:
    """Write a tokenizer folder laid out as a Llama-3 one (tokenizer.json, tokenizer_config.json,
    special_tokens_map.json). Returns the vocabulary size (specials included)."""
    vocab, merges = train_llama3_bpe(tuple(extra_text))
    ids = {t: i for i, t in enumerate(vocab)}
    tok = Tokenizer(models.BPE(vocab=ids, merges=list(merges), ignore_merges=True))
    tok.pre_tokenizer = _llama3_pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in LLAMA3_SPECIALS])
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
        special_tokens=[(bos, tok.token_to_id(bos))])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    special = {"bos_token": bos, "eos_token": "<|end_of_text|>", "pad_token": "<|end_of_text|>"}
    write_json(directory / "special_tokens_map.json", special)
    write_json(directory / "tokenizer_config.json", {
        **special,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 1000000000000000019884624838656,
        # HunyuanVideo crops the prompt template off the front and masks the end: right padding.
        "padding_side": "right",
        "tokenizer_class": tokenizer_class,
    })
    return tok.get_vocab_size()


def load_byte_level_tokenizer(directory: Path, **kwargs):
    """A Llama-3-style tokenizer folder, loaded so that its tokenizer.json is used as written."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(directory, **kwargs)
