"""dataset.conditioning: the per-sample draw of frame modes and the checks against what the
checkpoint takes (in-process, from the checkpoints' configs alone)."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from dpipe.config.schema import ConditioningConfig, DatasetConfig, ModelConfig
from dpipe.data.conditioning import draw_mode, frame_probabilities
from dpipe.errors import ConfigError
from dpipe.models.frame_modes import FRAME_MODES
from dpipe.models.wan.sizes import T2V_FOLDER, WAN_TINY
from dpipe.models.wan.spec import WanSpec
from dpipe.models.wan.variant import read_variant
from tests.unit.test_data_support import FakeSpec

# What read_variant reads of each kind of Wan folder.
_I2V = {"model_index.json": {"_class_name": "WanImageToVideoPipeline"},
        "vae/config.json": {"z_dim": 16},
        "image_encoder/config.json": {"image_size": 224, "patch_size": 14}}
FOLDERS = {
    "t2v": T2V_FOLDER | {"transformer/config.json": WAN_TINY},
    "i2v": _I2V | {"transformer/config.json": WAN_TINY | {"in_channels": 36, "image_dim": 32}},
    "flf2v": _I2V | {"transformer/config.json": WAN_TINY | {
        "in_channels": 36, "image_dim": 32, "pos_embed_seq_len": 514}},
    "i2v_a14b": {"model_index.json": {"_class_name": "WanImageToVideoPipeline",
                                      "transformer_2": ["diffusers", "WanTransformer3DModel"],
                                      "boundary_ratio": 0.9},
                 "vae/config.json": {"z_dim": 16},
                 "transformer/config.json": WAN_TINY | {"in_channels": 36}},
}


def _wan(kind: str) -> WanSpec:
    spec = WanSpec(ModelConfig(family="wan", path=f"/models/{kind}"))
    spec.__dict__["variant"] = read_variant(FOLDERS[kind].__getitem__)  # the cached property
    return spec


def _dataset(**probabilities) -> DatasetConfig:
    return DatasetConfig(path="/data", conditioning=ConditioningConfig(**probabilities))


def test_defaults_are_the_checkpoints_own_task():
    assert frame_probabilities(_wan("t2v"), _dataset()) is None  # batches carry no modes
    expected = {"i2v": "first", "flf2v": "both", "i2v_a14b": "first"}
    for kind, mode in expected.items():
        chosen = frame_probabilities(_wan(kind), _dataset())
        assert chosen == {m: float(m == mode) for m in FRAME_MODES}, kind


def test_modes_are_drawn_per_sample_with_their_probabilities():
    wanted = {"none": 0.0, "first": 0.3, "last": 0.0, "both": 0.7}
    assert frame_probabilities(_wan("i2v_a14b"), _dataset(first=0.3, both=0.7)) == wanted
    draws = [draw_mode(wanted, 5, step, slot) for step in range(2000) for slot in range(4)]
    counts = Counter(FRAME_MODES[d] for d in draws)
    n = len(draws)
    assert set(counts) == {"first", "both"}
    sigma = math.sqrt(n * 0.3 * 0.7)
    assert abs(counts["first"] - 0.3 * n) < 4 * sigma
    # The same (seed, step, slot) draws the same mode: a resumed run trains what it would have.
    assert [draw_mode(wanted, 5, step, slot) for step in range(2000)
            for slot in range(4)] == draws
    assert [draw_mode(wanted, 6, s, 0) for s in range(200)] != draws[:800:4]


def test_bad_probabilities_and_modes_the_checkpoint_cannot_take_are_refused():
    with pytest.raises(ConfigError, match=r"sums to 0\.8: the probabilities"):
        frame_probabilities(_wan("i2v_a14b"), _dataset(first=0.5, both=0.3))
    with pytest.raises(ConfigError, match=r"must be in \[0, 1\]"):
        frame_probabilities(_wan("i2v_a14b"), _dataset(first=1.5, both=-0.5))
    with pytest.raises(ConfigError, match=r"dataset.conditioning.both=1.0: model.family=wan at "
                                          r"/models/t2v takes the frame mode\(s\) none only"):
        frame_probabilities(_wan("t2v"), _dataset(both=1.0))
    with pytest.raises(ConfigError, match=r"conditioning.first=0.5: .* takes the frame mode\(s\) both only"):
        frame_probabilities(_wan("flf2v"), _dataset(first=0.5, both=0.5))
    with pytest.raises(ConfigError, match=r"conditioning.last=0.2: .* takes the frame mode\(s\) first, both only"):
        frame_probabilities(_wan("i2v_a14b"), _dataset(first=0.8, last=0.2))


def test_the_cache_key_names_the_frame_modes_it_holds():
    """I2V-A14B's cached latents hold the condition latents of both of its modes: its cache key
    says so (entries of the first-frame-only layout are made anew); T2V's key is unchanged."""
    assert _wan("i2v_a14b").image_notes["frames"] == ["first", "both"]
    assert "frames" not in _wan("t2v").image_notes


