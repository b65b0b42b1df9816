"""LTX-2's audio encoder on the tiny model in the real layout: the log-mel spectrogram, latents of
the length and normalisation LTX2Pipeline uses, and clips' sound reaching the NoisedBatch audio
fields through the dataset (model.audio=true)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from dpipe.config.schema import ModelConfig, TimestepConfig
from dpipe.data.audio import AudioSource, load_audio, sample_count
from dpipe.data.batches import step_micro_batches
from dpipe.data.prepare import Layout, prepare
from dpipe.models.ltx_video.ltx2.audio import N_FFT, log_mel, mel_filterbank
from dpipe.models.ltx_video.ltx2.spec import LTX2Spec
from dpipe.models.ltx_video.ltx2.tiny import make_tiny_ltx2
from dpipe.models.spec import AudioFormat
from tests.unit.test_data_support import dataset_config, write_image, write_video


class SoundLTX2(LTX2Spec):
    """LTX-2 with model.audio=true allowed (the family's layers take sound in another change)
    and each micro-batch's NoisedBatch kept for the test to read."""

    trains_audio = True
    batches: list = []

    def make_inputs(self, batch):
        self.batches.append(batch)
        return super().make_inputs(batch)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_ltx2(tmp_path_factory.mktemp("models") / "ltx2")


def make_spec(tiny, audio: bool = True) -> SoundLTX2:
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), {
        "family": "ltx2", "path": str(tiny), "max_text_tokens": 16, "audio": audio}))
    spec = SoundLTX2(cfg)
    spec.ensure_available()
    return spec


@pytest.fixture(scope="module")
def spec(tiny):
    return make_spec(tiny)


@pytest.fixture(scope="module")
def encoders(spec):
    return spec.load_encoders(torch.device("cpu"), torch.float32)


def test_audio_only_with_model_audio(tiny, spec, encoders):
    assert spec.audio_format() == AudioFormat(16000, 2)  # the audio VAE's rate, stereo
    assert encoders.audio_vae is not None and not encoders.audio_vae.training
    quiet = make_spec(tiny, audio=False)
    assert quiet.audio_format() is None
    assert quiet.load_encoders(torch.device("cpu"), torch.float32).audio_vae is None
    fingerprint = spec.encoder_fingerprint("audio")
    assert fingerprint["audio_vae"] != spec.encoder_fingerprint("image")["vae"]


def test_the_mel_filterbank_is_slaney_s():
    fine = mel_filterbank(16000, 16384, 64)  # fine bins: sums approximate integrals
    assert fine.shape == (8193, 64)
    areas = fine.sum(0) * (16000 / 16384)
    assert torch.allclose(areas[2:], torch.ones(62, dtype=torch.float64), atol=0.02)
    centres = fine.argmax(0).double() * 16000 / 16384
    below = centres[centres < 900]  # the Slaney scale is linear below 1 kHz
    steps = below.diff()
    assert steps.max() - steps.min() < 3 * 16000 / 16384
    # A 1 kHz tone: the loudest band is the one centred nearest 1 kHz.
    t = torch.arange(16000) / 16000
    tone = torch.sin(2 * torch.pi * 1000 * t).view(1, 1, -1)
    mel = log_mel(tone, 16000, 160, 64)
    assert mel.shape == (1, 1, 101, 64)
    assert int(mel[0, 0, 50].argmax()) == int((centres - 1000).abs().argmin())
    assert N_FFT == 1024


@pytest.mark.parametrize("fps", [24, 25])
def test_latents_as_long_as_the_pipeline_s_for_8k_plus_1_frames(spec, encoders, fps):
    vae = encoders.audio_vae
    for frames in (9, 17, 49, 121):
        waveforms = torch.randn(2, 2, sample_count(frames, fps, 16000)) * 0.3
        latents = spec.encode_audio(encoders, waveforms)
        # LTX2Pipeline.__call__: duration_s = num_frames / frame_rate, then
        # round(duration_s * audio_sampling_rate / audio_hop_length / temporal compression).
        per_second = encoders.audio_sampling_rate / encoders.audio_hop_length / float(
            encoders.audio_vae_temporal_compression_ratio)
        length = round(frames / fps * per_second)
        mel_bins = vae.config.mel_bins // encoders.audio_vae_mel_compression_ratio
        assert latents.shape == (2, vae.config.latent_channels, length, mel_bins), frames
    # Normalised as the pipeline normalises (its denormalisation gives the VAE's own latents).
    mel = log_mel(waveforms, 16000, 160, vae.config.mel_bins)[:, :, :length * 4]
    raw = vae.encode(mel).latent_dist.mode()
    back = encoders._denormalize_audio_latents(encoders._pack_audio_latents(latents),
                                               vae.latents_mean, vae.latents_std)
    assert torch.allclose(back, encoders._pack_audio_latents(raw), atol=1e-5)
    assert not torch.allclose(latents, raw, atol=1e-2)  # the tiny's mean/std are not 0/1


def test_clips_sound_reaches_the_data_batch(tmp_path, spec):
    data = tmp_path / "data"
    write_video(data / "low.mp4", frames=9, fps=24, size=(64, 64), tones=[(220, 0.5)],
                caption="a low hum")
    write_video(data / "high.mp4", frames=9, fps=24, size=(64, 64), tones=[(880, 0.5)],
                caption="a whistle")
    write_image(data / "still.png", (64, 64), caption="a still")
    cfg = dataset_config(path=str(data), cache_dir=str(tmp_path / "cache"), resolutions=[64],
                         aspect_ratios=[1.0], frame_buckets=[1, 9],
                         micro_batch_sizes=[{"resolution": 64, "frames": 1,
                                             "micro_batch_size": 1}])
    dataset = prepare(spec, cfg, torch.device("cpu"), torch.float32,
                      Layout(micro_batch_size=2, micro_batches=2))
    SoundLTX2.batches = []
    list(step_micro_batches(spec, dataset, dataset.plan, TimestepConfig(), 3, 0, 0))
    by_frames = {b.latents.shape[2]: b for b in SoundLTX2.batches}
    assert by_frames[1].audio is None and by_frames[1].audio_noisy is None  # the image
    clips = by_frames[3]  # 9 frames -> 2 latent frames, then the last frame's own
    assert clips.audio.shape == (2, 2, 9, 2)  # round(9 / 24 s * 25 latents/s) = 9
    t = clips.timesteps.view(-1, 1, 1, 1)
    assert torch.allclose(clips.audio_noisy, (1 - t) * clips.audio + t * clips.audio_noise)
    assert torch.equal(clips.audio_target, clips.audio_noise - clips.audio)
    # What was cached is LTX-2's encoding of each clip's sound, in the batch's order.
    sounds = {s.source.rsplit("/", 1)[-1]: s for b in dataset.plan.manifest.buckets
              for s in b.samples}
    encoders = spec.load_encoders(torch.device("cpu"), torch.float32)
    expected = {name: spec.encode_audio(encoders, load_audio(
        AudioSource("track", sounds[name].source, None), 0, 9, 24.0, 16000, 2)[None])[0]
        for name in ("low.mp4", "high.mp4")}
    got = sorted(clips.audio, key=lambda a: float(a.sum()))
    want = sorted(expected.values(), key=lambda a: float(a.sum()))
    assert all(torch.allclose(g, w, atol=1e-5) for g, w in zip(got, want))
    assert not torch.allclose(want[0], want[1], atol=1e-3)  # two tones, two encodings
