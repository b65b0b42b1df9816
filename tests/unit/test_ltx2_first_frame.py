"""LTX-2 and LTX-2.3 given frames (dataset.conditioning.first / last / both, model.i2v,
`first_frame:`) as LTX2ConditionPipeline conditions on them: a first frame's latents at frame 0
with t = 0 on their tokens, a last frame's own latents appended as clean tokens with positions of
their own (latent index -1), the audio and the prompt modulation at the sample's sigma, the loss
over the frames not given; the layers equal the transformer called as that pipeline calls it
(video only and with sound), and the staged sample equals LTX2ImageToVideoPipeline's."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import LTX2ConditionPipeline
from diffusers.pipelines.ltx2.pipeline_ltx2_condition import LTX2VideoCondition
from PIL import Image

from dpipe.config.schema import ConditioningConfig, DatasetConfig
from dpipe.data.conditioning import frame_probabilities
from dpipe.models.frame_modes import BOTH, LAST
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


def conditioned_batch(spec, encoders, sound: bool, pixels: torch.Tensor, modes: tuple[int, ...],
                     t=(0.3, 0.8)):
    """make_inputs of clips `pixels` (B, 3, F, H, W), each given the frames of its mode."""
    with seeded(0):
        latents = spec.encode_videos(encoders, pixels).float()
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
                                        frame_mode=torch.tensor(modes), **fields))


@pytest.mark.parametrize("sound", [False, True], ids=["video", "audio"])
def test_layers_equal_the_condition_pipelines_transformer_call(ltx23_encoders, sound):
    """A clip given both frames and one given its last (dataset.conditioning.both / last): the
    inputs are what LTX2ConditionPipeline.prepare_latents makes of a first frame at index 0 and a
    last frame at index -1 (the last one's own latent appended as clean tokens, its mask 1, its
    positions), the layers and `denoiser_forward` equal the transformer as it calls it, and the
    loss leaves out every given token."""
    spec = tiny_spec(shared_tiny("ltx23"), "ltx23", audio=sound)
    assert spec.frame_modes() == {"none": 1.0, "first": 0.0, "last": 0.0, "both": 0.0}
    assert tiny_spec(spec.path, "ltx23", i2v=True).frame_modes() == {
        "none": 0.0, "first": 1.0, "last": 0.0, "both": 0.0}
    with seeded(1):
        pixels = torch.rand(2, 3, 9, 32, 32) * 2 - 1
    inputs, labels = conditioned_batch(spec, ltx23_encoders, sound, pixels, (BOTH, LAST))
    packed, t_tokens, text, text_mask = inputs[:4]
    denoiser = lora_denoiser(spec)
    pipe = LTX2ConditionPipeline(**{**ltx23_encoders.components, "transformer": denoiser})
    sigma = torch.tensor([0.3, 0.8]) * 1000
    masks, coords = [], []
    for row, first in enumerate((True, False)):
        # The pipeline's [0, 255] frames (F, C, H, W), CRF 0: the clip's own frames, unchanged.
        frames = (pixels[row].transpose(0, 1) + 1) * 127.5
        conditions = [LTX2VideoCondition(frames[-1:], index=-1, crf=0)]
        if first:
            conditions.insert(0, LTX2VideoCondition(frames[:1], index=0, crf=0))
        with torch.no_grad():
            _, mask, clean, keyframe = pipe.prepare_latents(
                conditions, 1, packed.shape[2], 32, 32, 9, 24.0, dtype=torch.float32,
                generator=torch.Generator().manual_seed(0))
        given = mask[0, :, 0] > 0
        torch.testing.assert_close(packed[row, given], clean[0, given], rtol=1e-5, atol=1e-5)
        masks.append(mask[:, :, 0])
        coords.append(torch.cat([denoiser.rope.prepare_video_coords(1, 2, 4, 4, "cpu", fps=24.0),
                                 keyframe], dim=2))
    mask, video_coords = torch.cat(masks), torch.cat(coords)
    assert packed.shape[1] == 2 * 16 + 16 and mask.sum(1).tolist() == [32.0, 16.0]
    torch.testing.assert_close(t_tokens * 1000, sigma[:, None] * (1 - mask))

    c = denoiser.config
    if sound:
        audio, audio_text = inputs[6:8]
    else:
        audio = torch.zeros(2, 1, c.audio_in_channels)
        audio_text = torch.zeros(2, text.shape[1], c.caption_channels if c.use_prompt_embeddings
                                 else c.audio_cross_attention_dim)
    with torch.no_grad():
        got = run(spec.pipeline_layers(denoiser), inputs)
        forward = spec.denoiser_forward(denoiser, inputs)
        # The transformer as LTX2ConditionPipeline calls it (pipeline_ltx2_condition.py).
        expected = denoiser(
            hidden_states=packed, audio_hidden_states=audio, encoder_hidden_states=text,
            audio_encoder_hidden_states=audio_text, timestep=sigma[:, None] * (1 - mask),
            audio_timestep=sigma, sigma=sigma, audio_sigma=sigma,
            encoder_attention_mask=text_mask, audio_encoder_attention_mask=text_mask,
            num_frames=2, height=4, width=4, fps=24.0, audio_num_frames=audio.shape[1],
            video_coords=video_coords, isolate_modalities=not sound, use_cross_timestep=True,
            return_dict=False)
    if sound:
        torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(forward[1], expected[1], rtol=1e-5, atol=1e-5)
        got, forward = got[0], forward[0]
    torch.testing.assert_close(got, expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(forward, expected[0], rtol=1e-5, atol=1e-5)

    # The loss leaves out the given tokens: the first sample's first frame, both keyframes.
    off = labels[0] + 5.0 * mask[..., None]
    assert spec.loss((off, labels[-1]) if sound else off, labels).item() == 0.0
    assert spec.loss((labels[0] + 1, labels[-1]) if sound else labels[0] + 1,
                     labels).item() == pytest.approx(1.0)
    if sound:  # the sound counts whole for both samples
        assert spec.loss((labels[0], labels[-1] + 1), labels).item() == pytest.approx(
            spec.cfg.audio_loss_weight)


@pytest.mark.slow  # ~3.5 s on 2 busy cores (two pipelines' 2 steps)
def test_staged_sample_is_the_condition_pipelines(tmp_path):
    """9 frames of 32x32 from a first and a last frame, 2 steps, guidance 3: dpipe's loop
    through the layers ends at LTX2ConditionPipeline's final latents (its conditions' crf=0,
    stg 0, modality 1), the last frame's appended tokens included, its first latent frame the
    first image's and the appended ones the last image's."""
    from dpipe.images import load_image
    from dpipe.sample.denoise import denoise
    from dpipe.sample.link import StageLink

    spec = tiny_spec(make_tiny_ltx2(shared_tiny("ltx2")), "ltx2")
    first, last = tmp_path / "first.png", tmp_path / "last.png"
    for seed, path in enumerate((first, last)):
        Image.fromarray(np.random.default_rng(seed + 3).integers(0, 255, (32, 32, 3),
                                                                 np.uint8)).save(path)
    request = SampleRequest(0, "a red fox", "blurry", seed=5, width=32, height=32, frames=9,
                            control=str(first), last_frame=str(last))
    sampling = spec.sampling()
    assert sampling.check(request) is None
    # What LTX-2 cannot take: a one-frame clip from given frames. In training it takes every
    # frame mode.
    assert "frames=1 with a first frame" in sampling.check(replace(request, frames=1,
                                                                   last_frame=None))
    assert "no last frame besides its first" in sampling.check(replace(request, frames=1))
    assert frame_probabilities(spec, DatasetConfig(path="/data", conditioning=ConditioningConfig(
        first=0.25, last=0.25, both=0.25, none=0.25))) == dict.fromkeys(
            ("none", "first", "last", "both"), 0.25)
    encoders = spec.load_encoders(torch.device("cpu"), torch.float32)
    text, uncond = (spec.encode_prompts(encoders, [p]) for p in ("a red fox", "blurry"))
    control = spec.encode_images(encoders, load_image(first, 32, 32)[None])
    denoiser = spec.load_denoiser(torch.float32)
    layers = spec.pipeline_layers(denoiser)
    d = sampling.start(request, STEPS, GUIDANCE, text, uncond, control, torch.device("cpu"))
    assert denoise(sampling, [d], StageLink.local(torch.device("cpu")),
                   lambda x: run(layers, x), STEPS) == [False]
    with torch.no_grad():
        expected = sampling.diffusers_sample(denoiser, request, STEPS, GUIDANCE)
    torch.testing.assert_close(d.latents, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(d.latents[:, :, :1], control.float())
    torch.testing.assert_close(d.latents[:, :, -1:], spec.encode_images(
        encoders, load_image(last, 32, 32)[None]).float())
    assert sampling.output_latents(request, d.latents).shape[2] == 2
