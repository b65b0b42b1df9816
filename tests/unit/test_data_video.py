"""Videos through PyAV on small generated clips: probing, decoding, frame-rate resampling, clip
selection, frame buckets, and video latents (C, F, h, w) in the cache."""

from __future__ import annotations

import pytest
import torch

from dpipe.data.prepare import Layout, prepare
from dpipe.data.video import load_clip, probe_video, timeline_length
from dpipe.errors import DataError
from tests.unit.test_data_support import (
    FakeSpec, dataset_config, frame_levels, write_image, write_video)


@pytest.mark.parametrize("suffix,codec", [(".mp4", "mpeg4"), (".webm", "libvpx"),
                                          (".mkv", "libx264")])
def test_probe_and_decode_by_frame_index(tmp_path, suffix, codec):
    path = write_video(tmp_path / f"clip{suffix}", frames=12, fps=8, size=(32, 24), codec=codec)
    info = probe_video(path)
    assert info == {"w": 32, "h": 24, "frames": 12, "fps": 8.0, "duration": 1.5, "audio": None}
    clip = load_clip(path, start=3, frames=4, fps=None, width=16, height=16)
    assert clip.shape == (3, 4, 16, 16) and clip.dtype == torch.float32
    assert frame_levels(clip) == [30, 40, 50, 60]


def test_fps_resampling_picks_the_frame_shown_at_each_time(tmp_path):
    path = write_video(tmp_path / "clip.mp4", frames=12, fps=8)
    info = probe_video(path)
    assert timeline_length(info, 4) == 6 and timeline_length(info, 16) == 24
    assert timeline_length(info, None) == 12
    # Half the rate: every other frame. Double: each frame twice.
    assert frame_levels(load_clip(path, 0, 6, 4.0, 16, 16)) == [0, 20, 40, 60, 80, 100]
    assert frame_levels(load_clip(path, 18, 6, 16.0, 16, 16)) == [90, 90, 100, 100, 110, 110]


def test_asking_past_the_end_names_the_file(tmp_path):
    path = write_video(tmp_path / "clip.mp4", frames=5, fps=8)
    with pytest.raises(DataError, match="clip.mp4"):
        load_clip(path, 2, 5, None, 16, 16)


def test_mixed_images_and_videos_cache_clips_by_bucket(tmp_path):
    data = tmp_path / "data"
    write_video(data / "walk.mp4", frames=24, fps=8, caption="a person walking")
    write_video(data / "wave.webm", frames=10, fps=8, codec="libvpx", caption="waving")
    write_image(data / "still.png", (32, 24), caption="a still")
    cfg = dataset_config(path=str(data), cache_dir=str(tmp_path / "cache"), resolutions=[32],
                         aspect_ratios=[1.0], frame_buckets=[1, 5, 9], video_fps=4.0,
                         clip_selection="multiple", clips_per_video=2)
    spec = FakeSpec(videos=True)
    dataset = prepare(spec, cfg, torch.device("cpu"), torch.float32, Layout())
    buckets = {b.name: b for b in dataset.plan.manifest.buckets}
    # walk: 24 frames at 8 fps = 3 s = 12 frames at 4 fps -> 9-frame clips from 0 and 3.
    # wave: 10 frames = 1.25 s = 5 frames at 4 fps -> one 5-frame clip.
    assert sorted(buckets) == ["32x32", "32x32x5f", "32x32x9f"]
    assert [(s.source.rsplit("/", 1)[-1], s.start) for s in buckets["32x32x9f"].samples] == [
        ("walk.mp4", 0), ("walk.mp4", 3)]
    assert [s.source.rsplit("/", 1)[-1] for s in buckets["32x32x5f"].samples] == ["wave.webm"]
    # Video latents keep their frame axis: (C, F, h, w); images are one-frame clips.
    latent = dataset.store.get(buckets["32x32x9f"].samples[1].latent)["latents"]
    assert latent.shape == (4, 9, 8, 8)
    assert dataset.store.get(buckets["32x32"].samples[0].latent)["latents"].shape == (4, 1, 8, 8)
    # The second clip starts at timeline frame 3 = 0.75 s = source frame 6 (level 60); the
    # fake VAE keeps the mean level in its first channels.
    level = (latent[0, 0].mean() + 1) * 127.5
    assert abs(float(level) - 60) < 6


