"""Bad input never crashes training: unreadable files are skipped and listed (or refused in strict
mode), and masks, control images, empty directories and tiny buckets get messages naming files."""

from __future__ import annotations

import logging

import pytest
import torch

from dpipe.data.prepare import Layout, prepare
from dpipe.errors import DataError
from tests.unit.test_data_support import FakeSpec, dataset_config, write_image, write_video


def _run(tmp_path, layout=Layout(), **settings):
    cfg = dataset_config(path=str(tmp_path / "data"), cache_dir=str(tmp_path / "cache"),
                         resolutions=[32], **settings)
    return prepare(FakeSpec(videos=True), cfg, torch.device("cpu"), torch.float32, layout)


def _good(tmp_path, n=3):
    for i in range(n):
        write_image(tmp_path / "data" / f"ok{i}.png", (32, 32), seed=i)


def _corrupt(tmp_path):
    data = tmp_path / "data"
    (data / "garbage.png").write_bytes(b"not an image at all")
    (data / "garbage.txt").write_text("x")
    # A valid header with the pixel data cut off: passes the probe, fails only when decoded.
    write_image(data / "cut.png", (64, 64), seed=9)
    (data / "cut.png").write_bytes((data / "cut.png").read_bytes()[:300])
    (data / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 100)
    (data / "broken.txt").write_text("x")


def test_unreadable_files_are_skipped_with_a_warning_listing_them(tmp_path, caplog):
    _good(tmp_path)
    _corrupt(tmp_path)
    with caplog.at_level(logging.WARNING):
        dataset = _run(tmp_path)
    sources = {s.source for b in dataset.plan.manifest.buckets for s in b.samples}
    assert {p.rsplit("/", 1)[-1] for p in sources} == {"ok0.png", "ok1.png", "ok2.png"}
    warning = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    for name in ("garbage.png", "cut.png", "broken.mp4"):
        assert name in warning
    dropped = dict(dataset.reports["train"].dropped)
    assert dropped[str(tmp_path / "data" / "cut.png")].startswith("unreadable")
    # Training only ever sees the manifest: every sample it plans is decodable and cached.
    assert dataset.plan.steps_per_epoch == 3


def test_strict_mode_refuses_unreadable_files(tmp_path):
    _good(tmp_path)
    _corrupt(tmp_path)
    with pytest.raises(DataError, match="strict") as info:
        _run(tmp_path, strict=True)
    assert "garbage.png" in str(info.value) and "broken.mp4" in str(info.value)


def test_symlink_loops_are_named_and_skipped_or_refused_in_strict_mode(tmp_path, caplog):
    _good(tmp_path)
    data = tmp_path / "data"
    (data / "sub").mkdir()
    write_image(data / "sub" / "deep.png", (32, 32), seed=5)
    (data / "sub" / "back").symlink_to(data)  # a folder linking to one it is inside
    (data / "self.png").symlink_to(data / "self.png")  # a link to itself
    with caplog.at_level(logging.WARNING):
        dataset = _run(tmp_path)
    assert dataset.plan.steps_per_epoch == 4  # each image once
    dropped = dict(dataset.reports["train"].dropped)
    assert "a symlink loop" in dropped[str(data / "sub" / "back")]
    assert "a link that cannot be followed" in dropped[str(data / "self.png")]
    with pytest.raises(DataError, match="strict") as info:
        _run(tmp_path, strict=True)
    assert str(data / "sub" / "back") in str(info.value)


def test_a_file_that_fails_only_when_decoded_is_refused_in_strict_mode(tmp_path):
    _good(tmp_path)
    write_image(tmp_path / "data" / "cut.png", (64, 64), seed=9)
    (tmp_path / "data" / "cut.png").write_bytes((tmp_path / "data" / "cut.png").read_bytes()[:300])
    with pytest.raises(DataError, match="cut.png"):
        _run(tmp_path, strict=True)


def test_a_video_shorter_than_every_frame_bucket_is_reported(tmp_path):
    _good(tmp_path)
    write_video(tmp_path / "data" / "blink.mp4", frames=4)
    dataset = _run(tmp_path, frame_buckets=[9, 17])
    dropped = dict(dataset.reports["train"].dropped)
    assert dropped[str(tmp_path / "data" / "blink.mp4")] == (
        "4 frames, shorter than every frame bucket [9, 17]")
    assert any("blink.mp4" in line for line in dataset.reports["train"].lines())


