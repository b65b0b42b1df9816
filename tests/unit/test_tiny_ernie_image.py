"""The tiny ERNIE-Image loads and runs through diffusers' real code; its layers, prompts, latents
and sampling schedule are the pipeline's."""

import os

# Before any Hugging Face import: a hub lookup offline would stall ~48 s on retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import pytest
import torch
from diffusers import ErnieImagePipeline, FlowMatchEulerDiscreteScheduler

from dpipe.models.ernie_image.sampling import unpatchify
from dpipe.models.ernie_image.spec import ErnieImageSpec, patchify
from dpipe.models.sampling import SampleRequest
from tests.unit.video_checks import noised_images, tiny_spec

CAPTIONS = ["a red circle on a blue background", "a cat"]
TOKENS = 16


@pytest.fixture(scope="module")
def pipe(tiny) -> ErnieImagePipeline:
    return ErnieImagePipeline.from_pretrained(tiny, dtype=torch.float32)


def _spec(path: Path, tokens: int = TOKENS) -> ErnieImageSpec:
    return tiny_spec(path, "ernie_image", max_text_tokens=tokens)


def test_tokens_and_schedule_as_the_pipeline_takes_them(pipe):
    assert pipe.tokenizer("a cat")["input_ids"][0] == pipe.tokenizer.bos_token_id == 1
    assert not pipe.scheduler.config.use_dynamic_shifting  # the pipeline passes no mu


def _inputs(spec, encoders, captions, seed=0):
    return spec.make_inputs(noised_images(spec, encoders, captions, seed))


def test_prompts_are_the_pipelines(tiny, pipe):
    spec = _spec(tiny)
    encoders = spec.load_encoders(torch.device("cpu"), torch.float32)
    assert encoders.pe is None
    text = spec.encode_prompts(encoders, CAPTIONS)
    expected = pipe.encode_prompt(CAPTIONS, device=torch.device("cpu"))
    assert text["text"].shape == (2, TOKENS, 32)
    assert text["text_len"].flatten().tolist() == [e.shape[0] for e in expected]
    for i, e in enumerate(expected):
        assert torch.equal(text["text"][i, :e.shape[0]], e)
        assert not text["text"][i, e.shape[0]:].any()
    # Longer prompts are cut at max_text_tokens, as the pipeline's tokenizer cuts at its
    # model_max_length; the tokenizer is left as it was.
    short = _spec(tiny, tokens=4).encode_prompts(encoders, CAPTIONS[:1])
    pipe.tokenizer.model_max_length = 4
    assert torch.equal(short["text"][0], pipe.encode_prompt(CAPTIONS[:1], torch.device("cpu"))[0])
    assert encoders.tokenizer.model_max_length > 10**6


def test_latents_are_what_the_pipeline_decodes(tiny, pipe):
    spec = _spec(tiny)
    encoders = spec.load_encoders(torch.device("cpu"), torch.float32)
    pixels = torch.rand(1, 3, 64, 64) * 2 - 1
    latents = spec.encode_images(encoders, pixels)
    assert latents.shape == (1, 16, 8, 8)
    # The pipeline's decode: x * sqrt(var + 1e-5) + mean, then unpatchify.
    bn = pipe.vae.bn
    raw = latents * torch.sqrt(bn.running_var.view(1, -1, 1, 1) + 1e-5) \
        + bn.running_mean.view(1, -1, 1, 1)
    expected = pipe.vae.encode(pixels).latent_dist.mode()
    torch.testing.assert_close(pipe._unpatchify_latents(raw), expected)
    x = torch.randn(1, 4, 16, 16)
    assert torch.equal(patchify(x), pipe._patchify_latents(x))
    assert torch.equal(unpatchify(patchify(x)), pipe._unpatchify_latents(patchify(x)))
    assert spec.pixel_multiple == pipe.vae_scale_factor == 8


def test_layers_equal_the_transformer_in_fp32(tiny):
    spec = _spec(tiny)
    encoders = spec.load_encoders(torch.device("cpu"), torch.float32)
    inputs, labels = _inputs(spec, encoders, CAPTIONS)
    assert inputs[2].shape[1] == int(inputs[3].max()) < TOKENS  # cut after the longest prompt
    assert inputs[3][0] != inputs[3][1]  # a padded prompt: the mask matters
    denoiser = spec.load_denoiser(torch.float32)
    layers = spec.pipeline_layers(denoiser)
    assert len(layers) == spec.pipeline_layer_count() == 4
    with torch.no_grad():
        x = inputs
        for layer in layers:
            x = layer(x)
        expected = spec.denoiser_forward(denoiser, inputs)
        # The pipeline's call: padded to the batch's longest prompt, timestep as sigma * 1000.
        image, t, text, lens = inputs
        direct = denoiser(hidden_states=image, timestep=t * 1000, text_bth=text, text_lens=lens,
                          return_dict=False)[0]
    assert x.shape == labels[0].shape == (2, 16, 8, 8)
    assert torch.equal(x, expected) and torch.equal(x, direct)
    assert x.abs().sum() > 0
    assert torch.isfinite(spec.loss(x, labels))


def test_sampling_is_the_pipelines(tiny):
    spec = _spec(tiny)
    sampling = spec.sampling()
    scheduler = sampling.new_scheduler()
    timesteps = sampling.set_timesteps(scheduler, 4, torch.zeros(1, 16, 8, 8))
    reference = FlowMatchEulerDiscreteScheduler.from_pretrained(tiny, subfolder="scheduler")
    reference.set_timesteps(sigmas=torch.linspace(1.0, 0.0, 5)[:-1])
    assert torch.equal(timesteps, reference.timesteps)
    request = SampleRequest(0, CAPTIONS[0], "", seed=3, width=64, height=64)
    assert sampling.latent_shape(request) == (16, 8, 8)
    assert sampling.uses_uncond(4.0) and not sampling.uses_uncond(1.0)
