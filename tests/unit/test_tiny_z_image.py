"""The tiny Z-Image loads and runs through diffusers' real code; Z-Image specifics of the spec."""

import os

# Before any Hugging Face import: a hub lookup offline would stall ~48 s on retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import pytest
import torch
from diffusers import ZImagePipeline
from safetensors.torch import load_file

from dpipe.models.comfyui import apply_comfy_lora
from dpipe.models.common.lumina import COMFY_LORA
from dpipe.models.spec import NoisedBatch
from dpipe.models.z_image.comfyui import native_state_dict
from dpipe.models.z_image.spec import ZImageSpec
from tests.unit.video_checks import (
    assert_layers_match_each_item_alone, assert_same_tensors,
    attention_masks_of_layers_and_diffusers, noised_images, tiny_spec)
from tests.exports import export_lora

CAPTIONS = ["a red circle on a blue background", "a cat",
            "A photo of two green stars, a painting of a dog in the park, an illustration"]


@pytest.fixture(scope="module")
def pipe(tiny) -> ZImagePipeline:
    return ZImagePipeline.from_pretrained(tiny, dtype=torch.float32)


def _spec(path: Path, **values) -> ZImageSpec:
    return tiny_spec(path, "z_image", max_text_tokens=34, **values)


def test_prompt_format(pipe):
    # Qwen3's chat template, every caption word a whole token.
    text = pipe.tokenizer.apply_chat_template([{"role": "user", "content": CAPTIONS[0]}],
                                              tokenize=False, add_generation_prompt=True)
    assert text == f"<|im_start|>user\n{CAPTIONS[0]}<|im_end|>\n<|im_start|>assistant\n"
    words = pipe.tokenizer.tokenize(" " + CAPTIONS[0])
    assert len(words) == len(CAPTIONS[0].split())


def _inputs(spec, encoders, captions, seed=0):
    return spec.make_inputs(noised_images(spec, encoders, captions, seed))


def test_layers_match_the_forward_for_captions_of_any_length(tiny):
    spec = _spec(tiny)
    encoders = spec.load_encoders(torch.device("cpu"), torch.float32)
    (inputs, (target,)) = _inputs(spec, encoders, CAPTIONS)
    lengths = inputs[3].tolist()
    # Within one 32-token unit, and past it: the last is cut at max_text_tokens=34.
    assert len(set(lengths)) == 3 and max(lengths) == 34 and min(lengths) < 32
    denoiser = spec.load_denoiser(torch.float32)
    assert_layers_match_each_item_alone(spec, denoiser, inputs, target, alone_atol=1e-6)


@pytest.mark.parametrize("captions", [CAPTIONS[:1], CAPTIONS[:2], CAPTIONS])
def test_captions_are_cut_and_masked_only_where_padded_lengths_differ(tiny, captions,
                                                                      monkeypatch):
    """make_inputs cuts the cached captions (34) after the longest. Captions that pad to the same
    multiple of 32 (one caption; 15 and 11 tokens) leave nothing to mask: no attention call gets a
    mask, as in diffusers. 15, 11 and 34 tokens pad to 32, 32 and 64: masked, in both. Either way
    the layers give diffusers' output."""
    spec = _spec(tiny)
    encoders = spec.load_encoders(torch.device("cpu"), torch.float32)
    inputs, _ = _inputs(spec, encoders, captions)
    lengths = inputs[3]
    masked = len(captions) == 3
    assert inputs[2].shape[1] == int(lengths.max()) and (int(lengths.max()) < 32) != masked
    assert inputs[4].shape == ((3, 64) if masked else (len(captions), 0))
    denoiser = spec.load_denoiser(torch.float32)
    x, expected, ours, theirs = attention_masks_of_layers_and_diffusers(
        monkeypatch, spec, spec.pipeline_layers(denoiser), inputs, denoiser, inputs)
    assert ours and theirs
    assert all(m is None for m in ours) != masked
    assert all(m is None for m in theirs) != masked  # diffusers' own calls
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-6)


def test_target_and_timestep_follow_the_pipeline(tiny):
    spec = _spec(tiny)
    x0, noise, t = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8), torch.tensor([0.25, 0.9])
    noisy, target = spec.noise(x0, noise, t)
    # The pipeline steps with -output as the velocity (noise - x0): the model predicts x0 - noise,
    # at t_model = 1 - sigma.
    torch.testing.assert_close(target, x0 - noise)
    text = {"cap": torch.zeros(2, 34, 32), "cap_len": torch.tensor([[3.0], [5.0]])}
    inputs, _ = spec.make_inputs(NoisedBatch(x0, noise, t, noisy, target, text))
    torch.testing.assert_close(inputs[1], 1 - t)


