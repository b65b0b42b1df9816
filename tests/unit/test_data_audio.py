"""Sound in the dataset (model.audio=true): a clip's track or same-stem .wav/.flac decoded at the
model's rate, cut to exactly the frames its bucket keeps; clips without sound per audio_missing;
bad sound named in the report; audio latents cached under keys that cover the sound, its cut and
resampling, and the audio encoder."""

from __future__ import annotations

import wave

import numpy as np
import pytest
import torch

from dpipe.data.audio import AudioSource, load_audio
from dpipe.data.prepare import Layout, prepare
from dpipe.errors import DataError
from dpipe.models.spec import AudioFormat
from tests.unit.test_data_support import (
    FakeSpec, dataset_config, pitch, write_image, write_video, write_wav)

RATE = 16000


def switch_sample(sound: torch.Tensor, low: float, high: float) -> int:
    """Where a tone of `low` Hz gives way to one of `high` Hz: the first upward zero crossing
    followed by a period nearer the high tone's."""
    x = sound.double().numpy()
    crossings = np.flatnonzero((x[:-1] < 0) & (x[1:] >= 0))
    periods = np.diff(crossings)
    return int(crossings[np.argmax(periods < RATE * (1 / low + 1 / high) / 2)])


@pytest.mark.parametrize("suffix,codec", [(".mp4", "aac"), (".mkv", "pcm_s16le")])
def test_a_clip_s_sound_is_cut_to_exactly_its_kept_frames(tmp_path, suffix, codec):
    # 3 s at 8 fps; the tone changes from 440 to 880 Hz at 1.0 s.
    path = write_video(tmp_path / f"clip{suffix}", frames=24, fps=8, audio_codec=codec,
                       tones=[(440, 1.0), (880, 2.0)])
    track = AudioSource("track", str(path), None)
    # Frames 4..11 at 8 fps: 0.5-1.5 s, resampled 48 -> 16 kHz, the mono track on both channels.
    sound = load_audio(track, 4, 8, 8.0, RATE, 2)
    assert sound.shape == (2, RATE) and sound.dtype == torch.float32
    assert torch.equal(sound[0], sound[1])
    assert abs(pitch(sound[0, :7000], RATE) - 440) < 2
    assert abs(pitch(sound[0, 9000:], RATE) - 880) < 2
    assert abs(switch_sample(sound[0], 440, 880) - RATE // 2) <= 2  # 1.0 s is half way
    # The same span at video_fps=4 (frames 2..5), and mono.
    again = load_audio(track, 2, 4, 4.0, RATE, 1)
    assert again.shape == (1, RATE) and torch.allclose(again[0], sound[0], atol=1e-6)
    # The whole clip: 9 frames at 24 fps from frame 3 -> round(9 / 24 * 16000) samples.
    assert load_audio(track, 3, 9, 24.0, RATE, 1).shape == (1, 6000)


def test_a_track_that_starts_late_is_placed_by_its_timestamps(tmp_path):
    # PCM in Matroska: exact timestamps (an AAC track's encoder delay is the muxer's to
    # declare, which PyAV's mp4 muxer does only to within ~1 ms for a late track).
    path = write_video(tmp_path / "late.mkv", frames=24, fps=8, audio_start=0.25,
                       tones=[(440, 1.0), (880, 1.75)], audio_codec="pcm_s16le")
    sound = load_audio(AudioSource("track", str(path), None), 4, 8, 8.0, RATE, 1)[0]
    # The change is at 1.25 s of the video: 0.75 s into the clip that starts at 0.5 s.
    assert abs(switch_sample(sound, 440, 880) - round(0.75 * RATE)) <= 2
    with pytest.raises(DataError, match=r"late.mkv starts 0.250 s after frame 0"):
        load_audio(AudioSource("track", str(path), None), 0, 8, 8.0, RATE, 1)


class SoundSpec(FakeSpec):
    """FakeSpec with an audio encoder that keeps the waveform (so a test can hear what was
    cached): latents are the sound itself, (channels, samples)."""

    def __init__(self, rate: int = RATE, channels: int = 1, version: str = "1"):
        super().__init__(version=version, videos=True)
        self.format = AudioFormat(rate, channels)

    def audio_format(self) -> AudioFormat:
        return self.format

    def encode_audio(self, encoders, waveforms: torch.Tensor) -> torch.Tensor:
        self.encoded.append(("audio", len(waveforms)))
        return waveforms.clone()


def _samples(dataset) -> dict:
    return {s.source.rsplit("/", 1)[-1]: s for b in dataset.plan.manifest.buckets
            for s in b.samples}


def _prepare(spec, tmp_path, **values):
    values = {"path": str(tmp_path / "data"), "cache_dir": str(tmp_path / "cache"),
              "resolutions": [32], "aspect_ratios": [1.0], "frame_buckets": [1, 8], **values}
    return prepare(spec, dataset_config(**values), torch.device("cpu"), torch.float32, Layout())


def test_a_sidecar_replaces_the_track_and_images_have_no_sound(tmp_path):
    data = tmp_path / "data"
    write_video(data / "tone.mp4", frames=8, fps=8, tones=[(440, 1.0)])
    write_video(data / "dubbed.mp4", frames=8, fps=8, tones=[(440, 1.0)])
    write_wav(data / "dubbed.wav", [(660, 1.2)], rate=22050)
    write_image(data / "still.png", (32, 32))
    dataset = _prepare(SoundSpec(), tmp_path)
    samples = _samples(dataset)
    assert samples["still.png"].audio is None
    heard = {name: dataset.store.get(samples[name].audio)["audio"] for name in
             ("tone.mp4", "dubbed.mp4")}
    assert {k: v.shape for k, v in heard.items()} == {"tone.mp4": (1, RATE),
                                                      "dubbed.mp4": (1, RATE)}
    assert abs(pitch(heard["tone.mp4"][0], RATE) - 440) < 2
    assert abs(pitch(heard["dubbed.mp4"][0], RATE) - 660) < 2  # the .wav, resampled 22.05k->16k
    meta = dataset.store.metadata(samples["dubbed.mp4"].audio)
    assert meta["origin"] == "sidecar" and meta["source"].endswith("dubbed.wav")
    # A micro-batch of clips carries their latents; one of images none.
    clips = [samples["tone.mp4"], samples["dubbed.mp4"]]
    assert dataset.audio(clips).shape == (2, 1, RATE)
    assert dataset.audio([samples["still.png"]]) is None


def test_clips_without_sound_per_audio_missing(tmp_path):
    data = tmp_path / "data"
    write_video(data / "loud.mp4", frames=8, fps=8, tones=[(440, 1.0)])
    write_video(data / "mute.mp4", frames=8, fps=8)
    with pytest.raises(DataError, match=r"(?s)mute.mp4: no audio track.*audio_missing=error"):
        _prepare(SoundSpec(), tmp_path)  # the default: the user decides

    skipped = _prepare(SoundSpec(), tmp_path, audio_missing="skip")
    assert sorted(_samples(skipped)) == ["loud.mp4"]
    lines = "\n".join(skipped.reports["train"].lines())
    assert "mute.mp4: no audio track and no same-stem .wav/.flac (audio_missing=skip)" in lines

    silent = _prepare(SoundSpec(), tmp_path, audio_missing="silence")
    mute = _samples(silent)["mute.mp4"]
    assert torch.equal(silent.store.get(mute.audio)["audio"], torch.zeros(1, RATE))
    lines = "\n".join(silent.reports["train"].lines())
    assert "silent: 1" in lines and "mute.mp4: no audio track" in lines
    assert "trains on silence (audio_missing=silence)" in lines

    # Per directory, as every dataset setting; a model without sound reads none of it.
    both = dataset_config(directories=[{"path": str(data), "audio_missing": "skip"}],
                          cache_dir=str(tmp_path / "cache"), resolutions=[32],
                          aspect_ratios=[1.0], frame_buckets=[8])
    assert sorted(_samples(prepare(SoundSpec(), both, torch.device("cpu"), torch.float32,
                                   Layout()))) == ["loud.mp4"]
    quiet = prepare(FakeSpec(videos=True), both, torch.device("cpu"), torch.float32, Layout())
    assert {s.audio for s in _samples(quiet).values()} == {None}


def test_a_dataset_that_trains_no_sound_says_so(tmp_path):
    data = tmp_path / "data"
    write_image(data / "still.png", (32, 32))
    images = _prepare(SoundSpec(), tmp_path).reports["train"]
    assert images.warnings == [
        "model.audio=true, but the dataset has no clips, so the sound (the audio stream and its "
        "adapters) learns nothing from this dataset. Add clips with an audio track or a "
        "same-stem .wav/.flac, longer than one frame, or set model.audio=false"]
    write_video(data / "loud.mp4", frames=8, fps=8, tones=[(440, 1.0)])
    assert _prepare(SoundSpec(), tmp_path).reports["train"].warnings == []
    (cut,) = _prepare(SoundSpec(), tmp_path, frame_buckets=[1]).reports["train"].warnings
    assert "its 1 clip(s) with sound are cut to one frame (dataset.frame_buckets)" in cut
    write_video(data / "mute.mp4", frames=8, fps=8)
    (data / "loud.mp4").unlink()
    (mute,) = _prepare(SoundSpec(), tmp_path, audio_missing="silence").reports["train"].warnings
    assert "none of its 1 clip(s) has sound (they train on silence)" in mute


def _zero_rate_wav(path):
    with wave.open(str(path), "wb") as file:
        file.setnchannels(1), file.setsampwidth(2), file.setframerate(8000)
        file.writeframes(np.zeros(8000, np.int16).tobytes())
    raw = bytearray(path.read_bytes())
    raw[24:28] = (0).to_bytes(4, "little")  # the header's sample rate
    path.write_bytes(bytes(raw))


def test_bad_sound_is_named_in_the_report_never_a_traceback(tmp_path):
    data = tmp_path / "data"
    write_video(data / "good.mp4", frames=8, fps=8, tones=[(440, 1.0)])
    write_video(data / "short.mp4", frames=8, fps=8, tones=[(440, 0.5)])
    write_video(data / "nearly.mp4", frames=8, fps=8, tones=[(440, 0.95)])  # 50 ms short: padded
    write_video(data / "broken.mp4", frames=8, fps=8, tones=[(440, 1.0)])
    (data / "broken.flac").write_bytes(b"fLaC" + bytes(range(256)) * 4)
    write_video(data / "norate.mp4", frames=8, fps=8, tones=[(440, 1.0)])
    _zero_rate_wav(data / "norate.wav")
    dataset = _prepare(SoundSpec(), tmp_path)
    samples = _samples(dataset)
    assert sorted(samples) == ["good.mp4", "nearly.mp4"]
    nearly = dataset.store.get(samples["nearly.mp4"].audio)["audio"][0]
    assert nearly.shape == (RATE,) and abs(pitch(nearly[:RATE * 9 // 10], RATE) - 440) < 2
    assert nearly[-500:].abs().max() < 0.02  # the gap is silence (after the codec's tail)
    dropped = dict(dataset.reports["train"].dropped)
    short, broken, norate = (dropped[str(data / n)] for n in
                             ("short.mp4", "broken.mp4", "norate.mp4"))
    assert "shorter than its clip" in short and "covers 0.000-0.5" in short
    assert "broken.flac" in broken
    assert "norate.wav" in norate  # FFmpeg refuses a rate of 0 as it opens the file
    with pytest.raises(DataError, match=r"(?s)dataset.strict=true.*broken.flac.*norate.wav"):
        _prepare(SoundSpec(), tmp_path, strict=True)  # found as the files are listed
    for name in ("broken.flac", "norate.wav"):
        (data / name).unlink()
    with pytest.raises(DataError, match=r"(?s)cannot be decoded \(dataset.strict=true\).*short"):
        _prepare(SoundSpec(), tmp_path, strict=True)  # found as the sound is decoded


def test_audio_entries_are_remade_exactly_when_their_sound_or_resampling_changes(tmp_path):
    data = tmp_path / "data"
    write_video(data / "a.mp4", frames=8, fps=8, tones=[(440, 1.0)])
    write_video(data / "b.mp4", frames=8, fps=8, tones=[(330, 1.0)])
    write_wav(data / "b.wav", [(660, 1.0)])
    first = _prepare(SoundSpec(), tmp_path)
    assert first.stats["audio"] == 2 and first.stats["latents"] == 2
    spec = SoundSpec()
    again = _prepare(spec, tmp_path)
    assert spec.count("audio") == 0 and again.stats["audio"] == 0  # nothing changed
    assert _samples(again)["b.mp4"].audio == _samples(first)["b.mp4"].audio

    write_wav(data / "b.wav", [(550, 1.0)])  # new sound bytes: that clip's entry only
    spec = SoundSpec()
    changed = _prepare(spec, tmp_path)
    assert spec.count("audio") == 1 and spec.count("video") == 0
    b = _samples(changed)["b.mp4"]
    assert b.audio != _samples(first)["b.mp4"].audio
    assert abs(pitch(changed.store.get(b.audio)["audio"][0], RATE) - 550) < 2

    spec = SoundSpec(rate=8000)  # other resampling: every audio entry, no video latent
    resampled = _prepare(spec, tmp_path)
    assert spec.count("audio") == 2 and spec.count("video") == 0
    assert resampled.store.get(_samples(resampled)["a.mp4"].audio)["audio"].shape == (1, 8000)
    spec = SoundSpec(version="2")  # another audio encoder (its weights): every audio entry
    _prepare(spec, tmp_path)
    assert spec.count("audio") == 2 and spec.count("video") == 2  # FakeSpec: one version


def test_a_bucket_of_clips_at_different_rates_is_refused(tmp_path):
    data = tmp_path / "data"
    write_video(data / "eight.mp4", frames=8, fps=8, tones=[(440, 1.0)])
    write_video(data / "twelve.mp4", frames=12, fps=12, tones=[(440, 1.0)])
    with pytest.raises(DataError, match=r"(?s)bucket 32x32x8f.*8, 12 fps.*video_fps"):
        _prepare(SoundSpec(), tmp_path)
    dataset = _prepare(SoundSpec(), tmp_path, video_fps=8.0)
    assert dataset.audio(list(_samples(dataset).values())).shape == (2, 1, RATE)


@pytest.mark.parametrize("suffix,codec", [(".mp4", "aac"), (".mkv", "pcm_s16le")])
def test_a_clip_far_into_its_file_seeks_to_the_same_sound(tmp_path, suffix, codec):
    path = write_video(tmp_path / f"long{suffix}", frames=48, fps=8, audio_codec=codec,
                       tones=[(440, 4.0), (880, 2.0)])
    track = AudioSource("track", str(path), None)
    # Frames 28..35: 3.5-4.5 s (a seek to 2.5 s first); the change at 4.0 s is half way.
    sound = load_audio(track, 28, 8, 8.0, RATE, 1)[0]
    assert abs(switch_sample(sound, 440, 880) - RATE // 2) <= 2
    whole = load_audio(track, 0, 48, 8.0, RATE, 1)[0]  # decoded from the start, no seek
    assert torch.allclose(sound, whole[round(3.5 * RATE):round(4.5 * RATE)], atol=1e-3)
