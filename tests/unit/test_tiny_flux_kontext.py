"""The tiny FLUX.1 Kontext folder loads with FluxKontextPipeline and edits; edit-training inputs
are built exactly as the pipeline builds them for a reference image."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from types import SimpleNamespace

import pytest
import torch
from diffusers import FluxKontextPipeline

from dpipe.config.schema import ModelConfig
from dpipe.errors import ModelLoadError
from dpipe.models.flux.kontext import FluxKontextSpec

CAPTION = "make the circle green"


@pytest.fixture(scope="module")
def spec(tiny) -> FluxKontextSpec:
    spec = FluxKontextSpec(ModelConfig(family="flux_kontext", path=str(tiny),
                                       max_text_tokens=32, guidance=2.5))
    spec.ensure_available()
    return spec


@pytest.fixture(scope="module")
def pipe(tiny) -> FluxKontextPipeline:
    return FluxKontextPipeline.from_pretrained(tiny, dtype=torch.float32)


def test_refuses_a_flux1_dev_folder(tmp_path):
    from dpipe.models.flux.tiny import make_tiny_flux

    dev = make_tiny_flux(tmp_path / "dev")
    with pytest.raises(ModelLoadError, match="model=flux"):
        FluxKontextSpec(ModelConfig(family="flux_kontext", path=str(dev))).ensure_available()


def test_reference_inputs_match_the_pipeline(spec, pipe):
    torch.manual_seed(0)
    target, control = torch.randn(2, 4, 16, 16), torch.randn(2, 4, 16, 16)
    text = spec.encode_prompts(pipe, [CAPTION, "a star"])
    t = torch.tensor([0.2, 0.8])
    noisy = (1 - t.view(-1, 1, 1, 1)) * target + t.view(-1, 1, 1, 1) * torch.randn_like(target)
    batch = SimpleNamespace(latents=target, noisy=noisy, target=target, timesteps=t, text=text,
                            loss_weight=None, control=control)
    inputs, labels = spec.make_inputs(batch)
    packed, _t, _text, _pooled, _guidance, _txt_ids, img_ids = inputs

    # What FluxKontextPipeline feeds its transformer for these latents and this reference.
    pipe_noisy = pipe._pack_latents(noisy, 2, 4, 16, 16)
    _, image_latents, latent_ids, image_ids = pipe.prepare_latents(
        control, 2, 4, 64, 64, torch.float32, "cpu", latents=pipe_noisy)
    torch.testing.assert_close(packed, torch.cat([pipe_noisy, image_latents], dim=1))
    torch.testing.assert_close(img_ids.float(), torch.cat([latent_ids, image_ids], dim=0))
    assert img_ids[64:, 0].eq(1).all() and img_ids[:64, 0].eq(0).all()

    denoiser = pipe.transformer
    with torch.no_grad():
        x = inputs
        for layer in spec.pipeline_layers(denoiser):
            x = layer(x)
        expected = spec.denoiser_forward(denoiser, inputs)
    assert x.shape == (2, 128, 16)
    torch.testing.assert_close(x, expected, rtol=0, atol=0)
    torch.testing.assert_close(spec.loss(x, labels),
                               torch.nn.functional.mse_loss(x[:, :64], labels[0]))


def test_reference_images_of_another_size(spec, pipe):
    """The reference may have its own size (Kontext's preferred resolutions): its ids follow it."""
    target, control = torch.randn(1, 4, 16, 16), torch.randn(1, 4, 8, 24)
    text = spec.encode_prompts(pipe, [CAPTION])
    batch = SimpleNamespace(latents=target, noisy=target, target=target,
                            timesteps=torch.tensor([0.5]), text=text, loss_weight=None,
                            control=control)
    inputs, _ = spec.make_inputs(batch)
    img_ids = inputs[-1]
    assert inputs[0].shape[1] == 64 + 48 and img_ids.shape == (112, 3)
    assert img_ids[64:, 1].max() == 3 and img_ids[64:, 2].max() == 11
