"""The tiny FLUX.2-dev folder loads and runs through diffusers' real loading code; FLUX.2
specifics: chat-formatted prompts, BatchNorm-normalised patchified latents, reference images."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLFlux2, Flux2Pipeline, Flux2Transformer2DModel
from transformers import Mistral3ForConditionalGeneration

from dpipe.config.schema import ModelConfig
from dpipe.models.flux2.spec import Flux2Spec
from dpipe.models.spec import NoisedBatch

CAPTION = "a red circle on a blue background"


@pytest.fixture(scope="module")
def spec(tiny) -> Flux2Spec:
    return Flux2Spec(ModelConfig(family="flux2", path=str(tiny), max_text_tokens=64,
                                 guidance=2.5))


@pytest.fixture(scope="module")
def pipe(spec) -> Flux2Pipeline:
    spec.ensure_available()
    pipe = spec.load_encoders(torch.device("cpu"), torch.float32)
    pipe.transformer = spec.load_denoiser(torch.float32)
    return pipe


def test_generates_an_image_and_an_edit(pipe):
    out = pipe(prompt=CAPTION, height=64, width=64, num_inference_steps=2, guidance_scale=2.5,
               max_sequence_length=64, generator=torch.Generator().manual_seed(0),
               output_type="pil")
    image = out.images[0]
    assert image.size == (64, 64)
    edit = pipe(prompt="make it green", image=[image], height=64, width=64,
                num_inference_steps=2, max_sequence_length=64, output_type="np")
    assert edit.images.shape == (1, 64, 64, 3) and np.isfinite(edit.images).all()


def test_components(pipe):
    assert isinstance(pipe.text_encoder, Mistral3ForConditionalGeneration)
    assert isinstance(pipe.vae, AutoencoderKLFlux2)
    assert isinstance(pipe.transformer, Flux2Transformer2DModel)


def test_prompt_format(spec, pipe):
    # System message, then the caption, in Mistral's chat format; the caption survives truncation.
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input

    ids = pipe.tokenizer.apply_chat_template(
        format_input([CAPTION], pipe.system_message), tokenize=True, return_dict=True,
        padding="max_length", truncation=True, max_length=64)["input_ids"][0]
    tokens = pipe.tokenizer.convert_ids_to_tokens(ids)
    assert tokens[:2] == ["<s>", "[SYSTEM_PROMPT]"] and "[/INST]" in tokens
    assert pipe.tokenizer.decode(ids[tokens.index("[INST]") + 1:tokens.index("[/INST]")]) == CAPTION
    text = spec.encode_prompts(pipe, [CAPTION])["text"]
    assert text.shape == (1, 64, 3 * pipe.text_encoder.config.text_config.hidden_size)


def test_latents_are_patchified_and_normalised(spec, pipe):
    pixels = torch.rand(1, 3, 64, 64) * 2 - 1
    latents = spec.encode_images(pipe, pixels)
    raw = pipe.vae.encode(pixels).latent_dist.mode()  # (1, 4, 16, 16)
    patched = Flux2Pipeline._patchify_latents(raw)
    bn = pipe.vae.bn
    expected = (patched - bn.running_mean.view(1, -1, 1, 1)) / torch.sqrt(
        bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps)
    assert latents.shape == (1, 16, 8, 8) and spec.pixel_multiple == 8
    torch.testing.assert_close(latents, expected)


def test_reference_image_inputs_match_the_pipeline(spec, pipe):
    """Edit training builds the transformer input as Flux2Pipeline does for one reference image:
    the reference tokens after the noisy ones, with ids whose t is 10; layers == diffusers."""
    torch.manual_seed(0)
    target, control = torch.randn(2, 16, 8, 8), torch.randn(2, 16, 8, 8)
    text = spec.encode_prompts(pipe, [CAPTION, "a star"])
    t = torch.tensor([0.3, 0.7])
    noisy = (1 - t.view(-1, 1, 1, 1)) * target + t.view(-1, 1, 1, 1) * torch.randn_like(target)
    batch = SimpleNamespace(latents=target, noise=None, timesteps=t, noisy=noisy,
                            target=target, text=text, loss_weight=None, control=control)
    inputs, labels = spec.make_inputs(batch)
    packed, _t, _text, guidance, txt_ids, img_ids = inputs

    latents, latent_ids = pipe.prepare_latents(2, 4, 64, 64, torch.float32, "cpu", None,
                                               latents=noisy)
    ref_ids = pipe._prepare_image_ids([control[:1]])[0]
    torch.testing.assert_close(packed, torch.cat([latents, Flux2Pipeline._pack_latents(control)], 1))
    assert torch.equal(img_ids, torch.cat([latent_ids[0], ref_ids]))
    assert torch.equal(txt_ids, pipe._prepare_text_ids(text["text"])[0])
    assert guidance.tolist() == [2.5, 2.5]

    with torch.no_grad():
        x = inputs
        for layer in spec.pipeline_layers(pipe.transformer):
            x = layer(x)
        expected = spec.denoiser_forward(pipe.transformer, inputs)
    assert x.shape == (2, 128, 16)  # 64 target + 64 reference tokens
    torch.testing.assert_close(x, expected, rtol=0, atol=0)
    # Only the target's tokens count.
    loss = spec.loss(x, labels)
    torch.testing.assert_close(loss, torch.nn.functional.mse_loss(x[:, :64], labels[0]))


@pytest.mark.slow
def test_several_reference_images_match_the_pipeline(spec, pipe):
    """Two references (B, R, C, h, w), of their own sizes: tokens in their order after the
    noisy ones, ids with t = 10 and 20 (Flux2Pipeline's `_prepare_image_ids`); layers ==
    diffusers, and the references' order changes the prediction."""
    torch.manual_seed(0)
    target = torch.randn(1, 16, 8, 8)
    control = torch.randn(1, 2, 16, 8, 8)
    text = spec.encode_prompts(pipe, [CAPTION])
    batch = NoisedBatch(latents=target, noise=target, timesteps=torch.tensor([0.4]),
                        noisy=target * 0.6, target=target, text=text, control=control)
    inputs, labels = spec.make_inputs(batch)
    packed, _t, _text, _guidance, _txt_ids, img_ids = inputs
    refs = [control[:, 0], control[:, 1]]
    torch.testing.assert_close(packed[:, 64:], torch.cat(
        [Flux2Pipeline._pack_latents(r) for r in refs], 1))
    assert torch.equal(img_ids[64:], pipe._prepare_image_ids(refs)[0])
    assert img_ids[64:, 0].unique().tolist() == [10, 20]
    with torch.no_grad():
        x = inputs
        for layer in spec.pipeline_layers(pipe.transformer):
            x = layer(x)
        expected = spec.denoiser_forward(pipe.transformer, inputs)
        swapped = spec.denoiser_forward(pipe.transformer, spec.make_inputs(
            replace(batch, control=control.flip(1)))[0])
    assert x.shape == (1, 192, 16)  # 64 target + 2 x 64 reference tokens
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-5)
    assert (x[:, :64] - swapped[:, :64]).abs().max() > 1e-4
    torch.testing.assert_close(spec.loss(x, labels),
                               torch.nn.functional.mse_loss(x[:, :64], labels[0]))


