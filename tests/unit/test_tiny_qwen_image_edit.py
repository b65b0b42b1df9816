"""The tiny Qwen-Image-Edit loads and edits through diffusers' real code; the edit conditioning of
the spec (reference latents, the VL encoder reading the control image) equals the pipeline's."""

import os

# Before any Hugging Face import: a hub lookup offline would stall ~48 s on retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


import numpy as np
import pytest
import torch
from diffusers import QwenImageEditPipeline

from dpipe.config.schema import ModelConfig
from dpipe.errors import DataError
from dpipe.models.qwen_image.edit import QwenImageEditSpec, load_processor
from dpipe.models.lora_files import DIFFUSERS_LORA
from dpipe.models.qwen_image.spec import pack
from dpipe.models.spec import NoisedBatch
from dpipe.models.sync_free import carrier, sizes
from tests.exports import export_lora

INSTRUCTIONS = ["make the circle blue", "add a small red star in the top left corner"]


@pytest.fixture(scope="module")
def spec(tiny) -> QwenImageEditSpec:
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig),
                          {"family": "qwen_image_edit", "path": str(tiny),
                           "max_text_tokens": 1536})
    out = QwenImageEditSpec(OmegaConf.to_object(cfg))
    out.ensure_available()
    return out


@pytest.fixture(scope="module")
def encoders(spec):
    return spec.load_encoders(torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def controls() -> torch.Tensor:
    return torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(1)) * 2 - 1


def test_edits_an_image(tiny, controls, monkeypatch):
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as edit_pipeline
    from PIL import Image

    # The pipeline resizes the reference to ~1024x1024 pixels whatever its size: fine for the
    # real model, minutes for a CPU test; here it works at 64x64 (the encoding test below keeps
    # the real size).
    real = edit_pipeline.calculate_dimensions
    monkeypatch.setattr(edit_pipeline, "calculate_dimensions",
                        lambda area, ratio: real(64 * 64, ratio))
    pipe = QwenImageEditPipeline.from_pretrained(
        tiny, dtype=torch.float32, processor=load_processor(tiny / "processor"))
    array = ((controls[0] + 1) * 127.5).round().byte().permute(1, 2, 0).numpy()
    image = Image.fromarray(np.ascontiguousarray(array))
    out = pipe(image=image, prompt=INSTRUCTIONS[0], height=64, width=64, num_inference_steps=2,
               true_cfg_scale=1.0, generator=torch.Generator().manual_seed(0), output_type="np")
    assert out.images.shape == (1, 64, 64, 3) and np.isfinite(out.images).all()


def test_prompts_are_encoded_with_the_control_image_as_the_pipeline_does(spec, encoders,
                                                                         controls):
    text = spec.encode_prompts_with_controls(encoders, INSTRUCTIONS, controls)
    lengths = text["text_len"].view(-1).long().tolist()
    for i, instruction in enumerate(INSTRUCTIONS):
        # The pipeline resizes the image to ~1024x1024 and lets the processor expand it into
        # vision tokens, which stay in the embedding (only the 64 template tokens are dropped).
        image = QwenImageEditSpec.prompt_image(encoders, controls[i])
        assert image.size == (1024, 1024)
        embeds, _ = encoders.encode_prompt([instruction], image=[image])
        assert embeds.shape[1] == lengths[i] > 1300
        torch.testing.assert_close(text["text"][i, :lengths[i]], embeds[0], rtol=1e-5, atol=1e-5)
    # Another control image, another encoding: the text cache must be keyed by it.
    other = spec.encode_prompts_with_controls(encoders, INSTRUCTIONS[:1], -controls[:1])
    assert not torch.allclose(other["text"][0], text["text"][0])
    assert spec.text_sees_control
    with pytest.raises(DataError, match="control"):
        spec.encode_prompts(encoders, INSTRUCTIONS)


@pytest.fixture(scope="module")
def batch(spec, encoders, controls) -> NoisedBatch:
    text = spec.encode_prompts_with_controls(encoders, INSTRUCTIONS, controls)
    g = torch.Generator().manual_seed(0)
    x0 = spec.encode_images(encoders, torch.rand(2, 3, 64, 64, generator=g) * 2 - 1)
    control = spec.encode_images(encoders, controls)
    noise = torch.randn(x0.shape, generator=g)
    t = torch.rand(2, generator=g)
    noisy, target = spec.noise(x0, noise, t)
    return NoisedBatch(x0, noise, t, noisy, target, text, control=control)


def test_reference_latents_join_the_image_tokens(spec, batch):
    inputs, (target,) = spec.make_inputs(batch)
    packed, t, text, text_len, shapes, reference = inputs
    assert sizes(shapes) == (1, 8, 8, 1, 8, 8)  # target grid, then the reference's
    torch.testing.assert_close(reference, pack(batch.control))
    torch.testing.assert_close(target, pack(batch.target))  # the loss is on the target only
    denoiser = spec.load_denoiser(torch.float32)
    with torch.no_grad():
        x = inputs
        for layer in spec.pipeline_layers(denoiser):
            x = layer(x)
        expected = spec.denoiser_forward(denoiser, inputs)
        without_reference = spec.denoiser_forward(
            denoiser, (packed, t, text, text_len, carrier(*sizes(shapes)[:3])))
    assert x.shape == (2, 64, 16)
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-6)
    assert (x - without_reference).abs().max() > 1e-4  # the reference conditions the result
    with pytest.raises(DataError, match="control_dir"):
        spec.make_inputs(NoisedBatch(batch.latents, batch.noise, batch.timesteps, batch.noisy,
                                     batch.target, batch.text))


def test_exported_lora_loads_in_the_edit_pipeline(spec, batch, tmp_path):
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    denoiser = spec.load_denoiser(torch.float32)
    rank = spec.cfg.lora.rank  # the export's metadata tells diffusers the rank
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=spec.lora_targets(),
                                       init_lora_weights=False), denoiser)
    export_lora(spec, get_peft_model_state_dict(denoiser, adapter_name="default"), tmp_path)
    inputs, _ = spec.make_inputs(batch)
    with torch.no_grad():
        trained = spec.denoiser_forward(denoiser, inputs)
        loaded = spec.denoiser_forward(spec.load_denoiser_with_lora(tmp_path, DIFFUSERS_LORA),
                                       inputs)
    torch.testing.assert_close(loaded, trained, rtol=1e-4, atol=1e-5)
