"""Pieces shared by the tiny random models of every family (see `dpipe/models/<family>/tiny.py`).

No weights can be downloaded in CI, so each family has a factory that writes a tiny random model in
exactly the on-disk layout of its real checkpoint; the real loading code then runs on it unchanged.
This module holds what those factories share: in-process trained tokenizers saved the way the real
repos ship them, the tiny CLIP, T5 and Mistral 3 text encoders, seeded weight initialisation,
the index files (model_index.json, modular_model_index.json) and the write-once decorator
`tiny_writer`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import shutil
import string
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, normalizers, pre_tokenizers

from dpipe.errors import ConfigError
from dpipe.models import tiny_stamp

log = logging.getLogger(__name__)

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
    """Caption-like sentences with the words of test datasets ("a red circle on a blue
    background"), so test captions tokenize into whole-word tokens as real captions do."""
    lines = []
    for i, shape in enumerate(_SHAPES):
        for j, colour in enumerate(_COLOURS):
            back = _COLOURS[(i + j + 1) % len(_COLOURS)]
            lines.append(f"a {colour} {shape} on a {back} background")
            lines.append(f"A photo of {'two' if j % 2 else 'three'} {colour} {shape}s")
    return lines + _EXTRA


def bytes_to_unicode() -> dict[int, str]:
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
    """Learn a byte-level BPE on `tiny_corpus()`, split exactly as CLIP splits text.

    Returns (vocab, merges) with vocab laid out as CLIP's: the 256 byte symbols, the same with
    "</w>", one token per merge in merge order, then <|startoftext|> and <|endoftext|> last. Keeping
    the special tokens at the top matters: CLIPTextModel configs with eos_token_id=2 (FLUX's among
    them) pool the hidden state at argmax(input_ids), which is the first eos only with this layout.
    """
    # The normalizer and splits transformers' CLIPTokenizer rebuilds on load, so the learnt merges
    # apply to the same words when the saved vocab/merges are read back.
    normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()])
    splitter = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_CLIP_SPLIT), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    words = Counter(word for line in tiny_corpus()
                    for word, _ in splitter.pre_tokenize_str(normalizer.normalize_str(line)))
    merges = learn_bpe({(*w[:-1], w[-1] + "</w>"): n for w, n in words.items()}, num_merges)
    alphabet = list(bytes_to_unicode().values())
    vocab = alphabet + [c + "</w>" for c in alphabet] + ["".join(m) for m in merges]
    return tuple(vocab + [CLIP_BOS, CLIP_EOS]), merges


