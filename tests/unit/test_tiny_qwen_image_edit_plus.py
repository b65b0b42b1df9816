"""The tiny Qwen-Image-Edit-2511 loads and edits through diffusers' QwenImageEditPlusPipeline; the
spec's several-reference conditioning (each reference's latents with its own RoPE frame, every
reference's vision tokens in the prompt, zero_cond_t) equals the pipeline's and the transformer's,
for 2511 and for 2509 (the same transformer without zero_cond_t)."""

import os

# Before any Hugging Face import: a hub lookup offline would stall ~48 s on retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import QwenImageEditPlusPipeline, QwenImageTransformer2DModel

from dpipe.config.schema import ModelConfig, SampleConfig
from dpipe.errors import ConfigError, ModelLoadError
from dpipe.models.lora_files import DIFFUSERS_LORA
from dpipe.models.qwen_image.edit import load_processor
from dpipe.models.qwen_image.edit_plus import QwenImageEditPlusSpec
from dpipe.models.qwen_image.spec import pack
from dpipe.models.qwen_image.tiny import make_tiny_qwen_image_edit
from dpipe.models.spec import NoisedBatch
from dpipe.models.sync_free import sizes
from tests.exports import export_lora

INSTRUCTIONS = ["put the star on the circle", "swap their colours"]


def _spec(path: Path) -> QwenImageEditPlusSpec:
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig),
                          {"family": "qwen_image_edit_plus", "path": str(path),
                           "max_text_tokens": 1024})
    out = QwenImageEditPlusSpec(OmegaConf.to_object(cfg))
    out.ensure_available()
    return out


@pytest.fixture(scope="module")
def spec(tiny) -> QwenImageEditPlusSpec:
    return _spec(tiny)


@pytest.fixture(scope="module")
def encoders(spec):
    return spec.load_encoders(torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def references() -> torch.Tensor:
    """Two prompts' two references each, (B, R, 3, H, W) in [-1, 1]."""
    return torch.rand(2, 2, 3, 64, 64, generator=torch.Generator().manual_seed(1)) * 2 - 1


def _pil(pixels: torch.Tensor):
    from PIL import Image

    array = ((pixels + 1) * 127.5).round().byte().permute(1, 2, 0).numpy()
    return Image.fromarray(np.ascontiguousarray(array))


def test_transformer_conditions_on_timestep_zero(tiny):
    assert json.loads((tiny / "transformer" / "config.json").read_text())["zero_cond_t"] is True


def test_another_pipelines_folder_is_refused(tmp_path):
    other = make_tiny_qwen_image_edit(tmp_path / "edit")
    with pytest.raises(ModelLoadError, match="holds a QwenImageEditPipeline.*model=qwen_image_edit"):
        _spec(other).read_configs()


@pytest.fixture(scope="module")
def text(spec, encoders, references) -> dict[str, torch.Tensor]:
    return spec.encode_prompts_with_controls(encoders, INSTRUCTIONS, references)


@pytest.mark.slow
def test_prompts_are_encoded_with_every_reference_as_the_pipeline_does(spec, encoders, references,
                                                                       text):
    lengths = text["text_len"].view(-1).long().tolist()
    for i, instruction in enumerate(INSTRUCTIONS):
        # The pipeline shows the VL encoder each reference at ~384x384 ("Picture 1: ...").
        images = [spec.prompt_image(encoders, r) for r in references[i]]
        assert [im.size for im in images] == [(384, 384)] * 2
        embeds, _ = encoders.encode_prompt([instruction], image=images)
        assert embeds.shape[1] == lengths[i] > 2 * 140  # both images' vision tokens
        torch.testing.assert_close(text["text"][i, :lengths[i]], embeds[0], rtol=1e-5, atol=1e-5)
    # Their order is part of the encoding (the text cache keys it).
    swapped = spec.encode_prompts_with_controls(encoders, INSTRUCTIONS[:1], references[:1].flip(1))
    assert not torch.allclose(swapped["text"][0], text["text"][0])


@pytest.fixture(scope="module")
def batch(spec, encoders, references, text) -> NoisedBatch:
    g = torch.Generator().manual_seed(0)
    x0 = spec.encode_images(encoders, torch.rand(2, 3, 64, 64, generator=g) * 2 - 1)
    control = torch.stack([spec.encode_images(encoders, references[:, r]) for r in range(2)], 1)
    noise = torch.randn(x0.shape, generator=g)
    t = torch.rand(2, generator=g)
    noisy, target = spec.noise(x0, noise, t)
    return NoisedBatch(x0, noise, t, noisy, target, text, control=control)


@pytest.mark.slow
@pytest.mark.parametrize("zero_cond_t", [True, False], ids=["2511", "2509"])
def test_layers_equal_the_transformer_with_two_references(spec, batch, zero_cond_t):
    inputs, (target,) = spec.make_inputs(batch)
    packed, t, text, text_len, shapes, refs = inputs
    assert sizes(shapes) == (1, 8, 8, 1, 8, 8, 1, 8, 8)  # the target's grid, then each reference's
    torch.testing.assert_close(refs, torch.cat([pack(batch.control[:, 0]),
                                                pack(batch.control[:, 1])], dim=1))
    torch.testing.assert_close(target, pack(batch.target))  # the loss is on the target only
    denoiser = spec.load_denoiser(torch.float32)
    if not zero_cond_t:  # 2509: the same transformer without zero_cond_t
        weights = denoiser.state_dict()
        denoiser = QwenImageTransformer2DModel.from_config(
            {**denoiser.config, "zero_cond_t": False})
        denoiser.load_state_dict(weights)
    with torch.no_grad():
        x = inputs
        for layer in spec.pipeline_layers(denoiser):
            x = layer(x)
        expected = spec.denoiser_forward(denoiser, inputs)
        swapped = spec.make_inputs(replace(batch, control=batch.control.flip(1)))[0]
        other_order = spec.denoiser_forward(denoiser, swapped)
    assert x.shape == (2, 64, 16)
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-5)
    # Each reference has its own RoPE frame: their order matters.
    assert (x - other_order).abs().max() > 1e-4


