"""LTX-2 and LTX-2.3 with model.audio=true sample video and sound as LTX2Pipeline does: dpipe's
recipe, stepped through the joint pipeline layers, ends at the pipeline's final latents of both
streams; the decoded frames and waveform are the pipeline's; the written .mp4 holds both streams
(dpipe/models/ltx_video/ltx2/av_sampling.py)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from dpipe.models.ltx_video.ltx2.ltx23_tiny import make_tiny_ltx23
from dpipe.models.ltx_video.ltx2.tiny import make_tiny_ltx2
from dpipe.models.sampling import SampleRequest
from dpipe.sample import outputs
from tests.unit.video_checks import tiny_spec

STEPS, GUIDANCE = 2, 3.0


@pytest.fixture(scope="module", params=["ltx2", "ltx23"])
def spec(request, tmp_path_factory):
    make = make_tiny_ltx2 if request.param == "ltx2" else make_tiny_ltx23
    path = make(tmp_path_factory.mktemp("models") / request.param)
    return tiny_spec(path, request.param, audio=True)


def sample_through_layers(spec, request: SampleRequest) -> torch.Tensor:
    """dpipe's loop for one request on one stage: cond and uncond micro-batches per step."""
    from dpipe.sample.link import StageLink
    from dpipe.sample.denoise import denoise

    sampling = spec.sampling()
    encoders = spec.load_encoders(torch.device("cpu"), torch.float32)
    text, uncond = (spec.encode_prompts(encoders, [p]) for p in
                    (request.prompt, request.negative_prompt))
    layers = spec.pipeline_layers(spec.load_denoiser(torch.float32))

    def forward(x):
        for layer in layers:
            x = layer(x)
        return x

    d = sampling.start(request, STEPS, GUIDANCE, text, uncond, None, torch.device("cpu"))
    assert d.uncond is not None  # the audio's guidance (7) needs the negative prompt's pass
    assert denoise(sampling, [d], StageLink.local(torch.device("cpu")), forward, STEPS) == [False]
    return d.latents


def test_samples_both_streams_as_the_pipeline(spec, tmp_path):
    """17 frames (3 latent frames, 18 audio latent frames) of 64x64: the final latents of both
    streams equal LTX2Pipeline's (stg 0, modality 1, its audio guidance 7.0); the decoded frames
    and waveform equal the pipeline's decoded output; the .mp4 holds an H.264 stream of 17 frames
    and a stereo AAC stream at the vocoder's rate as long as the waveform, within a frame of the
    clip."""
    import av

    sampling = spec.sampling()
    assert sampling.makes_sound()
    request = SampleRequest(0, "a red fox", "blurry", seed=5, width=64, height=64, frames=17)
    assert sampling.check(request) is None
    latents = sample_through_layers(spec, request)
    denoiser = spec.load_denoiser(torch.float32)
    with torch.no_grad():
        expected = sampling.diffusers_sample(denoiser, request, STEPS, GUIDANCE)
        frames, (waveform, rate) = sampling.diffusers_media(denoiser, request, STEPS, GUIDANCE)
    torch.testing.assert_close(latents, expected, rtol=1e-4, atol=1e-5)
    video, audio = sampling.streams(latents)
    assert video.shape == (1, 8, 3, 8, 8) and audio.shape == (1, 18, 4)

    pixels = sampling.decode(sampling.load_vae(torch.device("cpu"), torch.float32), latents)
    torch.testing.assert_close((pixels / 2 + 0.5).clamp(0, 1), frames, rtol=1e-4, atol=1e-4)
    decoder = sampling.load_sound_decoder(torch.device("cpu"), torch.float32)
    sound, sound_rate = sampling.decode_sound(decoder, latents)
    assert sound_rate == rate == decoder["vocoder"].config.output_sampling_rate
    torch.testing.assert_close(sound, waveform, rtol=1e-4, atol=1e-4)
    assert sound.shape[0] == 2 and sound.std() > 0

    path = outputs.write_sample(tmp_path, request, pixels, sampling.fps, audio=(sound, rate))
    with av.open(str(path)) as container:
        picture, track = container.streams.video[0], container.streams.audio[0]
        assert len(list(container.decode(picture))) == 17
        assert (track.codec_context.name, track.rate, track.channels) == ("aac", rate, 2)
        seconds = float(track.duration * track.time_base)
        assert abs(seconds - sound.shape[1] / rate) < 1 / sampling.fps
        assert abs(seconds - 17 / sampling.fps) < 1 / sampling.fps


def test_the_sound_has_its_own_guidance_scale(spec):
    """sample.audio_guidance=2 (9 frames): the joint sample equals LTX2Pipeline's with
    audio_guidance_scale=2 and its sound differs from the one at the usual 7.0, the picture
    only through the cross-modal attention. The video-only sampler refuses the key."""
    import dataclasses

    from dpipe.models.ltx_video.ltx2.sampling import LTX2Sampling

    sampling = spec.sampling()
    usual = SampleRequest(0, "a red fox", "blurry", seed=5, width=64, height=64, frames=9)
    request = dataclasses.replace(usual, audio_guidance=2.0)
    assert sampling.check(request) is None
    assert sampling.audio_guidance(usual) == 7.0 and sampling.audio_guidance(request) == 2.0
    latents = sample_through_layers(spec, request)
    with torch.no_grad():
        expected = sampling.diffusers_sample(spec.load_denoiser(torch.float32), request, STEPS,
                                             GUIDANCE)
    torch.testing.assert_close(latents, expected, rtol=1e-4, atol=1e-5)
    sound, sound_usual = (sampling.streams(x)[1] for x in (latents, sample_through_layers(
        spec, usual)))
    assert (sound - sound_usual).abs().max() > 1e-3

    # Both scales at 1: neither stream is guided and the negative prompt's pass is left out,
    # as the pipeline does; the sound's scale alone above 1 keeps it.
    encoders = spec.load_encoders(torch.device("cpu"), torch.float32)
    text = spec.encode_prompts(encoders, [request.prompt])
    for audio_guidance, guided in ((1.0, False), (1.5, True)):
        d = sampling.start(dataclasses.replace(request, audio_guidance=audio_guidance), STEPS,
                           1.0, text, text, None, torch.device("cpu"))
        assert (d.uncond is not None) == guided

    video_only = tiny_spec(spec.path, spec.family, audio=False).sampling()
    assert type(video_only) is LTX2Sampling
    assert "makes no sound here" in video_only.check(request)


def test_audio_false_samples_video_only(spec):
    """model.audio=false keeps the video-only sampler: no sound, the video latents alone."""
    from dpipe.models.ltx_video.ltx2.sampling import LTX2Sampling

    video_only = tiny_spec(spec.path, spec.family, audio=False).sampling()
    assert type(video_only) is LTX2Sampling and not video_only.makes_sound()
    request = SampleRequest(0, "a", "", 0, 64, 64, frames=9)
    assert video_only.initial_latents(request).shape == (1, 8, 2, 8, 8)


def test_a_folder_without_the_vocoder_is_refused_before_sampling(spec, tmp_path):
    import shutil

    folder = tmp_path / "no-vocoder"
    shutil.copytree(spec.path, folder)
    shutil.rmtree(folder / "vocoder")
    sampling = tiny_spec(folder, spec.family, audio=True).sampling()
    problem = sampling.check(SampleRequest(0, "a", "", 0, 64, 64, frames=9))
    assert "vocoder" in problem and "model.audio=false" in problem
