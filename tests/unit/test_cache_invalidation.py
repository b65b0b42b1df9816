"""The cache can never go stale: a key covers the file's content, the preprocessing, the encoder
and the format version; unchanged inputs hit 100%; an interrupted fill resumes."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image
from safetensors.torch import load_file, save_file

from dpipe.config.schema import ModelConfig
from dpipe.data import cache_store
from dpipe.data.prepare import Layout, prepare
from dpipe.models.registry import build_spec
from tests.unit.test_data_support import FakeSpec, dataset_config, tiny_flux_spec, write_image


def _dataset(tmp_path, n=4, **settings):
    data = tmp_path / "data"
    for i in range(n):
        write_image(data / f"{i:02d}.png", (32, 32), seed=i, caption=f"picture {i}")
    return dataset_config(path=str(data), cache_dir=str(tmp_path / "cache"), resolutions=[32],
                          **settings)


def _prepare(spec, cfg, dtype=torch.float32):
    return prepare(spec, cfg, torch.device("cpu"), dtype, Layout())


def test_same_inputs_hit_every_entry_and_read_no_file(tmp_path):
    cfg = _dataset(tmp_path)
    first = _prepare(FakeSpec(), cfg)
    assert first.stats["latents"] == 4 and first.stats["texts"] == 4
    assert first.stats["files_read"] == 8  # 4 images + 4 captions
    spec = FakeSpec()
    again = _prepare(spec, cfg)
    assert spec.encoded == [] and again.stats["files_read"] == 0
    assert again.stats["latents"] + again.stats["texts"] == 0
    assert again.plan.manifest.digest == first.plan.manifest.digest
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == sorted(
        [f"{i:02d}.png" for i in range(4)] + [f"{i:02d}.txt" for i in range(4)])  # untouched


def test_editing_one_image_re_encodes_that_image_only(tmp_path):
    cfg = _dataset(tmp_path)
    _prepare(FakeSpec(), cfg)
    path = tmp_path / "data" / "02.png"
    before = os.stat(path)
    # Same size, same mtime (as `cp -p` or rsync -t would leave it): only ctime shows the edit.
    pixels = np.array(Image.open(path))
    pixels[0, 0] = 255 - pixels[0, 0]
    Image.fromarray(pixels).save(path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    spec = FakeSpec()
    dataset = _prepare(spec, cfg)
    assert spec.encoded == [("image", 1)]
    assert dataset.stats["files_read"] == 1
    edited = [s for s in dataset.plan.manifest.buckets[0].samples if s.source == str(path)]
    assert torch.equal(dataset.store.get(edited[0].latent)["latents"],
                       FakeSpec().encode_images(None, torch.stack(
                           [_load(path)]))[0])


def _load(path):
    from dpipe.images import load_image

    return load_image(path, 32, 32)


def test_a_new_resolution_adds_entries_and_keeps_the_old(tmp_path):
    cfg = _dataset(tmp_path)
    _prepare(FakeSpec(), cfg)
    spec = FakeSpec()
    dataset = _prepare(spec, dataset_config(**{**OmegaConf.to_container(
        OmegaConf.structured(cfg)), "resolutions": [32, 48]}))
    assert spec.count("image") == 4 and spec.count("text") == 0
    assert sorted(b.name for b in dataset.plan.manifest.buckets) == ["32x32", "48x48"]


@pytest.mark.parametrize("change", ["encoder", "dtype", "format_version", "crop_settings"])
def test_anything_that_shapes_an_entry_changes_its_key(tmp_path, monkeypatch, change):
    cfg = _dataset(tmp_path, n=2)
    _prepare(FakeSpec(), cfg)
    spec, dtype = FakeSpec(), torch.float32
    if change == "encoder":
        spec = FakeSpec(version="2")
    elif change == "dtype":
        dtype = torch.bfloat16
    elif change == "format_version":
        monkeypatch.setattr(cache_store, "CACHE_FORMAT_VERSION", cache_store.CACHE_FORMAT_VERSION + 1)
    else:  # another bucket for the same files
        cfg = dataset_config(**{**OmegaConf.to_container(OmegaConf.structured(cfg)),
                                "aspect_ratios": [1.5]})
    _prepare(spec, cfg, dtype)
    assert spec.count("image") == 2


def test_an_interrupted_fill_resumes_without_redoing_work(tmp_path):
    cfg = _dataset(tmp_path, n=20)

    class Crashing(FakeSpec):
        def encode_images(self, encoders, pixels):
            if self.count("image") >= 8:
                raise KeyboardInterrupt  # e.g. Ctrl-C or a killed job, after one batch of 8
            return super().encode_images(encoders, pixels)

    with pytest.raises(KeyboardInterrupt):
        _prepare(Crashing(), cfg)
    spec = FakeSpec()
    _prepare(spec, cfg)
    assert spec.count("image") == 12  # the first batch's 8 entries were kept
    assert not list((tmp_path / "cache").glob("??/.*.tmp"))


def test_changing_the_vae_config_or_weights_re_encodes(tmp_path):
    model = tmp_path / "flux"
    shutil.copytree(tiny_flux_spec().path, model)

    def spec():
        cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig),
                              {"family": "flux", "path": str(model), "max_text_tokens": 32})
        return build_spec(OmegaConf.to_object(cfg))

    cfg = _dataset(tmp_path, n=2)
    cfg = dataset_config(**{**OmegaConf.to_container(OmegaConf.structured(cfg)),
                            "resolutions": [64]})
    first = _prepare(spec(), cfg)
    assert first.stats["latents"] == 2 and first.stats["texts"] == 2
    old = first.store.get(first.plan.manifest.buckets[0].samples[0].latent)["latents"]

    vae_config = model / "vae" / "config.json"
    values = json.loads(vae_config.read_text())
    values["scaling_factor"] = 0.5
    vae_config.write_text(json.dumps(values))
    second = _prepare(spec(), cfg)
    assert second.stats["latents"] == 2 and second.stats["texts"] == 0
    new = second.store.get(second.plan.manifest.buckets[0].samples[0].latent)["latents"]
    assert new.shape == old.shape and not torch.equal(new, old)

    weights = next((model / "vae").glob("*.safetensors"))
    tensors = load_file(weights)
    name = next(k for k in tensors if k.endswith("conv_in.weight"))
    tensors[name] = tensors[name] * 1.5
    save_file(tensors, weights, metadata={"format": "pt"})
    third = _prepare(spec(), cfg)
    assert third.stats["latents"] == 2 and third.stats["texts"] == 0


def test_decode_workers_make_the_same_entries_as_in_process_decoding(tmp_path):
    data = tmp_path / "data"
    for i in range(70):  # enough for worker processes (below 64 jobs decoding stays in-process)
        write_image(data / f"{i:03d}.png", (24, 40), seed=i, caption=f"picture {i}")
    entries = []
    for workers in (0, 2):
        cfg = dataset_config(path=str(data), cache_dir=str(tmp_path / f"cache{workers}"),
                             resolutions=[32], cache_workers=workers)
        dataset = _prepare(FakeSpec(), cfg)
        assert dataset.stats["latents"] == 70
        entries.append({s.latent: dataset.store.get(s.latent)["latents"]
                        for b in dataset.plan.manifest.buckets for s in b.samples})
    assert entries[0].keys() == entries[1].keys()
    assert all(torch.equal(entries[0][k], entries[1][k]) for k in entries[0])


class SeesControl(FakeSpec):
    """A FakeSpec whose text encoder reads the control image with the caption, as
    Qwen-Image-Edit's Qwen2.5-VL does: each embedding depends on both."""

    text_sees_control = True

    def encode_prompts(self, encoders, prompts):
        raise AssertionError("captions of this model must be encoded with their control images")

    def encode_prompts_with_controls(self, encoders, prompts, controls):
        self.encoded.append(("text+control", len(prompts)))
        codes = torch.tensor([[(hash(p) >> s) % 97 / 97 for s in range(8)] for p in prompts])
        codes = codes + controls.mean(dim=(1, 2, 3))[:, None]
        return {"t5": codes.view(len(prompts), 1, 8).repeat(1, 4, 1), "pooled": codes}