def learn_bpe(words: dict[tuple[str, ...], int], num_merges: int) -> tuple[tuple[str, str], ...]:
    """Textbook BPE: merge the most frequent adjacent pair, again and again.

    Written out rather than using `tokenizers.trainers.BpeTrainer`, which breaks ties between
    equally frequent pairs in hash order and so learns different merges in different processes;
    here ties go to the smallest pair, so every process writes the same tokenizer.
    """
    merges = []
    for _ in range(num_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for symbols, n in words.items():
            for pair in zip(symbols, symbols[1:]):
                pairs[pair] += n
        best = min(pairs, key=lambda p: (-pairs[p], p), default=None)
        if best is None or pairs[best] < 2:
            break
        merges.append(best)
        words = {_apply_merge(symbols, best): n for symbols, n in words.items()}
    return tuple(merges)


def _apply_merge(symbols: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(symbols):
        if symbols[i:i + 2] == pair:
            out.append(symbols[i] + symbols[i + 1])
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return tuple(out)


def save_clip_tokenizer(directory: Path, model_max_length: int = 77, pad: str = CLIP_EOS,
                        pad_entry: bool = False) -> int:
    """Write a CLIP tokenizer folder as openai/clip-vit-large-patch14 and FLUX's tokenizer/ ship it
    (vocab.json, merges.txt, tokenizer_config.json, special_tokens_map.json; no tokenizer.json),
    loadable by CLIPTokenizer and CLIPTokenizerFast. Returns the vocabulary size. `pad` "!" (id
    0): OpenCLIP bigG's (SDXL's and SD3's tokenizer_2), which special_tokens_map.json names by a
    full token entry in SDXL's folder (`pad_entry`)."""
    vocab, merges = train_clip_bpe()
    directory.mkdir(parents=True, exist_ok=True)
    write_json(directory / "vocab.json", {t: i for i, t in enumerate(vocab)})
    (directory / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    special = {"lstrip": False, "normalized": True, "rstrip": False, "single_word": False}
    write_json(directory / "special_tokens_map.json", {
        "bos_token": {"content": CLIP_BOS, **special},
        "eos_token": {"content": CLIP_EOS, **special},
        "pad_token": {"content": pad, **special, "normalized": False} if pad_entry else pad,
        "unk_token": {"content": CLIP_EOS, **special},
    })
    write_json(directory / "tokenizer_config.json", {
        "add_prefix_space": False,
        "added_tokens_decoder": {  # the real file has exactly this normalized true/false mix
            str(len(vocab) - 2): {"content": CLIP_BOS, **special, "special": True},
            str(len(vocab) - 1): {"content": CLIP_EOS, **special, "normalized": False,
                                  "special": True},
        },
        "bos_token": CLIP_BOS,
        "clean_up_tokenization_spaces": True,
        "do_lower_case": True,
        "eos_token": CLIP_EOS,
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": pad,
        "tokenizer_class": "CLIPTokenizer",
        "unk_token": CLIP_EOS,
    })
    return len(vocab)


@lru_cache(maxsize=4)
def train_t5_unigram() -> tuple[tuple[str, float], ...]:
    """Estimate a SentencePiece-style Unigram vocabulary on `tiny_corpus()`, split as T5 splits.

    T5's tokenizer is Unigram, not BPE, and transformers 5's T5Tokenizer rebuilds a Unigram model
    from tokenizer.json's vocab whatever that file says, so a BPE tokenizer.json cannot be used.
    The pieces are the corpus's words ("▁red") and single characters, scored by their log
    frequency: a plain count, not `tokenizers.trainers.UnigramTrainer`, whose output depends on
    hash order and differs between processes. Returns [(piece, log-prob)] in T5's order:
    <pad>=0, </s>=1, <unk>=2, pieces by falling score, then <extra_id_99> ... <extra_id_0>.
    """
    # The splits T5Tokenizer puts in front of the model when it loads the folder.
    splitter = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
    ])
    words = Counter(w for line in tiny_corpus() for w, _ in splitter.pre_tokenize_str(line))
    chars: Counter[str] = Counter()
    for word, n in words.items():
        for c in word:
            chars[c] += n
    # Unigram cannot spell a character it has no piece for: give every printable ASCII one, so no
    # caption character maps to <unk>.
    chars.update(set(string.ascii_letters + string.digits + string.punctuation) - set(chars))
    counts = words + chars  # disjoint: every word starts with "▁" and has a character after it
    total = sum(counts.values())
    pieces = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    specials = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    extras = [(f"<extra_id_{i}>", 0.0) for i in reversed(range(T5_EXTRA_IDS))]
    return tuple(specials + [(p, math.log(n / total)) for p, n in pieces] + extras)


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
    write_json(directory / "special_tokens_map.json", {
        "additional_special_tokens": extras,
        "eos_token": {"content": "</s>", **plain},
        "pad_token": {"content": "<pad>", **plain},
        "unk_token": {"content": "<unk>", **plain},
    })
    write_json(directory / "tokenizer_config.json", {
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


# FLUX.1-dev's scheduler config, which Chroma1-HD and FLUX.2 ship too: the shift grows with the
# image token count.
FLUX_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                      base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                      max_image_seq_len=4096)


def tiny_clip_text_config(vocab_size: int, width: int, heads: int = 2, act: str = "quick_gelu",
                          positions: int = 77):
    """The CLIPTextConfig of a tiny 2-layer CLIP text encoder of `width` (MLP 4x, projection
    `width`) for `save_clip_tokenizer`'s vocabulary: CLIP-L's quick GELU, or OpenCLIP bigG's
    "gelu"."""
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=width, intermediate_size=4 * width,
        num_hidden_layers=2, num_attention_heads=heads, max_position_embeddings=positions,
        hidden_act=act, projection_dim=width,
        # The real configs' legacy ids: eos_token_id=2 makes CLIP pool at argmax(input_ids),
        # i.e. at the first <|endoftext|>, which the tokenizer puts at the top of its vocab.
        bos_token_id=0, eos_token_id=2, pad_token_id=1)


def tiny_t5_encoder(vocab_size: int, width: int, d_ff: int, d_kv: int = 16, v1_1: bool = True,
                    umt5: bool = False):
    """A random T5EncoderModel (UMT5EncoderModel, `umt5`) of 2 layers of 2 heads with T5's
    relative-position buckets, for a tokenizer of `vocab_size` tokens (seed torch first). Laid
    out as t5-v1_1's and UMT5's (gated GELU, untied embeddings) or, `v1_1` false, as T5 v1.0's
    (T5-11B, Cosmos' encoder: ReLU, tied). The vocabulary is padded to a multiple of 128, as
    t5-v1_1-xxl's is (32100 tokens, 32128)."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    from dpipe.models.common.shapes import round_up

    config = dict(vocab_size=round_up(vocab_size, 128), d_model=width, d_ff=d_ff, d_kv=d_kv,
                  num_heads=2, num_layers=2, num_decoder_layers=2,
                  feed_forward_proj="gated-gelu" if v1_1 else "relu",
                  relative_attention_num_buckets=32, relative_attention_max_distance=128,
                  layer_norm_epsilon=1e-6, tie_word_embeddings=not v1_1, pad_token_id=0,
                  eos_token_id=1, decoder_start_token_id=0)
    if umt5:
        return UMT5EncoderModel(UMT5Config(**config))
    return T5EncoderModel(T5Config(**config))


def tiny_mistral3_config(width: int, layers: int, image_token: int, text: dict[str, Any],
                         **extra: Any):
    """The Mistral3Config of FLUX.2's and ERNIE-Image's tiny text encoders: a Mistral language
    model of `layers` layers of `width` (MLP 2x, 2 heads of width / 2, 1 key/value head) with the
    `text` config keys (vocabulary, token ids, ...), and a 1-block Pixtral vision tower for
    32-pixel images in 8-pixel patches. `extra`: further Mistral3Config keys."""
    from transformers import Mistral3Config

    return Mistral3Config(
        text_config={"model_type": "mistral", "hidden_size": width, "intermediate_size": 2 * width,
                     "num_hidden_layers": layers, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "head_dim": width // 2, "rms_norm_eps": 1e-5,
                     "tie_word_embeddings": False, **text},
        vision_config={"model_type": "pixtral", "hidden_size": 16, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "intermediate_size": 32, "image_size": 32,
                       "patch_size": 8, "num_channels": 3, "head_dim": 8},
        image_token_index=image_token, spatial_merge_size=2, vision_feature_layer=-1,
        projector_hidden_act="gelu", multimodal_projector_bias=False, **extra)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed torch's global RNG (which model constructors draw their initial weights from) for the
    block, restoring the caller's RNG state afterwards so building a tiny model has no side effect."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


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


def write_once(path: Path, marker: str, writer_fn: Callable[[Path], None], writer: str) -> Path:
    """The tiny model folder at `path`, written by `writer_fn(tmp_dir)` (atomically) unless it is
    already there as this dpipe writes it, which its `marker` file (model_index.json, ...) and
    its stamp (`tiny_stamp`) tell. A folder that another dpipe wrote is written again; a folder
    with other files and no marker is not overwritten: it is refused, naming `writer` (the
    function that writes such tiny models)."""
    path = Path(path)
    complete = (path / marker).is_file()
    if complete and not tiny_stamp.needs_writing(path):
        return path
    if complete:  # written by another dpipe: set aside, then deleted, and written again below
        log.info("%s was written by another dpipe version; writing it again", path)
        aside = path.with_name(f".{path.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        with contextlib.suppress(FileNotFoundError):  # another process set it aside first
            os.rename(path, aside)
        shutil.rmtree(aside, ignore_errors=True)
    elif path.is_dir() and any(path.iterdir()):
        raise FileExistsError(
            f"{path} exists but has no {marker}, so it is not a tiny model written by"
            f" {writer}; delete it or choose another folder")

    def write_stamped(tmp: Path) -> None:
        writer_fn(tmp)
        tiny_stamp.write_stamp(tmp, writer)

    return write_atomically(path, write_stamped)


def write_json(path: Path, obj: object) -> None:
    """`obj` as a tokenizer's JSON files are written: indented, non-ASCII kept."""
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def tiny_writer(write: Callable[..., None] | None = None, *, marker: str = "model_index.json"):
    """Decorator of a tiny model's writer `write(out, seed, ...)`, which fills the empty folder
    `out`: the decorated name is `make(path, seed=0, ...) -> path`, which writes the folder at
    `path` once (`write_once`; its `marker` file tells a complete one)."""
    if write is None:
        return functools.partial(tiny_writer, marker=marker)

    @functools.wraps(write)
    def make(path: Path, seed: int = 0, *args: Any, **kwargs: Any) -> Path:
        return write_once(path, marker, lambda tmp: write(tmp, seed, *args, **kwargs),
                          write.__name__)

    return make


def named_variant(path: Path, prefix: str, variants: dict[str, Any], family: str,
                  key: str = "model.path") -> str:
    """The variant a tiny folder's name gives (`prefix` + variant, model.tiny=true) of a family
    whose tiny writer writes several; `key` is the setting that names the folder."""
    variant = path.name.removeprefix(prefix)
    if variant not in variants:
        raise ConfigError(f"{key}={path}: a tiny {family} folder is named {prefix}<variant>, "
                          f"with a variant in {sorted(variants)}")
    return variant


def write_config(path: Path, obj: object) -> None:
    """`obj` as diffusers writes its configs (model_index.json, config.json): indented, keys
    sorted."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def save_model_index(pipe, out: Path, **entries: Any) -> dict[str, Any]:
    """model_index.json as `pipe.save_pretrained` writes it, with `entries` set over it (where the
    real repo names another class than transformers 5 does, or lists slots the pipeline leaves
    out); returns the index."""
    pipe.save_config(out)
    index = {**json.loads((out / "model_index.json").read_text()), **entries}
    if entries:
        write_config(out / "model_index.json", index)
    return index


def save_modular_index(out: Path, pipeline: str, blocks: str, repo: str,
                       components: dict[str, tuple[str, str]]) -> None:
    """modular_model_index.json of a modular-pipeline repo: each component ({name: (library,
    class)}) with its loading spec, the subfolder of the hub `repo` (a local download keeps the
    hub's; diffusers loads every component found in the folder from the folder)."""
    index: dict[str, Any] = {"_blocks_class_name": blocks, "_class_name": pipeline,
                             "_diffusers_version": "0.42.1"}
    for name, (library, cls) in components.items():
        index[name] = [library, cls, {"pretrained_model_name_or_path": repo, "revision": None,
                                      "subfolder": name, "type_hint": [library, cls],
                                      "variant": None}]
    write_config(out / "modular_model_index.json", index)
