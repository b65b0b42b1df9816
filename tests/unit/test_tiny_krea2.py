"""The tiny Krea 2 loads and runs through diffusers' real code; its layers, prompts and latents
are the pipeline's."""

import os

# Before any Hugging Face import: a hub lookup offline would stall ~48 s on retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
from pathlib import Path

import pytest
import torch
from diffusers import Krea2Pipeline

from dpipe.models.common.latent_packing import pack
from dpipe.models.krea2.spec import Krea2Spec
from tests.unit.video_checks import noised_images, tiny_spec

CAPTIONS = ["a red circle on a blue background", "a cat"]
TOKENS = 16


@pytest.fixture(scope="module")
def pipe(tiny) -> Krea2Pipeline:
    return Krea2Pipeline.from_pretrained(tiny, dtype=torch.float32)


def _spec(path: Path, **values) -> Krea2Spec:
    return tiny_spec(path, "krea2", max_text_tokens=TOKENS, **values)


def test_text_layers_template_and_schedule_as_the_pipeline_takes_them(tiny, pipe):
    index = json.loads((tiny / "model_index.json").read_text())
    assert len(index["text_encoder_select_layers"]) == pipe.transformer.config.num_text_layers
    # The template lengths the pipeline relies on: a 34-token prefix, a 5-token suffix.
    assert len(pipe.tokenizer.tokenize(pipe.prompt_template_encode_prefix)) == 34
    assert len(pipe.tokenizer.tokenize(pipe.prompt_template_encode_suffix)) == 5
    assert pipe.scheduler.config.use_dynamic_shifting


def _inputs(spec, encoders, captions, seed=0):
    batch = noised_images(spec, encoders, captions, seed)
    return spec.make_inputs(batch), (batch.latents, batch.noise)


def test_prompts_are_the_pipelines(tiny, pipe):
    spec = _spec(tiny)
    encoders = spec.load_encoders(torch.device("cpu"), torch.float32)
    text = spec.encode_prompts(encoders, CAPTIONS)
    embeds, mask = pipe.encode_prompt(CAPTIONS, max_sequence_length=TOKENS)
    assert text["text"].shape == (2, TOKENS, 3, 32)
    assert torch.equal(text["text"], embeds)
    assert torch.equal(text["text_mask"].bool(), mask)
    assert not mask.all()  # padded in the middle: the suffix follows the padding
    assert mask[:, -5:].all()


def test_latents_are_what_the_pipeline_decodes(tiny, pipe):
    spec = _spec(tiny)
    encoders = spec.load_encoders(torch.device("cpu"), torch.float32)
    pixels = torch.rand(1, 3, 64, 64) * 2 - 1
    latents = spec.encode_images(encoders, pixels)
    # The pipeline's decode: latents / (1 / std) + mean, one frame.
    c = pipe.vae.config
    raw = latents[:, :, None] * torch.tensor(c.latents_std).view(1, -1, 1, 1, 1) \
        + torch.tensor(c.latents_mean).view(1, -1, 1, 1, 1)
    expected = pipe.vae.encode(pixels[:, :, None]).latent_dist.mode()
    torch.testing.assert_close(raw, expected)
    # The packing is the pipeline's
    x = torch.randn(1, 4, 16, 16)
    assert torch.equal(pack(x), pipe._pack_latents(x, 1, 4, 16, 16))
    assert spec.pixel_multiple == 8


def test_layers_equal_the_transformer_in_fp32(tiny):
    spec = _spec(tiny)
    encoders = spec.load_encoders(torch.device("cpu"), torch.float32)
    (inputs, labels), _ = _inputs(spec, encoders, CAPTIONS)
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
    loss = spec.loss(x, labels)
    assert torch.isfinite(loss)


def test_sampling_schedule_is_the_pipelines(tiny, pipe):
    from diffusers.pipelines.krea2.pipeline_krea2 import calculate_shift

    sampling = _spec(tiny).sampling()
    latents = torch.zeros(1, 4, 16, 16)
    scheduler = sampling.new_scheduler()
    c = scheduler.config
    expected = calculate_shift(64, c.base_image_seq_len, c.max_image_seq_len, c.base_shift,
                               c.max_shift)
    assert sampling.shift_mu(scheduler, latents) == pytest.approx(expected)
    assert sampling.uses_uncond(0.5) and not sampling.uses_uncond(0.0)
