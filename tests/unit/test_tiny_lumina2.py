"""The tiny Lumina 2 loads and runs through diffusers' real code; Lumina 2 specifics of the spec."""

import os

# Before any Hugging Face import: a hub lookup offline would stall ~48 s on retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import re
from pathlib import Path

import pytest
import torch
from diffusers import Lumina2Pipeline
from safetensors.torch import load_file

from dpipe.models.comfyui import apply_comfy_lora
from dpipe.models.common.lumina import COMFY_LORA
from dpipe.models.lumina2.comfyui import from_native, native_state_dict
from dpipe.models.lumina2.spec import Lumina2Spec
from dpipe.models.spec import NoisedBatch
from tests.unit.video_checks import (
    assert_layers_match_each_item_alone, attention_masks_of_layers_and_diffusers, noised_images,
    tiny_spec)
from tests.exports import export_lora

CAPTIONS = ["a red circle on a blue background", "a cat",
            "A photo of two green stars, a painting of a dog in the park, an illustration"]


@pytest.fixture(scope="module")
def pipe(tiny) -> Lumina2Pipeline:
    return Lumina2Pipeline.from_pretrained(tiny, dtype=torch.float32)


def _spec(path: Path, **values) -> Lumina2Spec:
    return tiny_spec(path, "lumina2", max_text_tokens=48, **values)


def test_tokens_and_vae_as_the_pipeline_takes_them(pipe):
    # Gemma's form: <bos> first, "▁" for spaces, whole words; the VAE downscales 8x as the
    # pipeline assumes.
    tokens = pipe.tokenizer.convert_ids_to_tokens(pipe.tokenizer(CAPTIONS[0]).input_ids)
    assert tokens == ["<bos>", "a", "▁red", "▁circle", "▁on", "▁a", "▁blue", "▁background"]
    assert pipe.vae.encode(torch.zeros(1, 3, 64, 64)).latent_dist.mode().shape == (1, 4, 8, 8)


def _inputs(spec, encoders, captions, seed=0):
    return spec.make_inputs(noised_images(spec, encoders, captions, seed))


def test_layers_match_the_forward_for_captions_of_any_length(tiny):
    spec = _spec(tiny)
    encoders = spec.load_encoders(torch.device("cpu"), torch.float32)
    inputs, (target,) = _inputs(spec, encoders, CAPTIONS)
    lengths = inputs[3].tolist()
    assert len(set(lengths)) == 3 and max(lengths) == 48  # the last is cut at max_text_tokens
    denoiser = spec.load_denoiser(torch.float32)
    assert_layers_match_each_item_alone(spec, denoiser, inputs, target)


@pytest.mark.parametrize("captions", [CAPTIONS[:1], CAPTIONS[:2]])
def test_captions_are_cut_and_one_trains_unmasked(tiny, captions, monkeypatch):
    """make_inputs cuts the cached captions (48) after the longest: one caption leaves nothing to
    mask and no attention call gets a mask (SDPA can run flash; dpipe masked every block before);
    two of different lengths keep one. Either way the layers give diffusers' output."""
    spec = _spec(tiny)
    encoders = spec.load_encoders(torch.device("cpu"), torch.float32)
    inputs, _ = _inputs(spec, encoders, captions)
    longest = int(inputs[3].max())
    one = len(captions) == 1
    assert longest < 48 and inputs[2].shape[1] == longest
    assert inputs[4].shape == ((1, 0) if one else (2, longest))
    denoiser = spec.load_denoiser(torch.float32)
    x, expected, ours, theirs = attention_masks_of_layers_and_diffusers(
        monkeypatch, spec, spec.pipeline_layers(denoiser), inputs, denoiser, inputs)
    assert ours and len(theirs) == len(ours)
    assert all(m is None for m in ours) == one
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-6)


def test_target_and_timestep_follow_the_pipeline(tiny):
    spec = _spec(tiny)
    x0, noise, t = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8), torch.tensor([0.25, 0.9])
    noisy, target = spec.noise(x0, noise, t)
    torch.testing.assert_close(target, x0 - noise)  # the pipeline steps with -output
    mask = torch.zeros(2, 48)
    mask[0, :7], mask[1, :30] = 1, 1
    text = {"cap": torch.zeros(2, 48, 32), "cap_mask": mask}
    inputs, _ = spec.make_inputs(NoisedBatch(x0, noise, t, noisy, target, text))
    torch.testing.assert_close(inputs[1], 1 - t)  # the pipeline's 1 - t / 1000
    assert inputs[3].tolist() == [7, 30]


