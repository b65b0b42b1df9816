"""LTX-2 and LTX-2.3 image-to-video (dataset.conditioning.first, model.i2v, `first_frame:`) as
LTX2ImageToVideoPipeline conditions on a first frame: its latents at frame 0 with t = 0 on their
tokens, the audio and the prompt modulation at the sample's sigma, the loss over the later frames;
the layers equal the transformer called as that pipeline calls it (video only and with sound), and
the staged sample equals the pipeline's."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import LTX2ImageToVideoPipeline
from PIL import Image

from dpipe.config.schema import ConditioningConfig, DatasetConfig
from dpipe.data.conditioning import frame_probabilities
from dpipe.errors import ConfigError
from dpipe.models.frame_modes import FIRST, NONE
from dpipe.models.ltx_video.ltx2.ltx23_tiny import make_tiny_ltx23
from dpipe.models.ltx_video.ltx2.tiny import make_tiny_ltx2
from dpipe.models.sampling import SampleRequest
from dpipe.models.spec import NoisedBatch
from dpipe.models.tiny_parts import seeded
from tests.unit.video_checks import CAPTIONS, lora_denoiser, run, tiny_spec

STEPS, GUIDANCE = 2, 3.0


def shared_tiny(name: str) -> Path:
    """The tiny model the `tiny_<name>` config makes (made once for the test session)."""
    return Path(os.environ["DPIPE_CACHE"]) / "models" / f"tiny-{name}"


@pytest.fixture(scope="module")
def ltx23_encoders():
    # LTX-2.3: its prompt modulation reads the sample's sigma, not the tokens' t, the case
    # where a given frame's t = 0 could reach more than the video's own modulation.
    spec = tiny_spec(make_tiny_ltx23(shared_tiny("ltx23")), "ltx23", audio=True)
    return spec.load_encoders(torch.device("cpu"), torch.float32)  # both streams' prompts


def conditioned_batch(spec, encoders, sound: bool, t=(0.3, 0.8)):
    """make_inputs of two 9-frame 32x32 clips, the first given its first frame, the second not."""
    with seeded(0):
        latents = spec.encode_videos(encoders, torch.rand(2, 3, 9, 32, 32) * 2 - 1).float()
        noise = torch.randn_like(latents)
        audio = torch.randn(2, 2, 5, 2)
        audio_noise = torch.randn_like(audio)
    t = torch.tensor(t)
    noisy, target = spec.noise(latents, noise, t)
    fields = {}
    if sound:
        audio_noisy, audio_target = spec.noise(audio, audio_noise, t)
        fields = {"audio_noisy": audio_noisy, "audio_target": audio_target}
    text = {k: v.float() for k, v in spec.encode_prompts(encoders, CAPTIONS).items()}
    return spec.make_inputs(NoisedBatch(latents=latents, noise=noise, timesteps=t, noisy=noisy,
                                        target=target, text=text,
                                        frame_mode=torch.tensor([FIRST, NONE]), **fields))


@pytest.mark.parametrize("sound", [False, True], ids=["video", "audio"])
def test_layers_equal_the_i2v_pipelines_transformer_call(ltx23_encoders, sound):
    spec = tiny_spec(shared_tiny("ltx23"), "ltx23", audio=sound)
    assert spec.frame_modes() == {"none": 1.0, "first": 0.0}
    assert tiny_spec(spec.path, "ltx23", i2v=True).frame_modes() == {"none": 0.0, "first": 1.0}
    inputs, labels = conditioned_batch(spec, ltx23_encoders, sound)
    packed, t_tokens, text, text_mask = inputs[:4]
    # The pipeline's conditioning mask (1 on the first latent frame), for the first sample only.
    mask = torch.zeros(2, 1, 2, 4, 4)
    mask[0, :, 0] = 1.0
    mask = LTX2ImageToVideoPipeline._pack_latents(mask, 1, 1).squeeze(-1)
    sigma = torch.tensor([0.3, 0.8]) * 1000
    torch.testing.assert_close(t_tokens * 1000, sigma[:, None] * (1 - mask))

    denoiser = lora_denoiser(spec)
    c = denoiser.config
    if sound:
        audio, audio_text = inputs[6:8]
    else:  # isolated modalities: any audio stream leaves the video as it is
        audio = torch.zeros(2, 1, c.audio_in_channels)
        audio_text = torch.zeros(2, text.shape[1], c.caption_channels if c.use_prompt_embeddings
                                 else c.audio_cross_attention_dim)
    with torch.no_grad():
        got = run(spec.pipeline_layers(denoiser), inputs)
        # The transformer as LTX2ImageToVideoPipeline calls it (pipeline_ltx2_image2video.py).
        expected = denoiser(
            hidden_states=packed, audio_hidden_states=audio, encoder_hidden_states=text,
            audio_encoder_hidden_states=audio_text, timestep=sigma[:, None] * (1 - mask),
            audio_timestep=sigma, sigma=sigma, encoder_attention_mask=text_mask,
            audio_encoder_attention_mask=text_mask, num_frames=2, height=4, width=4, fps=24.0,
            audio_num_frames=audio.shape[1], isolate_modalities=not sound,
            use_cross_timestep=True, return_dict=False)
    if sound:
        torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-5)
        got = got[0]
    torch.testing.assert_close(got, expected[0], rtol=1e-5, atol=1e-5)

    # The loss leaves out the given frame's tokens; the sound counts whole for both samples.
    video_target = labels[0]
    off = video_target.clone()
    off[0, :16] += 5.0
    outputs = (off, labels[-1]) if sound else off
    assert spec.loss(outputs, labels).item() == 0.0
    if sound:
        assert spec.loss((video_target, labels[-1] + 1), labels).item() == pytest.approx(
            spec.cfg.audio_loss_weight)


@pytest.mark.slow  # ~3.5 s on 2 busy cores (two pipelines' 2 steps)
def test_staged_sample_is_the_i2v_pipelines(tmp_path):
    """9 frames of 32x32 from a first frame, 2 steps, guidance 3: dpipe's loop through the
    layers ends at LTX2ImageToVideoPipeline's final latents (image_crf=0, stg 0, modality 1), its
    first latent frame the image's."""
    from dpipe.images import load_image
    from dpipe.sample.denoise import denoise
    from dpipe.sample.link import StageLink

    spec = tiny_spec(make_tiny_ltx2(shared_tiny("ltx2")), "ltx2")
    image = tmp_path / "first.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 255, (32, 32, 3), np.uint8)).save(image)
    request = SampleRequest(0, "a red fox", "blurry", seed=5, width=32, height=32, frames=9,
                            control=str(image))
    sampling = spec.sampling()
    assert sampling.check(request) is None
    # What LTX-2 cannot take: a last frame, a one-frame clip from a first frame, and in
    # training dataset.conditioning.last (before any file is read).
    assert "takes no last frame" in sampling.check(replace(request, last_frame=str(image)))
    assert "frames=1 with a first frame" in sampling.check(replace(request, frames=1))
    with pytest.raises(ConfigError, match=r"conditioning.last=0.5: model.family=ltx2 .* takes "
                                          r"the frame mode\(s\) none, first only"):
        frame_probabilities(spec, DatasetConfig(path="/data", conditioning=ConditioningConfig(
            first=0.5, last=0.5)))
    encoders = spec.load_encoders(torch.device("cpu"), torch.float32)
    text, uncond = (spec.encode_prompts(encoders, [p]) for p in ("a red fox", "blurry"))
    control = spec.encode_images(encoders, load_image(image, 32, 32)[None])
    denoiser = spec.load_denoiser(torch.float32)
    layers = spec.pipeline_layers(denoiser)
    d = sampling.start(request, STEPS, GUIDANCE, text, uncond, control, torch.device("cpu"))
    assert denoise(sampling, [d], StageLink.local(torch.device("cpu")),
                   lambda x: run(layers, x), STEPS) == [False]
    with torch.no_grad():
        expected = sampling.diffusers_sample(denoiser, request, STEPS, GUIDANCE)
    torch.testing.assert_close(d.latents, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(d.latents[:, :, :1], control.float())