class _FirstFrameSpec(FakeSpec):
    """A video family whose checkpoint takes a first frame (image-to-video)."""

    def __init__(self):
        super().__init__(videos=True)

    def frame_modes(self) -> dict[str, float]:
        return {"none": 0.0, "first": 1.0}


def test_first_frame_dir_gives_each_clip_its_first_frame_keyed_by_its_bytes(tmp_path):
    """dataset.first_frame_dir: a clip's same-stem image is its first frame (cached with the
    clip, under the image's bytes too); a missing image is named before any encoding; the
    folder on a run that gives no sample a first frame is refused."""
    import torch

    from dpipe.data.prepare import Layout, prepare
    from dpipe.errors import DataError
    from dpipe.images import load_image
    from tests.unit.test_data_support import dataset_config, write_image, write_video

    data = tmp_path / "data"
    for i in range(2):
        write_video(data / f"clip{i}.mp4", frames=5, size=(32, 32))
        write_image(data / "firsts" / f"clip{i}.png", (32, 32), seed=i, caption=None)
    cfg = dataset_config(path=str(data), cache_dir=str(tmp_path / "cache"), resolutions=[32],
                         frame_buckets=[5], first_frame_dir="firsts")

    def latents_of(spec, clip: str) -> torch.Tensor:
        dataset = prepare(spec, cfg, torch.device("cpu"), torch.float32, Layout())
        sample, = [s for b in dataset.plan.manifest.buckets for s in b.samples
                   if s.source.endswith(clip)]
        return dataset.store.get(sample.latent)["latents"]

    spec = _FirstFrameSpec()
    latents = latents_of(spec, "clip0.mp4")  # (4, 5, 8, 8): FakeSpec pools each frame
    image = FakeSpec().encode_images(None, load_image(data / "firsts" / "clip0.png", 32, 32)[None])
    assert torch.equal(latents[:, 0], image[0])
    assert latents[:3, 1:].flatten(2).std(-1).max() < 1e-2  # the clip's own frames: flat grey
    assert spec.count("video") == 2

    write_image(data / "firsts" / "clip0.png", (32, 32), seed=7, caption=None)  # new bytes
    again = _FirstFrameSpec()
    assert not torch.equal(latents_of(again, "clip0.mp4")[:, 0], image[0])
    assert again.encoded == [("video", 1)]  # that clip alone is encoded again

    (data / "firsts" / "clip1.png").unlink()
    with pytest.raises(DataError, match=r"clip1\.mp4: no first frame in .*firsts \(expected "
                                        r"clip1\.<image extension>\)"):
        prepare(_FirstFrameSpec(), cfg, torch.device("cpu"), torch.float32, Layout())
    with pytest.raises(ConfigError, match=r"dataset first_frame_dir \(set for .*data\): no sample "
                                          r"is given its first frame \(none=1\)"):
        frame_probabilities(FakeSpec(videos=True), cfg)


def test_ltx2_refuses_micro_batches_mixing_a_last_frame_with_none_before_the_workers():
    """LTX-2 appends a given last frame's tokens: samples given one (last, both) and others
    (none, first) cannot share a micro-batch, so a run drawing both kinds needs micro-batches
    of one clip."""
    from dpipe.data.conditioning import check_micro_batches
    from dpipe.models.ltx_video.ltx2.spec import LTX2Spec

    spec = LTX2Spec(ModelConfig(family="ltx2", path="/models/ltx2"))
    mixed = frame_probabilities(spec, DatasetConfig(path="/data", conditioning=ConditioningConfig(
        first=0.5, both=0.5)))
    check_micro_batches(spec, mixed, [1, 1])
    check_micro_batches(spec, {"none": 0.0, "first": 0.0, "last": 0.5, "both": 0.5}, [4])
    with pytest.raises(ConfigError, match=r"dataset.conditioning \(first=0.5, both=0.5\) with "
                                          r"micro-batches of 2 clips: model.family=ltx2 cannot "
                                          r".*pipeline.micro_batch_size=1"):
        check_micro_batches(spec, mixed, [1, 2])