def _edit_dataset(tmp_path, **settings):
    cfg = _dataset(tmp_path, control_dir="control", **settings)
    for i in range(4):
        write_image(tmp_path / "data" / "control" / f"{i:02d}.png", (32, 32), seed=100 + i,
                    caption=None)
    return cfg


def _by_name(dataset):
    return {os.path.basename(s.source): s for b in dataset.plan.manifest.buckets
            for s in b.samples}


def test_editing_a_control_image_re_encodes_that_items_text_only(tmp_path):
    from dpipe.images import load_image

    cfg = _edit_dataset(tmp_path)
    spec = SeesControl()
    first = _by_name(_prepare(spec, cfg))
    assert spec.count("text+control") == 4 and spec.count("text") == 0
    control = tmp_path / "data" / "control" / "02.png"
    pixels = np.array(Image.open(control))
    pixels[:16] = 255 - pixels[:16]
    Image.fromarray(pixels).save(control)
    spec = SeesControl()
    dataset = _prepare(spec, cfg)
    again = _by_name(dataset)
    # The edited control's latents and its item's caption entry; no other text entry.
    assert sorted(spec.encoded) == [("image", 1), ("text+control", 1)]
    assert again["02.png"].texts != first["02.png"].texts
    assert {k: s.texts for k, s in again.items() if k != "02.png"} == \
        {k: s.texts for k, s in first.items() if k != "02.png"}
    expected = SeesControl().encode_prompts_with_controls(
        None, ["picture 2"], load_image(control, 32, 32)[None])
    assert torch.equal(dataset.store.get(again["02.png"].texts[0])["pooled"],
                       expected["pooled"][0])
    # Another bucket fits the control image differently: its captions are encoded again.
    spec = SeesControl()
    _prepare(spec, dataset_config(**{**OmegaConf.to_container(OmegaConf.structured(cfg)),
                                     "resolutions": [24]}))
    assert spec.count("text+control") == 4