@pytest.mark.slow
def test_zero_cond_t_changes_the_prediction(spec, batch):
    inputs, _ = spec.make_inputs(batch)
    denoiser = spec.load_denoiser(torch.float32)
    plain = QwenImageTransformer2DModel.from_config({**denoiser.config, "zero_cond_t": False})
    plain.load_state_dict(denoiser.state_dict())
    with torch.no_grad():
        assert (spec.denoiser_forward(denoiser, inputs)
                - spec.denoiser_forward(plain, inputs)).abs().max() > 1e-4


def test_sample_requests_take_a_list_of_references(spec, tmp_path):
    from dpipe.sample.requests import sample_requests

    paths = []
    for i in range(4):
        paths.append(tmp_path / f"{i}.png")
        _pil(torch.zeros(3, 8, 8)).save(paths[-1])
    (two,) = sample_requests(SampleConfig(prompts=[
        {"prompt": "a", "control": [str(paths[1]), str(paths[0])]}]), spec)
    assert two.control == (str(paths[1]), str(paths[0])) == two.controls
    (one,) = sample_requests(SampleConfig(prompts=[{"prompt": "a", "control": str(paths[0])}]),
                             spec)
    assert one.control == str(paths[0]) and one.controls == (str(paths[0]),)
    with pytest.raises(ConfigError, match=r"sample.prompts\[0\]: control: 4 images, but "
                                          "qwen_image_edit_plus takes at most 3; give fewer"):
        sample_requests(SampleConfig(prompts=[{"prompt": "a", "control": list(map(str, paths))}]),
                        spec)
    with pytest.raises(ConfigError, match=r"sample.prompts\[0\].control\[1\]=/no/such.png: no "
                                          "such image file"):
        sample_requests(SampleConfig(prompts=[{"prompt": "a",
                                               "control": [str(paths[0]), "/no/such.png"]}]), spec)


@pytest.mark.slow
def test_sampling_through_the_layers_equals_the_pipeline(spec, encoders, tmp_path, monkeypatch):
    """Two references and a negative prompt (true CFG), encoded as the run's cache encodes a
    sample request's, denoised through the layers: the pipeline's latents for the same references,
    seed and steps."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus

    from dpipe.data.synthetic import draw_shape
    from dpipe.images import load_image
    from dpipe.models.sampling import SampleRequest
    from tests.unit.layered_sampling import nudged, sample_through_layers

    # The pipeline (and dpipe, which reads its constants) VAE-encode each reference at ~1 MP and
    # show it to the VL encoder at ~384x384: minutes for a CPU test; here both at 64x64, the same
    # code either way (the prompt test above keeps the real VL size).
    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", 64 * 64)
    monkeypatch.setattr(plus, "CONDITION_IMAGE_SIZE", 64 * 64)
    paths = []
    for i in range(2):
        paths.append(str(tmp_path / f"ref{i}.png"))
        draw_shape(i, 64)[0].save(paths[-1])
    request = SampleRequest(0, INSTRUCTIONS[0], " ", 3, 64, 64, control=tuple(paths))
    sampling = spec.sampling()
    assert sampling.check(request) is None and sampling.control_size(request) == (64, 64)
    pixels = torch.stack([load_image(Path(p), 64, 64) for p in paths])[None]  # (1, R, 3, H, W)
    text = spec.encode_prompts_with_controls(encoders, [request.prompt], pixels)
    uncond = spec.encode_prompts_with_controls(encoders, [request.negative_prompt], pixels)
    control = torch.stack([spec.encode_images(encoders, pixels[:, r]) for r in range(2)], 1)
    denoiser = nudged(spec.load_denoiser(torch.float32))
    with torch.no_grad():
        got = sample_through_layers(spec, denoiser, request, 2, 4.0, text, uncond, control)
        expected = sampling.diffusers_sample(denoiser, request, 2, 4.0)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_exported_lora_loads_in_the_edit_pipeline(spec, batch, tmp_path):
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    denoiser = spec.load_denoiser(torch.float32)
    rank = spec.cfg.lora.rank
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=spec.lora_targets(),
                                       init_lora_weights=False), denoiser)
    export_lora(spec, get_peft_model_state_dict(denoiser, adapter_name="default"), tmp_path)
    inputs, _ = spec.make_inputs(batch)
    pipe = QwenImageEditPlusPipeline.from_pretrained(
        spec.path, dtype=torch.float32, processor=load_processor(spec.path / "processor"))
    pipe.load_lora_weights(tmp_path, weight_name=DIFFUSERS_LORA)
    with torch.no_grad():
        trained = spec.denoiser_forward(denoiser, inputs)
        loaded = spec.denoiser_forward(pipe.transformer, inputs)
    torch.testing.assert_close(loaded, trained, rtol=1e-4, atol=1e-5)