def test_pipeline_split_and_lora_targets(tiny):
    spec = _spec(tiny)
    denoiser = spec.load_denoiser(torch.float32)
    layers = spec.pipeline_layers(denoiser)
    kinds = [type(layer).__name__ for layer in layers]
    assert kinds == ["ZImageEmbed"] + ["ZImageRefiner"] * 4 + ["ZImageJoin"] + ["ZImageBlock"] * 2 \
        + ["ZImageHead"]
    # Exported names cover the denoiser exactly.
    names = set()
    for layer in layers:
        names |= set(layer.denoiser_state_dict(trainable_only=False))
    assert names == set(denoiser.state_dict())
    import re

    targets = [n for n, m in denoiser.named_modules()
               if isinstance(m, torch.nn.Linear) and re.fullmatch(spec.lora_targets(), n)]
    blocks = [n for n, m in denoiser.named_modules() if isinstance(m, torch.nn.Linear)
              and n.split(".")[0] in ("layers", "noise_refiner", "context_refiner")]
    assert sorted(targets) == sorted(blocks)  # every Linear of every block, nothing else


def test_comfy_lora_equals_the_diffusers_lora(tiny, tmp_path):
    """The ComfyUI file, merged into the original-layout weights as ComfyUI merges it and
    converted back by diffusers' own single-file code, gives the diffusers LoRA's model."""
    from diffusers.loaders.single_file_utils import (
        convert_z_image_transformer_checkpoint_to_diffusers)
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    spec = _spec(tiny, lora={"rank": 2, "alpha": 3})
    denoiser = spec.load_denoiser(torch.float32)
    base = {k: v.clone() for k, v in denoiser.state_dict().items()}
    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=3, target_modules=spec.lora_targets(),
                                       init_lora_weights=False), denoiser)
    files = export_lora(spec, get_peft_model_state_dict(denoiser, adapter_name="default"), tmp_path)
    assert [f.name for f in files] == ["pytorch_lora_weights.safetensors", COMFY_LORA]
    comfy = load_file(tmp_path / COMFY_LORA)
    assert all(k.startswith("diffusion_model.") for k in comfy)
    assert "diffusion_model.layers.0.attention.qkv.lora_A.weight" in comfy

    merged = apply_comfy_lora(native_state_dict(base), comfy)
    converted = convert_z_image_transformer_checkpoint_to_diffusers(merged)
    from_comfy = spec.load_denoiser(torch.float32)
    from_comfy.load_state_dict(converted, strict=True)
    with_lora = spec.load_denoiser_with_lora(tmp_path)

    encoders = spec.load_encoders(torch.device("cpu"), torch.float32)
    inputs, _ = _inputs(spec, encoders, CAPTIONS[:2])
    with torch.no_grad():
        plain = spec.denoiser_forward(spec.load_denoiser(torch.float32), inputs)
        a = spec.denoiser_forward(with_lora, inputs)
        b = spec.denoiser_forward(from_comfy, inputs)
    assert (a - plain).abs().max() > 1e-3
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_mask_weights_the_loss(tiny):
    from dpipe.models.spec import NoisedBatch

    spec = _spec(tiny)
    x0, noise, t = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8), torch.tensor([0.3, 0.6])
    noisy, target = spec.noise(x0, noise, t)
    text = {"cap": torch.zeros(2, 34, 32), "cap_len": torch.tensor([[3.0], [5.0]])}
    weight = torch.ones(2, 1, 8, 8)
    weight[:, :, :4] = 0.0  # the top half does not count
    _, labels = spec.make_inputs(NoisedBatch(x0, noise, t, noisy, target, text, loss_weight=weight))
    out = target.clone()
    out[:, :, :4] += 5.0  # wrong only where the mask is 0
    assert spec.loss(out, labels).item() == 0.0
    _, plain = spec.make_inputs(NoisedBatch(x0, noise, t, noisy, target, text))
    assert len(plain) == 1 and spec.loss(out, plain).item() > 1.0


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_single_file_transformer_loads_as_the_folder(tiny, tmp_path, prefix):
    """model.path may name the transformer as one file in the original (ComfyUI) layout, with
    model.single_file_config naming the diffusers folder for the rest."""
    from safetensors.torch import save_file

    from dpipe.errors import ConfigError

    folder = _spec(tiny).load_denoiser(torch.float32)
    native = native_state_dict({k: v.to(torch.bfloat16) for k, v in folder.state_dict().items()})
    assert "layers.0.attention.qkv.weight" in native and "x_embedder.weight" in native
    path = tmp_path / "z_image_turbo_bf16.safetensors"
    save_file({prefix + k: v.contiguous() for k, v in native.items()}, path)
    spec = _spec(path, single_file_config=str(tiny))
    spec.ensure_available()
    assert spec.path == tiny and spec.single_file == path
    loaded = spec.load_denoiser(torch.float32)
    for k, v in folder.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    # at bf16, every parameter and buffer as from_pretrained loads the folder's
    assert_same_tensors(spec.load_denoiser(torch.bfloat16),
                        _spec(tiny).load_denoiser(torch.bfloat16))
    with pytest.raises(ConfigError, match="single_file_config"):
        _spec(path)