def test_dropped_captions_are_encoded_with_each_control_image(tmp_path):
    from dpipe.data.batches import choose_texts

    spec = SeesControl()
    dataset = _prepare(spec, _edit_dataset(tmp_path, caption_dropout=0.5))
    assert spec.count("text+control") == 8  # each caption and each empty caption, per control
    samples = list(_by_name(dataset).values())
    assert dataset.plan.manifest.empty_text is None
    assert len({s.empty for s in samples}) == 4 and all(s.empty not in s.texts for s in samples)
    assert dataset.plan.manifest.keys() >= {s.empty for s in samples}
    chosen = set()
    for step in range(20):
        for sample, key in zip(samples, choose_texts(samples, None, 0, step, range(4))):
            assert key in (sample.empty, *sample.texts)
            chosen.add(key == sample.empty)
    assert chosen == {True, False}


def test_a_model_whose_text_sees_the_control_needs_control_images(tmp_path):
    from dpipe.errors import DataError

    with pytest.raises(DataError, match="control_dir"):
        _prepare(SeesControl(), _dataset(tmp_path))


class SeesReferences(SeesControl):
    """SeesControl taking up to three references, each weighing in by its place (the order
    changes the encoding, as it changes the real VL encoder's "Picture 1: ... Picture 2: ...")."""

    references = 3

    def encode_prompts_with_controls(self, encoders, prompts, controls):
        # Several references arrive as (B, R, 3, H, W), one as (B, 3, H, W).
        self.__dict__.setdefault("shapes", []).append(tuple(controls.shape))
        controls = controls if controls.dim() == 5 else controls[:, None]
        place = torch.arange(1, controls.shape[1] + 1, dtype=controls.dtype)
        weighted = controls.mean(dim=(2, 3, 4)) * place
        return super().encode_prompts_with_controls(encoders, prompts,
                                                    weighted[:, :, None, None, None].sum(1))


def _references_dataset(tmp_path, count=2):
    cfg = _dataset(tmp_path, control_dir="control")
    for i in range(4):
        for r in range(1, count + 1):
            write_image(tmp_path / "data" / "control" / f"{i:02d}_{r}.png", (32, 32),
                        seed=100 * r + i, caption=None)
    return cfg


def test_numbered_references_are_cached_in_order_and_keyed_by_each(tmp_path):
    from dpipe.images import load_image

    cfg = _references_dataset(tmp_path)
    spec = SeesReferences()
    dataset = _prepare(spec, cfg)
    first = _by_name(dataset)
    assert spec.count("image") == 12 and spec.count("text+control") == 4
    sample = first["01.png"]
    assert spec.shapes == [(4, 2, 3, 32, 32)]  # one chunk of (B, R, 3, H, W)
    assert isinstance(sample.control, tuple) and len(sample.control) == 2
    control = tmp_path / "data" / "control"
    latents, _, _, references = dataset.collate([first["00.png"], sample],
                                                [first["00.png"].texts[0], sample.texts[0]])
    assert references.shape == (2, 2, *latents.shape[1:])  # (B, R, C, h, w)
    for r in range(2):  # in their order: 01_1, then 01_2
        expected = spec.encode_images(None, load_image(control / f"01_{r + 1}.png", 32, 32)[None])
        torch.testing.assert_close(references[1, r], expected[0])
    text = dataset.store.get(sample.texts[0])["pooled"]
    expected = SeesReferences().encode_prompts_with_controls(None, ["picture 1"], torch.stack(
        [load_image(control / f"01_{r}.png", 32, 32) for r in (1, 2)])[None])
    assert torch.equal(text, expected["pooled"][0])

    # Swapping two references re-encodes that item's caption (no latents: the files' contents
    # are known) and swaps its control keys.
    (control / "01_1.png").rename(control / "tmp.png")
    (control / "01_2.png").rename(control / "01_1.png")
    (control / "tmp.png").rename(control / "01_2.png")
    spec = SeesReferences()
    again = _by_name(_prepare(spec, cfg))
    assert spec.encoded == [("text+control", 1)]
    assert again["01.png"].control == sample.control[::-1]
    assert again["01.png"].texts != sample.texts
    assert {k: s for k, s in again.items() if k != "01.png"} == \
        {k: s for k, s in first.items() if k != "01.png"}

    # Editing one reference re-encodes its latents and its item's caption, nothing else.
    pixels = np.array(Image.open(control / "03_2.png"))
    Image.fromarray(255 - pixels).save(control / "03_2.png")
    spec = SeesReferences()
    edited = _by_name(_prepare(spec, cfg))
    assert sorted(spec.encoded) == [("image", 1), ("text+control", 1)]
    assert edited["03.png"].control[0] == again["03.png"].control[0]
    assert edited["03.png"].control[1] != again["03.png"].control[1]