@pytest.mark.parametrize("what", ["mask", "control"])
def test_missing_or_wrong_size_companion_files_are_errors_naming_them(tmp_path, what):
    _good(tmp_path)
    folder = tmp_path / f"{what}s"
    write_image(folder / "ok0.png", (32, 32), caption=None)
    write_image(folder / "ok1.png", (40, 32), caption=None)  # wrong size
    # ok2 has none
    with pytest.raises(DataError) as info:
        _run(tmp_path, **{f"{what}_dir": str(folder)})
    message = str(info.value)
    assert f"{tmp_path / 'data' / 'ok2.png'}: no {what}" in message
    assert f"{folder / 'ok1.png'}: the {what}" in message and "40x32" in message
    assert "ok0.png" not in message


def test_an_unreadable_mask_is_an_error(tmp_path):
    _good(tmp_path, 1)
    (tmp_path / "masks").mkdir()
    (tmp_path / "masks" / "ok0.png").write_bytes(b"junk")
    with pytest.raises(DataError, match="masks/ok0.png"):
        _run(tmp_path, mask_dir=str(tmp_path / "masks"))


def test_an_empty_directory_is_an_error_naming_it(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("nothing")
    with pytest.raises(DataError, match="has no images or videos") as info:
        _run(tmp_path)
    assert str(tmp_path / "data") in str(info.value)


def test_a_bucket_smaller_than_one_batch_is_reported_with_the_fix(tmp_path):
    for i in range(4):
        write_image(tmp_path / "data" / f"sq{i}.png", (32, 32), seed=i)
    write_image(tmp_path / "data" / "wide.png", (64, 32))
    dataset = _run(tmp_path, layout=Layout(micro_batch_size=2), num_aspect_buckets=3)
    report = dataset.reports["train"]
    (warning,) = report.warnings
    assert "bucket 48x24 has 1 sample(s), fewer than one batch of 2" in warning
    assert "micro_batch_sizes" in warning and "num_repeats" in warning
    assert dict(report.dropped)[str(tmp_path / "data" / "wide.png")].startswith("bucket 48x24")
    # The suggested fix works: a micro-batch size of 1 for that resolution trains it.
    fixed = _run(tmp_path, layout=Layout(micro_batch_size=2), num_aspect_buckets=3,
                 micro_batch_sizes=[{"resolution": 32, "micro_batch_size": 1}])
    assert fixed.reports["train"].warnings == []


def test_no_bucket_filling_a_batch_is_an_error_with_the_table(tmp_path):
    _good(tmp_path, 1)
    with pytest.raises(DataError, match="no bucket holds enough samples") as info:
        _run(tmp_path, layout=Layout(micro_batch_size=4))
    assert "32x32" in str(info.value)


def test_images_smaller_than_the_resolution_are_reported_per_directory(tmp_path):
    """96 px images trained at 512 are enlarged without complaint by the resize: the report says
    so, per directory, with the count and the smallest size; images at full size are not listed."""
    from tests.unit.test_data_support import dataset_config

    for i in range(3):
        write_image(tmp_path / "data" / "small" / f"s{i}.png", (24 + 4 * i, 24 + 4 * i), seed=i)
        write_image(tmp_path / "data" / "big" / f"b{i}.png", (48, 48), seed=i)
    cfg = dataset_config(cache_dir=str(tmp_path / "cache"), resolutions=[32],
                         directories=[{"path": str(tmp_path / "data" / d)} for d in ("small", "big")])
    dataset = prepare(FakeSpec(videos=True), cfg, torch.device("cpu"), torch.float32, Layout())
    report = dataset.reports["train"]
    assert report.upscaled == {str(tmp_path / "data" / "small"): (2, (24, 24))}
    (line,) = [x for x in report.lines() if "upscaled" in x]
    assert "2 file(s)" in line and "smallest 24x24" in line and str(tmp_path / "data" / "small") in line
