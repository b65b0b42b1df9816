"""The tiny HunyuanVideo 1.5 (t2v) folder loads through diffusers' real loading code; layers,
encoders (chat template crop, ByT5 glyph text), balanced split and LoRA exports."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from dpipe.config.schema import ModelConfig
from dpipe.errors import DataError
from dpipe.models.comfyui import peft_pairs
from dpipe.models.hunyuan_video.hunyuan_video15.spec import (
    COMFYUI_LORA, DIFFUSERS_LORA, HunyuanVideo15Spec, template_length)
from dpipe.pipeline.partition import stage_bounds
from tests.unit.video_checks import (
    CAPTIONS, assert_checkpointing_matches, assert_layers_match, deltas, lora_denoiser,
    attention_masks_of_layers_and_diffusers, lora_state_dict, micro_batch)
from tests.exports import export_lora


@pytest.fixture(scope="module")
def spec(tiny) -> HunyuanVideo15Spec:
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), {
        "family": "hunyuan_video15", "path": str(tiny), "max_text_tokens": 16,
        "lora": {"rank": 4, "alpha": 8}}))
    spec = HunyuanVideo15Spec(cfg)
    spec.ensure_available()
    return spec


@pytest.fixture(scope="module")
def encoders(spec):
    return spec.load_encoders(torch.device("cpu"), torch.float32)


def test_transformer_as_the_real_repo(tiny):
    config = json.loads((tiny / "transformer/config.json").read_text())
    assert config["task_type"] == "t2v" and config["in_channels"] == 2 * config["out_channels"] + 1


def test_template_crop_and_glyph_text(spec, encoders):
    tok = encoders.tokenizer
    crop = template_length(tok, encoders.system_message)
    assert encoders.prompt_template_encode_start_idx == crop
    text = tok.apply_chat_template([[{"role": "system", "content": encoders.system_message},
                                     {"role": "user", "content": CAPTIONS[0]}]],
                                   add_generation_prompt=True, tokenize=False)[0]
    ids = tok(text, add_special_tokens=False).input_ids
    prompt = tok(CAPTIONS[0], add_special_tokens=False).input_ids
    assert ids[crop:crop + len(prompt)] == prompt
    out = spec.encode_prompts(encoders, [CAPTIONS[0], 'a sign that reads "OPEN"'])
    assert out["qwen"].shape == (2, 16, 32) and out["byt5"].shape == (2, 256, 24)
    assert out["byt5_mask"][0].sum() == 0 and out["byt5_mask"][1].sum() > 0  # quoted text only


def test_encode_images_and_clips(spec, encoders):
    assert spec.encode_images(encoders, torch.zeros(2, 3, 64, 64)).shape == (2, 4, 1, 8, 8)
    assert spec.encode_videos(encoders, torch.zeros(2, 3, 9, 64, 64)).shape == (2, 4, 3, 8, 8)
    with pytest.raises(DataError, match="4k\\+1"):
        spec.encode_videos(encoders, torch.zeros(1, 3, 6, 64, 64))


@pytest.mark.parametrize("frames", [1, 9])
def test_layers_match_diffusers_on_video_latents(spec, encoders, frames):
    inputs, _ = micro_batch(spec, encoders, torch.rand(2, 3, frames, 64, 64) * 2 - 1)
    assert inputs[0].shape == (2, 9, (frames - 1) // 4 + 1, 8, 8)  # noisy, condition, mask
    assert_layers_match(spec, lora_denoiser(spec), inputs)


@pytest.mark.parametrize("prompts", [CAPTIONS[:1], ['a sign that reads "OPEN"'], CAPTIONS])
def test_text_padding_is_cut_and_gives_diffusers_padded_output(spec, encoders, prompts,
                                                               monkeypatch):
    """make_inputs cuts both text streams after their longest prompt (no quoted text: no glyph
    stream), and the embed layer the ordered tokens after the most real ones, so the 729 zero
    image tokens of text-to-video never reach a block. One prompt then leaves nothing to mask
    and no attention call gets a mask (SDPA can run flash); two keep one, on the keys only. The
    layers give diffusers' output, its own processor's (a query x key mask), on the text as
    cached."""
    import copy

    from diffusers.models.transformers.transformer_hunyuan_video15 import (
        HunyuanVideo15AttnProcessor2_0)
    from dpipe.models.spec import NoisedBatch

    text = spec.encode_prompts(encoders, prompts)
    latents = torch.randn(len(prompts), 4, 3, 8, 8)
    t = torch.tensor([0.3, 0.8][:len(prompts)])
    noisy, target = spec.noise(latents, latents, t)
    inputs, _ = spec.make_inputs(NoisedBatch(latents, latents, t, noisy, target, text))
    real, real_glyph = text["mask"].sum(1), text["byt5_mask"].sum(1)
    assert inputs[2].shape[1] == int(real.max()) and inputs[4].shape[1] == int(real_glyph.max())
    one = len(prompts) == 1
    assert inputs[6].shape[1] == (0 if one else int((real + real_glyph).max()))
    cached = (*inputs[:2], text["qwen"], text["mask"].long(), text["byt5"],
              text["byt5_mask"].long(), inputs[6])
    denoiser = lora_denoiser(spec)
    diffusers_own = copy.deepcopy(denoiser)  # the layers give the copy's blocks dpipe's processor
    layers = spec.pipeline_layers(denoiser)
    processors = {type(m.processor) for m in diffusers_own.transformer_blocks.modules()
                  if hasattr(m, "processor")}
    assert processors == {HunyuanVideo15AttnProcessor2_0}
    video, joint = layers[0](inputs)[:2]
    assert joint.shape[1] == int((real + real_glyph).max())  # no image tokens
    got, expected, ours, theirs = attention_masks_of_layers_and_diffusers(
        monkeypatch, spec, layers, inputs, diffusers_own, cached)
    assert ours and all(m is not None for m in theirs)  # diffusers always masks
    assert all(m is None for m in ours) == one
    # The blocks' (not the token refiner's) masks: on the keys only.
    in_blocks = [m for m in ours
                 if m is not None and m.shape[-1] == video.shape[1] + joint.shape[1]]
    assert all(m.shape[-2] == 1 for m in in_blocks) and (len(in_blocks) > 0) != one
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_activation_checkpointing_gives_the_same_gradients(spec, encoders):
    inputs, labels = micro_batch(spec, encoders, torch.rand(2, 3, 5, 64, 64) * 2 - 1)
    assert_checkpointing_matches(spec, lora_denoiser(spec), inputs, labels)


def test_two_stages_each_get_blocks(spec):
    # The ByT5 projection (a 2048-wide MLP) outweighs a tiny block by parameters; costs count
    # parameters x tokens, so the first stage still gets transformer blocks (LoRA weights).
    layers = spec.pipeline_layers(spec.load_denoiser(torch.float32))
    from dpipe.config.schema import PipelineConfig

    bounds = stage_bounds(spec.layer_costs(layers), 2, PipelineConfig().partition, None)
    assert bounds[1] >= 2


@pytest.fixture(scope="module")
def exported(spec, tmp_path_factory):
    denoiser = lora_denoiser(spec)
    out = tmp_path_factory.mktemp("lora")
    assert export_lora(spec, lora_state_dict(denoiser), out) == [out / DIFFUSERS_LORA,
                                                                 out / COMFYUI_LORA]
    return denoiser, out


def test_diffusers_lora_loads_into_the_transformer(spec, encoders, exported):
    denoiser, out = exported
    inputs, _ = micro_batch(spec, encoders, torch.rand(2, 3, 5, 64, 64) * 2 - 1)
    with torch.no_grad():
        expected = spec.denoiser_forward(denoiser, inputs)
        loaded = spec.denoiser_forward(spec.load_denoiser_with_lora(out), inputs)
    torch.testing.assert_close(loaded, expected, rtol=1e-4, atol=1e-5)


def test_comfyui_lora_keys_and_weights(spec, exported):
    denoiser, out = exported
    comfy = load_file(out / COMFYUI_LORA)
    assert "diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight" in comfy
    assert "diffusion_model.double_blocks.3.txt_mod.lin.lora_B.weight" in comfy
    assert "diffusion_model.double_blocks.1.img_mlp.2.lora_A.weight" in comfy
    config = json.loads((spec.path / "transformer/config.json").read_text())
    names = {k.replace(".default", ""): v for k, v in lora_state_dict(denoiser).items()}
    parts = deltas(peft_pairs(names), scale=8 / 4)
    fused = deltas({k.removeprefix("diffusion_model."): v for k, v in peft_pairs(comfy).items()})
    mapping = list(HunyuanVideo15Spec.comfyui_mapping(config, names))
    assert len(fused) == len(mapping) == 4 * 10
    for original, modules, sizes in mapping:
        want = torch.cat([parts[m] for m in modules])
        torch.testing.assert_close(fused[original], want, rtol=1e-5, atol=1e-6)