def test_more_references_than_the_family_takes_are_refused_before_encoding(tmp_path):
    from dpipe.errors import DataError

    cfg = _references_dataset(tmp_path)
    spec = SeesControl()
    with pytest.raises(DataError) as error:
        _prepare(spec, cfg)
    message = str(error.value)
    assert "model.family=fake takes at most 1 control image(s) per file" in message
    assert "00.png: 2 control images" in message and "control/00_2.png" in message
    assert spec.encoded == []
    # A missing file among them: a gap in the numbers is named, as is an image with none.
    (tmp_path / "data" / "control" / "02_1.png").unlink()
    with pytest.raises(DataError, match=r"02.png: its control images in .*control skip a "
                                        r"number \(02_2 after 0 in order\): number them 02_1"):
        _prepare(SeesReferences(), cfg)
    (tmp_path / "data" / "control" / "02_2.png").unlink()
    with pytest.raises(DataError, match=r"02.png: no control image in .*control \(expected "
                                        r"02.<image extension>, or 02_1, 02_2, \.\.\. for"):
        _prepare(SeesReferences(), cfg)


def test_a_micro_batch_of_files_with_different_reference_counts_is_refused(tmp_path):
    from dpipe.errors import DataError

    cfg = _references_dataset(tmp_path)
    (tmp_path / "data" / "control" / "01_2.png").unlink()  # 01.png: one reference
    spec = SeesReferences()
    with pytest.raises(DataError, match=r"bucket 32x32 \(micro-batch 2\) mixes files with 1 and 2 "
                                        r"control images(.|\n)*01.png: 1 control image"):
        prepare(spec, cfg, torch.device("cpu"), torch.float32, Layout(2, 1, 1, 0))
    _prepare(SeesReferences(), cfg)  # one to a micro-batch: any mix


def test_a_captions_file_names_each_files_references_in_order(tmp_path):
    from dpipe.errors import DataError
    from dpipe.images import load_image

    cfg = _references_dataset(tmp_path)  # 00_1.png, 00_2.png, ... in control/
    data = tmp_path / "data"
    records = [{"file": f"{i:02d}.png", "caption": f"listed {i}",
                "control": [f"{i:02d}_2.png", f"{i:02d}_1.png"]} for i in range(4)]
    records[3]["control"] = "03_1.png"  # one reference, as a string
    (data / "captions.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    cfg.captions_file = "captions.jsonl"
    spec = SeesReferences()
    dataset = _prepare(spec, cfg)
    samples = _by_name(dataset)
    first, second = samples["01.png"].control
    for key, name in ((first, "01_2.png"), (second, "01_1.png")):  # the file's order
        expected = spec.encode_images(None, load_image(data / "control" / name, 32, 32)[None])
        torch.testing.assert_close(dataset.store.get(key)["latents"], expected[0])
    assert isinstance(samples["03.png"].control, str)
    assert dataset.store.get(samples["01.png"].texts[0])["pooled"].tolist() == \
        SeesReferences().encode_prompts_with_controls(None, ["listed 1"], torch.stack(
            [load_image(data / "control" / n, 32, 32) for n in ("01_2.png", "01_1.png")])[None]
        )["pooled"][0].tolist()

    records[2]["control"] = ["02_1.png", "gone.png"]
    (data / "captions.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    with pytest.raises(DataError, match=r"02.png: its control image gone.png \(in .*captions.jsonl"
                                        r"\) is not in .*control"):
        _prepare(SeesReferences(), cfg)
