"""The tiny HunyuanVideo folder loads through diffusers' real loading code; its pipeline layers,
encoders and LoRA exports behave as the real model's must."""

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
from dpipe.models.lora_files import DIFFUSERS_LORA
from dpipe.models.hunyuan_video.spec import (
    COMFYUI_LORA, HunyuanVideoSpec, prompt_template)
from tests.unit.video_checks import (
    CAPTIONS, assert_block_costs_follow_flops, assert_checkpointing_matches, assert_layers_match,
    attention_masks_of_layers_and_diffusers, deltas, lora_denoiser, lora_state_dict, micro_batch)
from tests.exports import export_lora


@pytest.fixture(scope="module")
def spec(tiny) -> HunyuanVideoSpec:
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), {
        "family": "hunyuan_video", "path": str(tiny), "max_text_tokens": 16,
        "lora": {"rank": 4, "alpha": 8}}))
    spec = HunyuanVideoSpec(cfg)
    spec.ensure_available()
    return spec


@pytest.fixture(scope="module")
def encoders(spec):
    return spec.load_encoders(torch.device("cpu"), torch.float32)


def test_vae_as_the_real_repo(tiny):
    vae = json.loads((tiny / "vae/config.json").read_text())
    assert vae["temporal_compression_ratio"] == 4 and vae["scaling_factor"] == 0.476986


def test_tokenizer_keeps_spaces_where_llama_tokenizer_fast_drops_them(tiny, encoders):
    # transformers 5's LlamaTokenizerFast swaps the byte-level pre-tokenizer for Metaspace.
    from transformers import LlamaTokenizerFast

    naive = LlamaTokenizerFast.from_pretrained(tiny / "tokenizer")
    assert naive.decode(naive(CAPTIONS[0], add_special_tokens=False).input_ids) != CAPTIONS[0]
    ours = encoders.tokenizer
    assert ours.decode(ours(CAPTIONS[0], add_special_tokens=False).input_ids) == CAPTIONS[0]
    assert ours.padding_side == "right"


def test_template_is_cropped_where_the_prompt_starts(encoders):
    tok = encoders.tokenizer
    template = prompt_template(tok)
    ids = tok(template["template"].format(CAPTIONS[0])).input_ids
    prompt_ids = tok(CAPTIONS[0], add_special_tokens=False).input_ids
    crop = template["crop_start"]
    assert ids[crop:crop + len(prompt_ids)] == prompt_ids


def test_encode_images_and_clips(spec, encoders):
    images = spec.encode_images(encoders, torch.zeros(2, 3, 64, 64))
    assert images.shape == (2, 4, 1, 16, 16)
    clip = spec.encode_videos(encoders, torch.zeros(1, 3, 9, 64, 64))
    assert clip.shape == (1, 4, 3, 16, 16)  # 4k+1 frames -> k+1 latent frames
    torch.testing.assert_close(spec.encode_videos(encoders, torch.zeros(2, 3, 1, 64, 64)), images)
    with pytest.raises(DataError, match="4k\\+1"):
        spec.encode_videos(encoders, torch.zeros(1, 3, 8, 64, 64))
    text = spec.encode_prompts(encoders, CAPTIONS)
    assert text["llama"].shape == (2, 16, 32) and text["pooled"].shape == (2, 32)
    assert text["mask"].sum(1).tolist() == [len(encoders.tokenizer(c, add_special_tokens=False)
                                              .input_ids) + 1 for c in CAPTIONS]  # + <|eot_id|>


@pytest.mark.parametrize("frames", [1, 5, 9])
def test_layers_match_diffusers_on_video_latents(spec, encoders, frames):
    denoiser = lora_denoiser(spec)
    inputs, _ = micro_batch(spec, encoders, torch.rand(2, 3, frames, 64, 64) * 2 - 1)
    assert inputs[0].shape[2] == (frames - 1) // 4 + 1
    out = assert_layers_match(spec, denoiser, inputs)
    assert out.shape == inputs[0].shape


