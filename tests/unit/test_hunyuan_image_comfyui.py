"""HunyuanImage 2.1's ComfyUI LoRA: ComfyUI's Flux-style module names, fused LoRAs exact."""

import os

# Before any Hugging Face import: a hub lookup offline would stall ~48 s on retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json

import pytest
import torch
from safetensors.torch import load_file

from dpipe.config.schema import ModelConfig
from dpipe.models.comfyui import apply_comfy_lora
from dpipe.models.hunyuan_image.comfyui import comfyui_block_weights
from dpipe.models.hunyuan_image.spec import COMFYUI_LORA, HunyuanImageSpec
from dpipe.models.lora_files import DIFFUSERS_LORA
from dpipe.models.hunyuan_image.tiny import make_tiny_hunyuan_image
from tests.exports import export_lora


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> HunyuanImageSpec:
    from omegaconf import OmegaConf

    tiny = make_tiny_hunyuan_image(tmp_path_factory.mktemp("models") / "hunyuan_image")
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), {
        "family": "hunyuan_image", "path": str(tiny), "max_text_tokens": 32,
        "lora": {"rank": 2, "alpha": 3}})
    return HunyuanImageSpec(OmegaConf.to_object(cfg))


def test_comfyui_lora_merged_into_fused_weights_equals_the_diffusers_lora(spec, tmp_path):
    """Merged as ComfyUI merges it into the fused (ComfyUI-layout) block weights, the file gives
    the diffusers-layout weights with the LoRA merged by peft, fused the same way. This checks the
    fusing is exact and every trained module is written; that the names are ComfyUI's rests on
    ComfyUI's and sd-scripts' sources (see hunyuan_image/comfyui.py), not on a ComfyUI run."""
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    config = json.loads((spec.path / "transformer" / "config.json").read_text())
    denoiser = spec.load_denoiser(torch.float32)
    base = comfyui_block_weights(denoiser.state_dict(), config)
    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=3, target_modules=spec.lora_targets(),
                                       init_lora_weights=False), denoiser)
    files = export_lora(spec, get_peft_model_state_dict(denoiser, adapter_name="default"), tmp_path)
    assert [f.name for f in files] == [DIFFUSERS_LORA, COMFYUI_LORA]
    comfy = load_file(files[1])
    for key in ("double_blocks.0.img_attn.qkv", "double_blocks.1.txt_mod.lin",
                "double_blocks.0.img_mlp.0", "single_blocks.1.linear1", "single_blocks.0.modulation.lin"):
        assert f"diffusion_model.{key}.lora_A.weight" in comfy, key
    assert comfy["diffusion_model.single_blocks.1.linear1.lora_A.weight"].shape[0] == 4 * 2
    assert not any(k.endswith(".alpha") for k in comfy)
    # 10 fused Linears per double block, 3 per single block, 2 of each kind of block
    assert len(comfy) == 2 * (2 * 10 + 2 * 3)

    for module in denoiser.modules():
        if isinstance(module, LoraLayer):
            module.merge()
    merged = {k.replace(".base_layer", ""): v for k, v in denoiser.state_dict().items()
              if "lora_" not in k}
    want = comfyui_block_weights(merged, config)
    got = apply_comfy_lora(base, comfy)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)
        if key.endswith(".weight"):
            assert not torch.equal(value, base[key]), key
