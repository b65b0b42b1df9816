"""Captions: .txt and JSON/JSONL files, several per file, prefix, tag shuffling, dropout, and
what happens to a file without one."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from dpipe.data.batches import choose_texts
from dpipe.data.captions import caption_variants
from dpipe.data.discover import directories, discover
from dpipe.data.prepare import Layout, prepare
from dpipe.errors import DataError
from tests.unit.test_data_support import FakeSpec, dataset_config, write_image


def _captions(tmp_path, **settings):
    cfg = dataset_config(path=str(tmp_path / "data"), **settings)
    found = discover(directories(cfg), tmp_path / "cache", False)
    return {i.path.rsplit("/", 1)[-1]: i.captions for i in found.items}, found


def test_json_captions_file_with_several_captions_and_txt_fallback(tmp_path):
    data = tmp_path / "data"
    write_image(data / "cat.png", caption=None)
    write_image(data / "sub" / "dog.png", caption=None)
    write_image(data / "owl.png", caption="an owl")
    (data / "captions.json").write_text(json.dumps(
        {"cat.png": ["a cat", "a tabby cat"], "sub/dog.png": "a dog"}))
    got, _ = _captions(tmp_path, captions_file="captions.json", caption_prefix="photo, ")
    assert got == {"cat.png": ["photo, a cat", "photo, a tabby cat"], "dog.png": ["photo, a dog"],
                   "owl.png": ["photo, an owl"]}


def test_jsonl_captions_file(tmp_path):
    data = tmp_path / "data"
    write_image(data / "cat.png", caption=None)
    write_image(data / "dog.png", caption=None)
    (data / "caps.jsonl").write_text(
        '{"file": "cat.png", "caption": "a cat"}\n\n{"image": "dog.png", "captions": ["a", "b"]}\n')
    got, _ = _captions(tmp_path, captions_file="caps.jsonl")
    assert got == {"cat.png": ["a cat"], "dog.png": ["a", "b"]}


def test_a_bad_captions_file_is_named(tmp_path):
    write_image(tmp_path / "data" / "cat.png", caption=None)
    (tmp_path / "data" / "caps.jsonl").write_text('{"file": "cat.png"}\n')
    with pytest.raises(DataError, match="caps.jsonl, record 1"):
        _captions(tmp_path, captions_file="caps.jsonl")


def test_tag_shuffling_caches_fixed_variants_keeping_leading_tags():
    variants = caption_variants(["sks, red, round, shiny, small"], "", True, 4, 1, ",")
    assert len(variants) == 4 and len(set(variants)) == 4
    for v in variants:
        tags = v.split(", ")
        assert tags[0] == "sks" and sorted(tags[1:]) == ["red", "round", "shiny", "small"]
    assert variants == caption_variants(["sks, red, round, shiny, small"], "", True, 4, 1, ",")
    assert caption_variants(["a, b"], "p ", False, 4, 0, ",") == ["p a, b"]


@pytest.mark.parametrize("policy", ["empty", "skip", "error"])
def test_missing_caption_policy(tmp_path, policy):
    write_image(tmp_path / "data" / "a.png", caption="has one")
    write_image(tmp_path / "data" / "b.png", caption=None)
    if policy == "error":
        with pytest.raises(DataError, match="b.png: no caption"):
            _captions(tmp_path, missing_caption=policy)
        return
    got, found = _captions(tmp_path, missing_caption=policy, caption_prefix="x ")
    if policy == "empty":
        assert got == {"a.png": ["x has one"], "b.png": ["x "]}
    else:
        assert got == {"a.png": ["x has one"]}
        assert found.dropped == [(str(tmp_path / "data" / "b.png"),
                                  "no caption (missing_caption=skip)")]


def test_non_utf8_caption_is_named(tmp_path):
    write_image(tmp_path / "data" / "a.png", caption=None)
    (tmp_path / "data" / "a.txt").write_bytes(b"\xff\xfe\xfa bad")
    with pytest.raises(DataError, match="a.txt is not UTF-8"):
        _captions(tmp_path)


def test_dropout_and_variants_are_drawn_per_sample_from_the_cache(tmp_path):
    data = tmp_path / "data"
    for i in range(4):
        write_image(data / f"{i}.png", (32, 32), seed=i, caption=f"tag{i}, red, blue, green, big, old")
    cfg = dataset_config(path=str(data), cache_dir=str(tmp_path / "cache"), resolutions=[32],
                         shuffle_tags=True, tag_variants=3, caption_dropout=0.25)
    spec = FakeSpec()
    dataset = prepare(spec, cfg, torch.device("cpu"), torch.float32, Layout(1, 1, 1, 0))
    manifest = dataset.plan.manifest
    assert manifest.empty_text is not None and dataset.store.has(manifest.empty_text)
    samples = manifest.buckets[0].samples
    assert all(len(s.texts) == 3 and s.dropout == 0.25 for s in samples)
    picks = Counter()
    for step in range(400):
        picks.update(choose_texts(samples[:1], manifest.empty_text, 0, step, range(1)))
    assert 0.18 < picks[manifest.empty_text] / 400 < 0.32
    assert {k for k in picks if k != manifest.empty_text} == set(samples[0].texts)
    # The choice is a function of (seed, step, slot): the same in every process and resume.
    assert choose_texts(samples, manifest.empty_text, 0, 7, range(4)) == choose_texts(
        samples, manifest.empty_text, 0, 7, range(4))