@pytest.mark.parametrize("clips", [1, 2])
def test_text_padding_is_cut_and_gives_diffusers_padded_output(spec, encoders, clips,
                                                               monkeypatch):
    """make_inputs cuts the text after its longest prompt: one clip then has no padding left and
    no attention call gets a mask (so SDPA can run flash); two prompts of different lengths keep
    a mask. The layers' output equals diffusers' forward on the text padded as cached."""
    denoiser = lora_denoiser(spec)
    inputs, _ = micro_batch(spec, encoders, torch.rand(clips, 3, 5, 64, 64) * 2 - 1)
    text = spec.encode_prompts(encoders, CAPTIONS[:clips])
    real = text["mask"].sum(1)
    assert text["llama"].shape[1] == 16 and int(real.max()) < 16  # cached padded, to 16
    assert inputs[2].shape[1] == int(real.max())
    assert inputs[3].shape[1] == (0 if clips == 1 else int(real.max()))
    padded = (*inputs[:2], text["llama"].float(), text["mask"].long(), *inputs[4:])
    got, expected, ours, theirs = attention_masks_of_layers_and_diffusers(
        monkeypatch, spec, spec.pipeline_layers(denoiser), inputs, denoiser, padded)
    assert ours and any(m is not None for m in theirs)  # diffusers' forward masks
    assert all(m is None for m in ours) == (clips == 1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_activation_checkpointing_gives_the_same_gradients(spec, encoders):
    denoiser = lora_denoiser(spec)
    inputs, labels = micro_batch(spec, encoders, torch.rand(2, 3, 5, 64, 64) * 2 - 1)
    assert_checkpointing_matches(spec, denoiser, inputs, labels)


@pytest.fixture(scope="module")
def exported(spec, tmp_path_factory):
    denoiser = lora_denoiser(spec)
    out = tmp_path_factory.mktemp("lora")
    files = export_lora(spec, lora_state_dict(denoiser), out)
    assert files == [out / DIFFUSERS_LORA, out / COMFYUI_LORA]
    return denoiser, out


def test_diffusers_lora_loads_with_the_pipeline(spec, encoders, exported):
    denoiser, out = exported
    inputs, _ = micro_batch(spec, encoders, torch.rand(2, 3, 5, 64, 64) * 2 - 1)
    with torch.no_grad():
        expected = spec.denoiser_forward(denoiser, inputs)
        loaded = spec.denoiser_forward(spec.load_denoiser_with_lora(out), inputs)
    torch.testing.assert_close(loaded, expected, rtol=1e-4, atol=1e-5)


def test_comfyui_lora_keys_and_weights(spec, exported):
    denoiser, out = exported
    comfy = load_file(out / COMFYUI_LORA)
    # The original HunyuanVideo names ComfyUI maps ("diffusion-pipe format"), with no alpha.
    assert "diffusion_model.double_blocks.0.img_attn_qkv.lora_A.weight" in comfy
    assert "diffusion_model.double_blocks.1.txt_mod.linear.lora_B.weight" in comfy
    assert "diffusion_model.single_blocks.1.linear1.lora_A.weight" in comfy
    assert "diffusion_model.single_blocks.0.modulation.linear.lora_B.weight" in comfy
    assert not any(k.endswith(".alpha") for k in comfy)
    config = json.loads((spec.path / "transformer/config.json").read_text())
    diffusers_names = lora_state_dict(denoiser)
    parts = deltas(peft_pairs(diffusers_names), scale=8 / 4)
    fused = deltas({k[len("diffusion_model."):]: v for k, v in peft_pairs(comfy).items()})
    mapping = list(HunyuanVideoSpec.comfyui_mapping(
        config, {k.replace(".default", ""): v for k, v in diffusers_names.items()}))
    assert len(fused) == len(mapping) == 2 * 10 + 2 * 3
    for original, names, sizes in mapping:
        want = torch.cat([parts.get(n, torch.zeros(s, 32)) for n, s in zip(names, sizes)])
        torch.testing.assert_close(fused[original], want, rtol=1e-5, atol=1e-6)


def test_comfyui_double_blocks_agree_with_diffusers_converter(exported):
    # diffusers' own converter for original-format HunyuanVideo LoRAs (its single-block branch
    # assumes the real hidden size 3072, so only the double blocks can be checked this way).
    from diffusers.loaders.lora_conversion_utils import _convert_hunyuan_video_lora_to_diffusers

    denoiser, out = exported
    comfy = {k: v for k, v in load_file(out / COMFYUI_LORA).items() if "double_blocks" in k}
    converted = _convert_hunyuan_video_lora_to_diffusers(dict(comfy))
    got = deltas(peft_pairs({k.removeprefix("transformer."): v for k, v in converted.items()}))
    want = deltas({k: v for k, v in peft_pairs(lora_state_dict(denoiser)).items()
                   if k.startswith("transformer_blocks")}, scale=8 / 4)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_mask_weights_the_loss(spec):
    from dpipe.models.spec import NoisedBatch

    x0 = torch.randn(2, 4, 2, 16, 16)
    noise, t = torch.randn_like(x0), torch.tensor([0.2, 0.9])
    noisy, target = spec.noise(x0, noise, t)
    text = {"llama": torch.zeros(2, 16, 32), "mask": torch.ones(2, 16), "pooled": torch.zeros(2, 32)}
    weight = torch.zeros(2, 1, 1, 16, 16)
    weight[..., :8] = 1.0  # the left half counts
    batch = NoisedBatch(latents=x0, noise=noise, timesteps=t, noisy=noisy, target=target, text=text,
                      loss_weight=weight)
    _, labels = spec.make_inputs(batch)
    out = target + torch.randn_like(target)
    out[..., :8] = target[..., :8]  # perfect where the mask is 1
    assert spec.loss(out, labels).item() == 0.0
    assert spec.loss(out, labels[:1]).item() > 0.1


def test_block_costs_follow_flops(spec, encoders):
    """Double- and single-stream blocks do the same FLOPs per token: stages balance by blocks,
    not by parameters (a double block holds ~2.4x a single one's)."""
    from dpipe.models.hunyuan_video.layers import HunyuanVideoBlock

    denoiser = lora_denoiser(spec)
    inputs, _ = micro_batch(spec, encoders, torch.rand(2, 3, 5, 64, 64) * 2 - 1)
    assert_block_costs_follow_flops(spec, spec.pipeline_layers(denoiser), inputs,
                                    HunyuanVideoBlock)
