"""The tiny Qwen-Image loads and runs through diffusers' real code; Qwen-Image specifics."""

import os

# Before any Hugging Face import: a hub lookup offline would stall ~48 s on retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import re
from pathlib import Path

import pytest
import torch
from diffusers import QwenImagePipeline
from safetensors.torch import load_file

from dpipe.models.lora_files import DIFFUSERS_LORA
from dpipe.models.qwen_image.spec import COMFY_LORA, QwenImageSpec, pack
from dpipe.models.common.tiny_qwen_tokenizer import TEMPLATES
from tests.unit.video_checks import (
    attention_masks_of_layers_and_diffusers, noised_images, tiny_spec)
from tests.exports import export_lora

CAPTIONS = ["a red circle on a blue background", "a cat",
            "A photo of two green stars, a painting of a dog in the park, an illustration"]


@pytest.fixture(scope="module")
def pipe(tiny) -> QwenImagePipeline:
    return QwenImagePipeline.from_pretrained(tiny, dtype=torch.float32)


def _spec(path: Path, **values) -> QwenImageSpec:
    return tiny_spec(path, "qwen_image", max_text_tokens=24, **values)


def test_vae_and_schedule_as_the_pipeline_takes_them(pipe):
    assert pipe.vae_scale_factor == 4 and pipe.scheduler.config.use_dynamic_shifting


def test_templates_have_their_real_token_counts(pipe):
    # The pipelines cut a fixed number of template tokens off every encoding: 34 (text-to-image)
    # and 64 (edit, up to the image's vision tokens), as the real vocabulary tokenizes them.
    t2i = pipe.tokenizer.tokenize(TEMPLATES[0].split("{}")[0])
    assert len(t2i) == 34 and t2i[-2:] == ["user", "Ċ"]
    edit = pipe.tokenizer.tokenize(TEMPLATES[1].split("{}")[0])
    assert edit[64] == "<|vision_start|>"  # after the 64 dropped tokens come the vision tokens
    words = pipe.tokenizer.tokenize(" " + CAPTIONS[0])
    assert len(words) == len(CAPTIONS[0].split())


def _inputs(spec, encoders, captions, seed=0):
    return spec.make_inputs(noised_images(spec, encoders, captions, seed))


def test_latents_and_prompts_as_the_pipeline_makes_them(tiny, pipe):
    spec = _spec(tiny)
    encoders = spec.load_encoders(torch.device("cpu"), torch.float32)
    pixels = torch.rand(1, 3, 64, 64) * 2 - 1
    latents = spec.encode_images(encoders, pixels)
    # The edit pipeline's reference-image encoding is the normalised argmax latent: the same.
    from diffusers import QwenImageEditPipeline

    expected = QwenImageEditPipeline._encode_vae_image(
        type("P", (), {"vae": pipe.vae, "latent_channels": 4})(), pixels[:, :, None], None)
    torch.testing.assert_close(latents, expected[:, :, 0])
    text = spec.encode_prompts(encoders, CAPTIONS[:2])
    embeds, mask = pipe.encode_prompt(CAPTIONS[:2], max_sequence_length=24)
    n = embeds.shape[1]
    assert text["text"].shape == (2, 24, 32)
    torch.testing.assert_close(text["text"][:, :n], embeds)
    assert text["text_len"].view(-1).tolist() == mask.sum(1).tolist()


def test_layers_match_the_forward_for_prompts_of_any_length(tiny):
    spec = _spec(tiny)
    encoders = spec.load_encoders(torch.device("cpu"), torch.float32)
    inputs, (target,) = _inputs(spec, encoders, CAPTIONS)
    lengths = inputs[3].sum(1).tolist()  # the text mask, cut after the longest prompt
    assert len(set(lengths)) == 3 and max(lengths) == 24 == inputs[2].shape[1]
    denoiser = spec.load_denoiser(torch.float32)
    with torch.no_grad():
        x = inputs
        for layer in spec.pipeline_layers(denoiser):
            x = layer(x)
        expected = spec.denoiser_forward(denoiser, inputs)
        # Each item alone; the image grids (carried in a shape, no items) stay as they are.
        alone = [spec.denoiser_forward(
                     denoiser, tuple(v if v.numel() == 0 else v[i:i + 1] for v in inputs))
                 for i in range(len(CAPTIONS))]
    assert x.shape == target.shape == (3, 64, 16)
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x, torch.cat(alone), rtol=1e-5, atol=2e-6)


