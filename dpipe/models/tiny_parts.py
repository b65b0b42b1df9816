"""Pieces shared by the tiny random models of every family (see `dpipe/models/<family>/tiny.py`).

No weights can be downloaded in CI, so each family has a factory that writes a tiny random model in
exactly the on-disk layout of its real checkpoint; the real loading code then runs on it unchanged.
This module holds what those factories share: in-process trained tokenizers saved the way the real
repos ship them, seeded weight initialisation, and an atomic folder write.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import string
import uuid
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE, Unigram

_COLOURS = ["red", "green", "blue", "yellow", "orange", "purple", "pink", "black", "white", "gray",
            "brown", "cyan", "magenta", "golden", "silver"]
_SHAPES = ["circle", "square", "triangle", "star", "hexagon", "rectangle", "ring", "cross", "heart",
           "diamond", "line", "dot"]
_EXTRA = [
    "a photo of a cat sitting on a wooden table, high quality, detailed",
    "A painting of a dog in the park. An illustration, a 3d render, in the style of a sketch.",
    "The quick brown fox jumps over the lazy dog; portrait, landscape, close-up, blurry, sharp!",
    "Two small images: 1 2 3 4 5 6 7 8 9 0 (large) [small] {medium} - big & tiny? 'it's' \"quoted\"",
    "video frames of a person walking, camera moves left, right, up and down, zoom in, zoom out",
]
# CLIP's pre-tokenizer regex, as transformers' CLIPTokenizer rebuilds it: training with the same
# splits makes the learnt merges reproduce exactly when the saved vocab/merges are loaded back.
_CLIP_SPLIT = (r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|"""
               r"""[^\s\p{L}\p{N}]+""")
CLIP_BOS, CLIP_EOS = "<|startoftext|>", "<|endoftext|>"
T5_EXTRA_IDS = 100  # the sentinel tokens every T5 tokenizer (and FLUX's tokenizer_2) carries


def tiny_corpus() -> list[str]:
    """Caption-like sentences covering the words of test datasets ("a red circle on a blue
    background") and every letter and digit, so test captions tokenize without unknown tokens."""
    lines = []
    for i, shape in enumerate(_SHAPES):
        for j, colour in enumerate(_COLOURS):
            back = _COLOURS[(i + j + 1) % len(_COLOURS)]
            lines.append(f"a {colour} {shape} on a {back} background")
            lines.append(f"A photo of {'two' if j % 2 else 'three'} {colour} {shape}s")
    return lines + _EXTRA


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's byte -> printable character table; its order is the order of CLIP's vocab."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@lru_cache(maxsize=4)
def train_clip_bpe(num_merges: int = 512) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """Train a byte-level BPE with CLIP's normalizer, splits and "</w>" word-end suffix.

    Returns (vocab, merges) with vocab laid out as CLIP's: the 256 byte symbols, the same with
    "</w>", one token per merge in merge order, then <|startoftext|> and <|endoftext|> last. Keeping
    the special tokens at the top matters: CLIPTextModel configs with eos_token_id=2 (FLUX's among
    them) pool the hidden state at argmax(input_ids), which is the first eos only with this layout.
    """
    tok = Tokenizer(BPE(continuing_subword_prefix="", end_of_word_suffix="</w>"))
    tok.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_CLIP_SPLIT), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    alphabet = list(_bytes_to_unicode().values())
    trainer = trainers.BpeTrainer(
        vocab_size=2 * len(alphabet) + num_merges, show_progress=False, initial_alphabet=alphabet,
        continuing_subword_prefix="", end_of_word_suffix="</w>")
    tok.train_from_iterator(tiny_corpus(), trainer)
    merges = tuple(tuple(m.split(" ") if isinstance(m, str) else m)
                   for m in json.loads(tok.to_str())["model"]["merges"])
    vocab = alphabet + [c + "</w>" for c in alphabet] + ["".join(m) for m in merges]
    return tuple(vocab + [CLIP_BOS, CLIP_EOS]), merges


