"""The tiny Ideogram 4 loads and runs through diffusers' real code; its layers, prompts and
latents are the pipeline's."""

import os

# Before any Hugging Face import: a hub lookup offline would stall ~48 s on retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


import pytest
import torch
from diffusers import Ideogram4Pipeline

from dpipe.config.schema import ModelConfig
from dpipe.models.common.vae_batch_norm import batch_norm_stats
from dpipe.models.ideogram4.layers import packed_ids
from dpipe.models.ideogram4.spec import Ideogram4Spec, to_tokens
from tests.unit.video_checks import noised_images

CAPTIONS = ["a red circle on a blue background", "a cat"]
TOKENS = 32


@pytest.fixture(scope="module")
def pipe(tiny) -> Ideogram4Pipeline:
    return Ideogram4Pipeline.from_pretrained(tiny, dtype=torch.float32)


@pytest.fixture(scope="module")
def spec(tiny) -> Ideogram4Spec:
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig),
                          {"family": "ideogram4", "path": str(tiny), "max_text_tokens": TOKENS})
    return Ideogram4Spec(OmegaConf.to_object(cfg))


def test_pixel_multiple_is_the_pipelines(pipe, spec):
    assert spec.pixel_multiple == pipe.vae_scale_factor * pipe.patch_size == 8


def test_prompts_are_the_pipelines(pipe, spec):
    encoders = spec.load_encoders(torch.device("cpu"), torch.float32)
    text = spec.encode_prompts(encoders, CAPTIONS)
    with torch.no_grad():
        embeds, pos, seg, indicator = pipe.encode_prompt(CAPTIONS, 8, 8, TOKENS, "cpu")
    assert text["text"].shape == (2, TOKENS, 13 * 16)
    assert torch.equal(text["text"], embeds[:, :TOKENS])
    lens = text["text_len"].reshape(-1).long()
    assert torch.equal(lens, (indicator == 3).sum(1)) and lens[0] > lens[1]
    # The packed layout the embedding layer builds on the device is the pipeline's.
    for mine, theirs in zip(packed_ids(lens, TOKENS, 8, 8), (pos, seg, indicator)):
        assert torch.equal(mine, theirs)


def test_latents_are_what_the_pipeline_decodes(pipe, spec):
    encoders = spec.load_encoders(torch.device("cpu"), torch.float32)
    pixels = torch.rand(1, 3, 64, 64) * 2 - 1
    latents = spec.encode_images(encoders, pixels)
    assert latents.shape == (1, 16, 8, 8)
    # The pipeline's decode path: tokens * std + mean, then its view/permute unpatching.
    mean, std = batch_norm_stats(pipe.vae)
    z = to_tokens(latents) * std.view(1, 1, -1) + mean.view(1, 1, -1)
    z = z.view(1, 8, 8, 2, 2, 4).permute(0, 5, 1, 3, 2, 4).reshape(1, 4, 16, 16)
    torch.testing.assert_close(z, pipe.vae.encode(pixels).latent_dist.mode())


def _inputs(spec, encoders, captions, seed=0):
    batch = noised_images(spec, encoders, captions, seed)
    return spec.make_inputs(batch), (batch.latents, batch.noise)


def test_layers_equal_the_transformer_in_fp32(spec):
    encoders = spec.load_encoders(torch.device("cpu"), torch.float32)
    (inputs, labels), (x0, noise) = _inputs(spec, encoders, CAPTIONS)
    denoiser = spec.load_denoiser(torch.float32)
    layers = spec.pipeline_layers(denoiser)
    assert len(layers) == spec.pipeline_layer_count() == 4
    with torch.no_grad():
        x = inputs
        for layer in layers:
            x = layer(x)
        expected = spec.denoiser_forward(denoiser, inputs)
    assert x.shape == labels[0].shape == (2, 64, 16)
    assert torch.equal(x, expected)
    # The label is what the transformer predicts: x0 - noise.
    assert torch.equal(labels[0], to_tokens(x0 - noise))
    assert torch.isfinite(spec.loss(x, labels))


def test_sampling_matches_the_pipeline(spec):
    from dpipe.models.sampling import SampleRequest

    sampling = spec.sampling()
    request = SampleRequest(0, CAPTIONS[0], "", 3, 64, 64)
    latents = sampling.initial_latents(request)
    scheduler = sampling.new_scheduler()
    timesteps = sampling.set_timesteps(scheduler, 4, latents)
    ref = sampling.new_scheduler()
    from diffusers.pipelines.ideogram4.pipeline_ideogram4 import (
        _logit_normal_sigmas, _resolution_aware_mu)
    ref.set_timesteps(sigmas=_logit_normal_sigmas(4, _resolution_aware_mu(64, 64, 0.0),
                                                  std=1.5).tolist())
    assert torch.equal(timesteps, ref.timesteps)
    # The pipeline's starting noise, (1, N, 4C) from the seed.
    noise = torch.randn((1, 64, 16), generator=torch.Generator().manual_seed(3))
    assert torch.equal(to_tokens(latents), noise)


def test_the_training_shift_is_the_samplers(spec):
    """train.timesteps.shift=auto: the pipeline's sigmas, logit-normal about mu (by resolution),
    are those about 0 shifted by exp(mu): 1 at 512^2, 2 at 1024^2, 4 at 2048^2."""
    from diffusers.pipelines.ideogram4.pipeline_ideogram4 import _logit_normal_sigmas

    from dpipe.diffusion.timesteps import shift_timesteps

    sampling = spec.sampling()
    f = spec.pixel_multiple
    for side, shift in ((512, 1.0), (1024, 2.0), (2048, 4.0)):
        latents = torch.zeros(1, 16, side // f, side // f)
        assert sampling.training_shift(latents) == pytest.approx(shift)
        about_mu = _logit_normal_sigmas(8, sampling.resolution_mu(latents), std=1.5)
        shifted = shift_timesteps(_logit_normal_sigmas(8, 0.0, std=1.5), shift)
        # the first sigma is clamped (log-SNR -15) whatever mu is
        torch.testing.assert_close(shifted[1:], about_mu[1:], rtol=1e-6, atol=1e-7)


def test_a_prompt_over_max_text_tokens_is_refused_naming_it_and_the_key(spec):
    from dpipe.errors import DataError

    encoders = spec.load_encoders(torch.device("cpu"), torch.float32)
    with pytest.raises(DataError, match=r"the caption or prompt 'a cat a cat .*' is \d+ tokens .* "
                                        rf"over model.max_text_tokens={TOKENS}"):
        spec.encode_prompts(encoders, [CAPTIONS[1], "a cat " * 40])


def test_a_negative_prompt_is_refused(spec):
    from dpipe.models.sampling import SampleRequest

    sampling = spec.sampling()
    assert sampling.check(SampleRequest(0, "a cat", "", 0, 64, 64)) is None
    assert "takes no prompt" in sampling.check(SampleRequest(0, "a cat", "blurry", 0, 64, 64))