def test_pipeline_split_and_lora_targets(tiny):
    spec = _spec(tiny)
    denoiser = spec.load_denoiser(torch.float32)
    layers = spec.pipeline_layers(denoiser)
    kinds = [type(layer).__name__ for layer in layers]
    assert kinds == ["Lumina2Embed"] + ["LuminaRefiner"] * 4 + ["LuminaJoin"] \
        + ["LuminaBlock"] * 2 + ["LuminaHead"]
    names = set()
    for layer in layers:
        names |= set(layer.denoiser_state_dict(trainable_only=False))
    assert names == set(denoiser.state_dict())
    targets = [n for n, m in denoiser.named_modules()
               if isinstance(m, torch.nn.Linear) and re.fullmatch(spec.lora_targets(), n)]
    blocks = [n for n, m in denoiser.named_modules() if isinstance(m, torch.nn.Linear)
              and n.split(".")[0] in ("layers", "noise_refiner", "context_refiner")]
    assert sorted(targets) == sorted(blocks)


def test_comfy_lora_equals_the_diffusers_lora(tiny, tmp_path):
    """The ComfyUI file, merged into the original-layout weights as ComfyUI merges it and
    converted back by diffusers' single-file code, gives the diffusers LoRA's model."""
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    spec = _spec(tiny, lora={"rank": 2, "alpha": 3})
    denoiser = spec.load_denoiser(torch.float32)
    base = {k: v.clone() for k, v in denoiser.state_dict().items()}
    # Every original name maps back onto the diffusers model through diffusers' converter.
    assert set(from_native(native_state_dict(base), denoiser)) == set(base)
    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=3, target_modules=spec.lora_targets(),
                                       init_lora_weights=False), denoiser)
    files = export_lora(spec, get_peft_model_state_dict(denoiser, adapter_name="default"), tmp_path)
    assert [f.name for f in files] == ["pytorch_lora_weights.safetensors", COMFY_LORA]
    comfy = load_file(tmp_path / COMFY_LORA)
    assert "diffusion_model.layers.0.attention.qkv.lora_A.weight" in comfy
    assert "diffusion_model.layers.0.adaLN_modulation.1.lora_B.weight" in comfy

    plain = spec.load_denoiser(torch.float32)
    from_comfy = spec.load_denoiser(torch.float32)
    from_comfy.load_state_dict(from_native(apply_comfy_lora(native_state_dict(base), comfy), plain),
                               strict=True)
    with_lora = spec.load_denoiser_with_lora(tmp_path)
    encoders = spec.load_encoders(torch.device("cpu"), torch.float32)
    inputs, _ = _inputs(spec, encoders, CAPTIONS[:2])
    with torch.no_grad():
        reference = spec.denoiser_forward(plain, inputs)
        a = spec.denoiser_forward(with_lora, inputs)
        b = spec.denoiser_forward(from_comfy, inputs)
    assert (a - reference).abs().max() > 1e-3
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_single_file_transformer_loads_as_the_folder(tiny, tmp_path, prefix):
    """model.path may name the transformer as one file in the original (ComfyUI) layout, with
    model.single_file_config naming the diffusers folder for the rest."""
    from safetensors.torch import save_file

    folder = _spec(tiny).load_denoiser(torch.float32)
    native = native_state_dict({k: v.to(torch.bfloat16) for k, v in folder.state_dict().items()})
    assert "layers.0.attention.qkv.weight" in native and "cap_embedder.0.weight" in native
    path = tmp_path / "lumina_2_model_bf16.safetensors"
    save_file({prefix + k: v.contiguous() for k, v in native.items()}, path)
    spec = _spec(path, single_file_config=str(tiny))
    spec.ensure_available()
    loaded = spec.load_denoiser(torch.float32)
    for k, v in folder.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    if prefix:  # the same file as city96's GGUF
        from tests.unit.test_gguf_files import assert_gguf_keeps_the_values

        assert_gguf_keeps_the_values(
            lambda file: _spec(file, single_file_config=str(tiny)), path, tmp_path)