def save_clip_tokenizer(directory: Path, model_max_length: int = 77) -> int:
    """Write a CLIP tokenizer folder as openai/clip-vit-large-patch14 and FLUX's tokenizer/ ship it
    (vocab.json, merges.txt, tokenizer_config.json, special_tokens_map.json; no tokenizer.json),
    loadable by CLIPTokenizer and CLIPTokenizerFast. Returns the vocabulary size."""
    vocab, merges = train_clip_bpe()
    directory.mkdir(parents=True, exist_ok=True)
    _write_json(directory / "vocab.json", {t: i for i, t in enumerate(vocab)})
    (directory / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    special = {"lstrip": False, "normalized": True, "rstrip": False, "single_word": False}
    _write_json(directory / "special_tokens_map.json", {
        "bos_token": {"content": CLIP_BOS, **special},
        "eos_token": {"content": CLIP_EOS, **special},
        "pad_token": CLIP_EOS,
        "unk_token": {"content": CLIP_EOS, **special},
    })
    _write_json(directory / "tokenizer_config.json", {
        "add_prefix_space": False,
        "added_tokens_decoder": {str(vocab.index(t)): {"content": t, **special, "special": True}
                                 for t in (CLIP_BOS, CLIP_EOS)},
        "bos_token": CLIP_BOS,
        "clean_up_tokenization_spaces": True,
        "do_lower_case": True,
        "eos_token": CLIP_EOS,
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": CLIP_EOS,
        "tokenizer_class": "CLIPTokenizer",
        "unk_token": CLIP_EOS,
    })
    return len(vocab)


@lru_cache(maxsize=4)
def train_t5_unigram(vocab_size: int = 400) -> tuple[tuple[str, float], ...]:
    """Train a SentencePiece-style Unigram (Metaspace "▁" word starts) as T5 uses.

    T5's tokenizer is Unigram, not BPE, and transformers 5's T5Tokenizer rebuilds a Unigram model
    from tokenizer.json's vocab whatever that file says, so a BPE tokenizer.json cannot be used.
    Returns [(piece, log-prob)] in T5's order: <pad>=0, </s>=1, <unk>=2, the pieces, then
    <extra_id_99> ... <extra_id_0>.
    """
    tok = Tokenizer(Unigram())
    # The same splits T5Tokenizer puts in front of the model when it loads the folder.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
    ])
    # Unigram only keeps characters it saw; seed it with what captions use so none maps to <unk>.
    alphabet = sorted(set(string.ascii_letters + string.digits + string.punctuation))
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size, show_progress=False, special_tokens=["<pad>", "</s>", "<unk>"],
        unk_token="<unk>", initial_alphabet=alphabet)
    tok.train_from_iterator(tiny_corpus(), trainer)
    pieces = [tuple(p) for p in json.loads(tok.to_str())["model"]["vocab"]]
    return tuple(pieces + [(f"<extra_id_{i}>", 0.0) for i in reversed(range(T5_EXTRA_IDS))])


def save_t5_tokenizer(directory: Path, model_max_length: int = 512) -> int:
    """Write a T5 tokenizer folder as google/t5-v1_1-xxl and FLUX's tokenizer_2/ ship it
    (tokenizer.json, tokenizer_config.json, special_tokens_map.json; their spiece.model is not
    needed to load), loadable by T5TokenizerFast.from_pretrained. Returns the vocabulary size."""
    from transformers import T5Tokenizer

    vocab = list(train_t5_unigram())
    directory.mkdir(parents=True, exist_ok=True)
    # transformers' own T5 backend makes the tokenizer.json exactly as T5TokenizerFast reads it.
    T5Tokenizer(vocab=vocab, extra_ids=T5_EXTRA_IDS).backend_tokenizer.save(
        str(directory / "tokenizer.json"))
    # The configs in the layout the real repos have (written by transformers 4), which transformers
    # 5 saves differently ("extra_special_tokens", "backend"): loaders must cope with the real one.
    extras = [f"<extra_id_{i}>" for i in range(T5_EXTRA_IDS)]
    plain = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    decoder = {str(i): {"content": t, **plain, "special": True}
               for i, t in enumerate(["<pad>", "</s>", "<unk>"])}
    decoder.update({str(len(vocab) - 1 - i): {"content": t, **plain, "lstrip": True, "rstrip": True,
                                              "special": True} for i, t in enumerate(extras)})
    _write_json(directory / "special_tokens_map.json", {
        "additional_special_tokens": extras,
        "eos_token": {"content": "</s>", **plain},
        "pad_token": {"content": "<pad>", **plain},
        "unk_token": {"content": "<unk>", **plain},
    })
    _write_json(directory / "tokenizer_config.json", {
        "add_prefix_space": True,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": extras,
        "clean_up_tokenization_spaces": True,
        "eos_token": "</s>",
        "extra_ids": T5_EXTRA_IDS,
        "legacy": True,
        "model_max_length": model_max_length,
        "pad_token": "<pad>",
        "sp_model_kwargs": {},
        "tokenizer_class": "T5Tokenizer",
        "unk_token": "<unk>",
    })
    return len(vocab)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed torch's global RNG (which model constructors draw their initial weights from) for the
    block, restoring the caller's RNG state afterwards so building a tiny model has no side effect."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def round_up(n: int, multiple: int) -> int:
    """Embedding tables of real checkpoints are padded past the tokenizer (T5: 32100 -> 32128)."""
    return -(-n // multiple) * multiple


def write_atomically(target_dir: Path, writer_fn: Callable[[Path], None]) -> Path:
    """Build a folder with `writer_fn(tmp_dir)` in a temporary sibling, then rename it into place.

    A rename within one filesystem is atomic, so a reader sees either no folder or a complete one,
    and several processes creating the same tiny model at once (pytest-xdist workers, pipeline
    ranks) cannot interleave their files: the first rename wins, the losers discard their copies.
    """
    target_dir = Path(target_dir)
    target_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = target_dir.with_name(f".{target_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        tmp_dir.mkdir()
        writer_fn(tmp_dir)
        try:
            # Replaces an empty target dir too, so a pre-made empty output folder is fine.
            os.rename(tmp_dir, target_dir)
        except OSError:
            if not target_dir.is_dir():
                raise
            # Lost the race: the winner's folder is complete by construction.
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return target_dir


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
