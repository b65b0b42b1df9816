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