def test_a_clip_cut_to_one_frame_and_an_image_never_share_a_vae_call(tmp_path):
    data = tmp_path / "data"
    write_video(data / "walk.mp4", frames=9, fps=8, caption="a person walking")
    write_image(data / "still.png", (32, 32), caption="a still")
    cfg = dataset_config(path=str(data), cache_dir=str(tmp_path / "cache"), resolutions=[32],
                         aspect_ratios=[1.0], frame_buckets=[1])
    spec = FakeSpec(videos=True)
    dataset = prepare(spec, cfg, torch.device("cpu"), torch.float32, Layout())
    bucket, = dataset.plan.manifest.buckets
    assert bucket.name == "32x32" and len(bucket.samples) == 2
    assert [kind for kind, _ in spec.encoded if kind == "video"] == ["video", "video"]
    for sample in bucket.samples:
        assert dataset.store.get(sample.latent)["latents"].shape == (4, 1, 8, 8)


def test_a_model_without_video_support_refuses_videos(tmp_path):
    write_video(tmp_path / "data" / "walk.mp4", frames=8)
    cfg = dataset_config(path=str(tmp_path / "data"), cache_dir=str(tmp_path / "cache"),
                         resolutions=[32])
    with pytest.raises(DataError, match="(?s)trains on images.*walk.mp4"):
        prepare(FakeSpec(), cfg, torch.device("cpu"), torch.float32)


def test_each_clip_s_frame_rate_reaches_the_batch(tmp_path):
    """The rate a clip is trained at (its own, or video_fps of its directory) rides with each
    sample into the batch (`NoisedBatch.fps`); images have none (NaN: the model's default)."""
    from dpipe.config.schema import TimestepConfig
    from dpipe.data.batches import noised_batch, sample_conditions
    from dpipe.models.spec import ModelSpec

    class Noising(FakeSpec):
        noise = ModelSpec.noise

    native, resampled = tmp_path / "native", tmp_path / "resampled"
    write_video(native / "eight.mp4", frames=9, fps=8)
    write_video(native / "twelve.mp4", frames=9, fps=12)
    write_image(native / "still.png", (32, 24))
    write_video(resampled / "sixteen.mp4", frames=9, fps=16)
    cfg = dataset_config(directories=[{"path": str(native)},
                                      {"path": str(resampled), "video_fps": 20.0}],
                         cache_dir=str(tmp_path / "cache"), resolutions=[32],
                         aspect_ratios=[1.0], frame_buckets=[1, 5])
    spec = Noising(videos=True)
    dataset = prepare(spec, cfg, torch.device("cpu"), torch.float32, Layout())
    samples = {s.source.rsplit("/", 1)[-1]: s for b in dataset.plan.manifest.buckets
               for s in b.samples}
    assert {k: s.fps for k, s in samples.items()} == {
        "eight.mp4": 8.0, "twelve.mp4": 12.0, "sixteen.mp4": 20.0, "still.png": None}
    clips = [samples[k] for k in ("eight.mp4", "twelve.mp4", "sixteen.mp4")]
    conditions = sample_conditions(clips)
    assert conditions["fps"].tolist() == [8.0, 12.0, 20.0]
    latents, text, _, _ = dataset.collate(clips, [s.texts[0] for s in clips])
    batch = noised_batch(spec, latents, text, TimestepConfig(), 0, 0, range(3),
                         conditions=conditions)
    assert batch.fps.tolist() == [8.0, 12.0, 20.0]
    mixed = sample_conditions([samples["still.png"], samples["eight.mp4"]])["fps"]
    assert mixed.isnan().tolist() == [True, False] and mixed[1] == 8.0
    assert sample_conditions([samples["still.png"]])["fps"] is None
