"""Aspect-ratio and frame buckets: sizes, assignment, clip selection; nothing dropped silently."""

from __future__ import annotations

import math

import pytest

from dpipe.config.schema import ClipSelection
from dpipe.data.buckets import (
    AUTO_MAX_FRAMES, aspect_ratios, bucket_sizes, clip_starts, frame_bucket, frames_from_clips,
    nearest_size)
from dpipe.data.discover import directories, discover, placements
from dpipe.errors import ConfigError
from tests.unit.test_data_support import dataset_config, write_image, write_video


def test_ratios_from_min_max_count_are_log_spaced():
    cfg = dataset_config(path="/x", min_aspect_ratio=0.5, max_aspect_ratio=2.0, num_aspect_buckets=5)
    ratios = aspect_ratios(cfg)
    assert ratios == pytest.approx([0.5, 2 ** -0.5, 1.0, 2 ** 0.5, 2.0])
    assert aspect_ratios(dataset_config(path="/x", num_aspect_buckets=1)) == [1.0]
    assert aspect_ratios(dataset_config(path="/x", aspect_ratios=[1.5, 1.0, 1.0])) == [1.0, 1.5]


@pytest.mark.parametrize("resolution,multiple", [(512, 16), (1024, 16), (64, 8), (720, 32)])
def test_sizes_are_multiples_with_about_the_target_area(resolution, multiple):
    ratios = aspect_ratios(dataset_config(path="/x", num_aspect_buckets=9, min_aspect_ratio=0.25,
                                          max_aspect_ratio=4.0))
    sizes = bucket_sizes(resolution, ratios, multiple)
    assert len(sizes) == len(set(sizes))
    for w, h in sizes:
        assert w % multiple == 0 and h % multiple == 0
        # Rounding each side moves the area by at most about a multiple per side.
        assert abs(math.sqrt(w * h) - resolution) <= multiple
    assert [w / h for w, h in sizes] == sorted(w / h for w, h in sizes)
    assert (resolution // multiple * multiple,) * 2 in sizes or resolution % multiple


def test_resolution_below_the_multiple_is_refused():
    with pytest.raises(ConfigError, match="pixel multiple 16"):
        bucket_sizes(8, [1.0], 16)


def test_nearest_bucket_in_log_ratio():
    sizes = [(48, 88), (64, 64), (88, 48)]
    assert nearest_size(sizes, 1000, 1000) == (64, 64)
    assert nearest_size(sizes, 200, 100) == (88, 48)
    assert nearest_size(sizes, 100, 1000) == (48, 88)  # beyond the range: the extreme bucket
    assert nearest_size(sizes, 110, 100) == (64, 64)


def test_frame_bucket_is_the_longest_the_clip_fills():
    assert frame_bucket(40, [1, 17, 33, 65]) == 33
    assert frame_bucket(33, [17, 33]) == 33
    assert frame_bucket(16, [17, 33]) is None
    assert frame_bucket(5, [1, 17]) == 1


def test_clip_starts():
    assert clip_starts(50, 17, ClipSelection.beginning, 3) == [0]
    assert clip_starts(50, 17, ClipSelection.middle, 3) == [16]
    assert clip_starts(50, 17, ClipSelection.multiple, 3) == [0, 16, 33]
    assert clip_starts(17, 17, ClipSelection.multiple, 3) == [0]  # one clip fits: no duplicates
    assert clip_starts(20, 17, ClipSelection.multiple, 1) == [1]


def test_files_land_in_their_buckets_and_every_loss_is_reported(tmp_path):
    # Square, 2:1, 1:2, near-square, and a 5:1 panorama (cropped hard: reported).
    for name, size in [("sq", (64, 64)), ("wide", (128, 64)), ("tall", (40, 80)),
                       ("near", (66, 60)), ("pano", (250, 50))]:
        write_image(tmp_path / f"{name}.png", size)
    cfg = dataset_config(path=str(tmp_path), resolutions=[64, 32], num_aspect_buckets=3)
    found = discover(directories(cfg), tmp_path / "cache", False)
    places, dropped, trimmed = placements(found, 8)
    got = {(found.items[p.item].path.rsplit("/", 1)[-1], p.resolution): p.shape.name
           for p in places}
    assert got == {
        ("near.png", 64): "64x64", ("near.png", 32): "32x32",
        ("pano.png", 64): "88x48", ("pano.png", 32): "48x24",
        ("sq.png", 64): "64x64", ("sq.png", 32): "32x32",
        ("tall.png", 64): "48x88", ("tall.png", 32): "24x48",
        ("wide.png", 64): "88x48", ("wide.png", 32): "48x24",
    }
    assert dropped == []
    assert {p for p, _ in trimmed} == {str(tmp_path / "pano.png")}
    assert all("cropped away" in why for _, why in trimmed)


def test_per_directory_overrides(tmp_path):
    write_image(tmp_path / "a" / "x.png", (64, 64))
    write_image(tmp_path / "b" / "y.png", (64, 64))
    cfg = dataset_config(directories=[{"path": str(tmp_path / "a")},
                                      {"path": str(tmp_path / "b"), "resolutions": [32],
                                       "num_repeats": 3, "caption_prefix": "sks, "}])
    dirs = directories(cfg)
    assert dirs[0].settings.resolutions == [512] and dirs[1].settings.resolutions == [32]
    found = discover(dirs, tmp_path / "cache", False)
    assert [i.captions for i in found.items] == [["a photo"], ["sks, a photo"]]
    assert [p.shape.name for p in placements(found, 16)[0]] == ["512x512", "32x32"]


def test_videos_go_to_frame_buckets_and_short_ones_are_dropped_with_the_reason(tmp_path):
    write_video(tmp_path / "long.mp4", frames=20, fps=8)
    write_video(tmp_path / "short.mp4", frames=6, fps=8)
    write_image(tmp_path / "still.png", (32, 24))
    cfg = dataset_config(path=str(tmp_path), resolutions=[48], aspect_ratios=[4 / 3],
                         frame_buckets=[9, 17], clip_selection="multiple", clips_per_video=2)
    found = discover(directories(cfg), tmp_path / "cache", False)
    places, dropped, trimmed = placements(found, 8)
    shapes = sorted((found.items[p.item].path.rsplit("/", 1)[-1], p.shape.frames, p.start)
                    for p in places)
    assert shapes == [("long.mp4", 17, 0), ("long.mp4", 17, 3), ("still.png", 1, 0)]
    assert dropped == [(str(tmp_path / "short.mp4"),
                        "6 frames, shorter than every frame bucket [9, 17]")]
    assert trimmed == []  # two clips of 17 cover all 20 frames


def test_frame_buckets_chosen_from_clips_are_the_longest_that_every_clip_fills():
    def four_k_plus_1(n):  # Wan's rule
        return (n - 1) // 4 * 4 + 1

    assert frames_from_clips([], four_k_plus_1) == [1]  # no clips: images
    assert frames_from_clips([20, 12], four_k_plus_1) == [1, 9]  # the shortest holds 9
    assert frames_from_clips([500, 700], four_k_plus_1) == [1, AUTO_MAX_FRAMES]
    assert frames_from_clips([4], four_k_plus_1) == [1]  # too short for any clip: one frame
