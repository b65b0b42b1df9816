"""AuraFlow's ComfyUI LoRA: original (fal / ComfyUI) module names, merged as ComfyUI merges it."""

import os

# Before any Hugging Face import: a hub lookup offline would stall ~48 s on retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import load_file

from dpipe.config.schema import ModelConfig
from dpipe.models.comfyui import apply_comfy_lora
from dpipe.models.auraflow.comfyui import native_state_dict
from dpipe.models.auraflow.spec import COMFYUI_LORA, AuraFlowSpec
from dpipe.models.lora_files import DIFFUSERS_LORA
from dpipe.models.auraflow.tiny import make_tiny_auraflow
from tests.exports import export_lora


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> AuraFlowSpec:
    from omegaconf import OmegaConf

    tiny = make_tiny_auraflow(tmp_path_factory.mktemp("models") / "auraflow")
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), {
        "family": "auraflow", "path": str(tiny), "max_text_tokens": 16,
        "lora": {"rank": 2, "alpha": 3}})
    return AuraFlowSpec(OmegaConf.to_object(cfg))


def test_original_names_are_those_diffusers_converts_back(spec):
    """Every weight under its original name goes back to the same diffusers weight through
    diffusers' own single-file converter: the names (and the final modulation's swapped halves)
    are the original checkpoint's."""
    from diffusers.loaders.single_file_utils import (
        convert_auraflow_transformer_checkpoint_to_diffusers)

    state = spec.load_denoiser(torch.float32).state_dict()
    native = native_state_dict(state)
    assert "double_layers.0.attn.w2q.weight" in native and "single_layers.1.modCX.1.weight" in native
    back = convert_auraflow_transformer_checkpoint_to_diffusers(dict(native))
    assert back.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(back[key], value), key


def test_comfyui_lora_merged_into_original_weights_equals_the_diffusers_lora(spec, tmp_path):
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    denoiser = spec.load_denoiser(torch.float32)
    base = {k: v.clone() for k, v in denoiser.state_dict().items()}
    # The default targets, plus the final modulation, whose rows the original layout swaps.
    targets = f"{spec.lora_targets()}|norm_out\\.linear"
    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=3, target_modules=targets,
                                       init_lora_weights=False), denoiser)
    files = export_lora(spec, get_peft_model_state_dict(denoiser, adapter_name="default"), tmp_path)
    assert [f.name for f in files] == [DIFFUSERS_LORA, COMFYUI_LORA]
    comfy = load_file(files[1])
    assert "diffusion_model.double_layers.0.attn.w2q.lora_A.weight" in comfy
    assert "diffusion_model.single_layers.1.mlp.c_proj.lora_B.weight" in comfy
    assert "diffusion_model.modF.1.lora_B.weight" in comfy
    assert not any(k.endswith(".alpha") for k in comfy)

    for module in denoiser.modules():
        if isinstance(module, LoraLayer):
            module.merge()
    merged = {k.replace(".base_layer", ""): v for k, v in denoiser.state_dict().items()
              if "lora_" not in k}
    got = apply_comfy_lora(native_state_dict(base), comfy)
    want = native_state_dict(merged)
    changed = 0
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)
        changed += not torch.equal(value, native_state_dict(base)[key])
    assert changed == len(comfy) // 2  # every LoRA'd weight moved, nothing else