@pytest.mark.slow
def test_sampling_with_two_references_through_the_layers_equals_the_pipeline(spec, pipe,
                                                                             tmp_path):
    """An edit request with `control: [a.png, b.png]`, its references encoded as the run's cache
    encodes them, denoised through the layers: Flux2Pipeline's latents for the same references,
    seed and steps."""
    from dpipe.data.synthetic import draw_shape
    from dpipe.images import load_image
    from dpipe.models.sampling import SampleRequest
    from tests.unit.layered_sampling import nudged, sample_through_layers

    paths = []
    for i in range(2):
        paths.append(str(tmp_path / f"ref{i}.png"))
        draw_shape(i, 64)[0].save(paths[-1])
    request = SampleRequest(0, "put the star in the circle", "", 3, 64, 64, control=tuple(paths))
    sampling = spec.sampling()
    assert sampling.check(request) is None
    pixels = torch.stack([load_image(Path(p), 64, 64) for p in paths])  # (R, 3, H, W)
    control = spec.encode_images(pipe, pixels)[None]  # (1, R, C, h, w)
    text = spec.encode_prompts(pipe, [request.prompt])
    denoiser = nudged(spec.load_denoiser(torch.float32))
    with torch.no_grad():
        got = sample_through_layers(spec, denoiser, request, 2, 4.0, text, None, control)
        expected = sampling.diffusers_sample(denoiser, request, 2, 4.0)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_mask_weights_scale_the_loss(spec):
    latents = torch.randn(1, 16, 8, 8)
    plain = NoisedBatch(latents=latents, noise=latents, timesteps=torch.tensor([0.5]),
                        noisy=latents, target=latents, text={"text": torch.zeros(1, 4, 48)})
    _, labels = spec.make_inputs(plain)
    weighted = SimpleNamespace(latents=latents, noisy=latents, target=latents,
                               timesteps=torch.tensor([0.5]), text=plain.text, control=None,
                               loss_weight=torch.ones(1, 1, 8, 8))
    out = torch.randn(1, 64, 16)
    torch.testing.assert_close(spec.loss(out, spec.make_inputs(weighted)[1]),
                               spec.loss(out, labels))
    weighted.loss_weight = torch.zeros(1, 1, 8, 8)
    assert spec.loss(out, spec.make_inputs(weighted)[1]) == 0


def test_block_costs_follow_flops(spec, pipe):
    """Double- and single-stream blocks do the same FLOPs per token: stages balance by blocks."""
    from dpipe.models.flux2.layers import Flux2DoubleBlock, Flux2SingleBlock
    from tests.unit.video_checks import assert_block_costs_follow_flops, latent_inputs

    inputs = latent_inputs(spec, pipe, torch.randn(2, 16, 8, 8), [CAPTION, "a star"], [0.2, 0.9])
    assert_block_costs_follow_flops(spec, spec.pipeline_layers(pipe.transformer), inputs,
                                    (Flux2DoubleBlock, Flux2SingleBlock))


def test_prior_targets_leave_out_the_reference_tokens(spec):
    """Prior preservation on an edit micro-batch: the prediction's reference-image tokens are
    cut off (as `loss` cuts them), so the base model's prediction as the target gives loss 0."""
    target = torch.randn(2, 64, 16)
    out = torch.randn(2, 64 + 32, 16)  # 32 reference tokens after the image's
    labels = spec.prior_labels(out, (target,), [0, 1])
    torch.testing.assert_close(labels[0], out[:, :64])
    assert spec.loss(out, labels) == 0