def test_one_prompt_trains_unmasked_as_diffusers_does_padded(tiny, monkeypatch):
    """One prompt: its padding is cut, no attention call gets a mask (SDPA can run flash), and
    the layers give diffusers' output on the text padded as cached."""
    spec = _spec(tiny)
    encoders = spec.load_encoders(torch.device("cpu"), torch.float32)
    inputs, _ = _inputs(spec, encoders, CAPTIONS[:1])
    text = spec.encode_prompts(encoders, CAPTIONS[:1])
    length = int(text["text_len"])
    assert length < 24 and inputs[2].shape[1] == length and inputs[3].shape == (1, 0)
    padded_mask = (torch.arange(24) < length).long()[None]
    padded = (*inputs[:2], text["text"], padded_mask, *inputs[4:])
    denoiser = spec.load_denoiser(torch.float32)
    x, expected, ours, theirs = attention_masks_of_layers_and_diffusers(
        monkeypatch, spec, spec.pipeline_layers(denoiser), inputs, denoiser, padded)
    assert ours and all(m is None for m in ours)
    assert any(m is not None for m in theirs)  # diffusers, given the padding, masks it
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-6)


def test_mask_weights_follow_the_packing(tiny):
    from dpipe.models.spec import NoisedBatch

    spec = _spec(tiny)
    x0, noise, t = torch.randn(1, 4, 8, 8), torch.randn(1, 4, 8, 8), torch.tensor([0.5])
    noisy, target = spec.noise(x0, noise, t)
    weight = torch.ones(1, 1, 8, 8)
    weight[..., :4, :] = 0
    text = {"text": torch.zeros(1, 24, 32), "text_len": torch.tensor([[5.0]])}
    _, labels = spec.make_inputs(NoisedBatch(x0, noise, t, noisy, target, text, loss_weight=weight))
    wrong = target.clone()
    wrong[..., :4, :] += 3.0
    assert spec.loss(pack(wrong), labels).item() == 0.0


def test_lora_targets_and_both_lora_files_load_in_diffusers(tiny, tmp_path):
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    spec = _spec(tiny, lora={"rank": 2, "alpha": 3})
    denoiser = spec.load_denoiser(torch.float32)
    targets = [n for n, m in denoiser.named_modules()
               if isinstance(m, torch.nn.Linear) and re.fullmatch(spec.lora_targets(), n)]
    blocks = [n for n, m in denoiser.named_modules()
              if isinstance(m, torch.nn.Linear) and n.startswith("transformer_blocks.")]
    assert sorted(targets) == sorted(blocks)
    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=3, target_modules=spec.lora_targets(),
                                       init_lora_weights=False), denoiser)
    export_lora(spec, get_peft_model_state_dict(denoiser, adapter_name="default"), tmp_path)
    comfy = load_file(tmp_path / COMFY_LORA)
    assert "diffusion_model.transformer_blocks.0.img_mod.1.lora_A.weight" in comfy
    encoders = spec.load_encoders(torch.device("cpu"), torch.float32)
    inputs, _ = _inputs(spec, encoders, CAPTIONS[:2])
    with torch.no_grad():
        trained = spec.denoiser_forward(denoiser, inputs)
        plain = spec.denoiser_forward(spec.load_denoiser(torch.float32), inputs)
        a = spec.denoiser_forward(spec.load_denoiser_with_lora(tmp_path, DIFFUSERS_LORA), inputs)
        # diffusers reads the ComfyUI file too (its Qwen converter takes "diffusion_model." keys)
        b = spec.denoiser_forward(spec.load_denoiser_with_lora(tmp_path, COMFY_LORA), inputs)
    assert (a - plain).abs().max() > 1e-3
    torch.testing.assert_close(a, trained, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(b, trained, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_single_file_transformer_loads_as_the_folder(tiny, tmp_path, prefix):
    """model.path may name the transformer as one file (ComfyUI's layout: the diffusers names),
    with model.single_file_config naming the diffusers folder for the rest."""
    from safetensors.torch import save_file

    folder = _spec(tiny).load_denoiser(torch.float32)
    path = tmp_path / "qwen_image_bf16.safetensors"
    save_file({prefix + k: v.to(torch.bfloat16).contiguous()
               for k, v in folder.state_dict().items()}, path)
    spec = _spec(path, single_file_config=str(tiny))
    spec.ensure_available()
    loaded = spec.load_denoiser(torch.float32)
    for k, v in folder.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    if prefix:  # the same file as a GGUF
        from tests.unit.test_gguf_files import assert_gguf_keeps_the_values

        assert_gguf_keeps_the_values(
            lambda file: _spec(file, single_file_config=str(tiny)), path, tmp_path)
