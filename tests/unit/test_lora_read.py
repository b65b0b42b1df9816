"""Every LoRA file a family writes (diffusers, ComfyUI, kohya, LyCORIS) read back by
model.lora.init_from onto the tiny model gives the start weights of the diffusers file; files as
other tools write them (kohya's and musubi-tuner's underscored names, peft's) too. In this
process, no workers."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dpipe.config.compose import compose_run
from dpipe.errors import ConfigError
from dpipe.models.adapters import is_adapter_param
from dpipe.models.lora_files import DIFFUSERS_LORA
from dpipe.models.registry import build_spec
from tests.exports import (adapted, adapter_from_file, adapter_state, comfyui_as_kohya,
                           export_lora)

# One family per kind of writer: fused weights (FLUX.1's single blocks), fused with exchanged
# output halves (HunyuanVideo's final modulation), kohya's names (SDXL), the original
# checkpoint's names (Wan), `.alpha` tensors (Qwen-Image), two components (Anima), fused q, k, v
# with `.alpha` (Ideogram 4). Every other family's writer is one of these (dpipe.models.comfyui);
# the 20 families that wrote a format before Ideogram 4, Krea 2 and ERNIE-Image all pass (85 s).
WRITERS = ["tiny_flux", "tiny_hunyuan_video", pytest.param("tiny_sdxl", marks=pytest.mark.slow),
           "tiny_wan", "tiny_qwen_image", "tiny_anima", "tiny_ideogram4"]


def _run(model, *more):
    return compose_run([f"model={model}", "dataset=synthetic", "dataset.path=/unused",
                        "model.lora.alpha=2", *more])


@pytest.mark.parametrize("model", WRITERS)
def test_init_from_each_written_format_gives_the_diffusers_file_s_start(model, tmp_path):
    run = _run(model)
    spec = build_spec(run.model)
    spec.ensure_available()
    denoiser = adapted(spec.load_denoiser(torch.float32), run, spec, seed=0)
    trained = adapter_state(denoiser)
    files = export_lora(spec, trained, tmp_path)
    record = json.loads((tmp_path / "exports.json").read_text())["formats"]
    assert len(files) > 1, record
    for file in files:
        if record[file.name]["left_out"]:  # a format without some modules: the run names them
            with pytest.raises(ConfigError, match="no weights for"):
                adapter_from_file(denoiser, run, spec, file)
            continue
        got = adapter_from_file(denoiser, run, spec, file)
        assert sorted(got) == sorted(trained)
        for key, value in trained.items():
            torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-7,
                                       msg=f"{file.name} {key}")


def test_files_of_other_tools_and_a_text_encoder_lora_start_where_the_export_does(tmp_path):
    """FLUX.1's ComfyUI export renamed as musubi-tuner writes it (with a text-encoder module,
    which is left out), and its diffusers export as a PeftModel saves it (`base_model.model.`,
    the adapter's name in each key, alpha in adapter_config.json)."""
    run = _run("tiny_flux")
    spec = build_spec(run.model)
    spec.ensure_available()
    denoiser = adapted(spec.load_denoiser(torch.float32), run, spec, seed=1)
    trained = adapter_state(denoiser)
    export_lora(spec, trained, tmp_path)
    musubi = comfyui_as_kohya(load_file(tmp_path / "flux_lora_comfyui.safetensors"))
    musubi["lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight"] = torch.zeros(4, 8)
    musubi["lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight"] = torch.zeros(8, 4)
    save_file(musubi, tmp_path / "musubi.safetensors")
    peft_dir = tmp_path / "peft"
    peft_dir.mkdir()
    save_file({"base_model.model." + k.removeprefix("transformer.").replace(".weight",
                                                                          ".default.weight"): v
               for k, v in load_file(tmp_path / DIFFUSERS_LORA).items()},
              peft_dir / "adapter_model.safetensors")
    (peft_dir / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 2}))
    for file in (tmp_path / "musubi.safetensors", peft_dir / "adapter_model.safetensors"):
        got = adapter_from_file(denoiser, run, spec, file)
        for key, value in trained.items():
            torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-7,
                                       msg=f"{file.name} {key}")


def test_a_lora_of_another_model_lists_the_keys_that_fit_no_module(tmp_path):
    run = _run("tiny_flux")
    spec = build_spec(run.model)
    spec.ensure_available()
    file = tmp_path / "wan.safetensors"
    save_file({"diffusion_model.blocks.0.self_attn.q.lora_A.weight": torch.zeros(4, 32),
               "diffusion_model.blocks.0.self_attn.q.lora_B.weight": torch.zeros(32, 4),
               "diffusion_model.blocks.0.self_attn.q.alpha": torch.tensor(4.0)}, file)
    denoiser = adapted(spec.load_denoiser(torch.float32), run, spec)
    with pytest.raises(ConfigError, match=r"init_from=.*wan.safetensors: 1 of its 1 modules fit "
                                          r"no module of flux: diffusion_model.blocks.0.self_attn.q "
                                          r"\(read as a ComfyUI file; dpipe reads diffusers, peft"):
        adapter_from_file(denoiser, run, spec, file)


@pytest.mark.parametrize("model, fused", [("tiny_ideogram4", True), ("tiny_krea2", False),
                                          ("tiny_ernie_image", False)])
def test_the_comfyui_lora_applied_by_comfyui_s_rule_gives_the_adapted_weights(model, fused,
                                                                               tmp_path):
    """ComfyUI 0.33.0's rule (comfy/lora.py: W += alpha / rank * B @ A, alpha from the
    `.alpha` tensor only) over its model's names: Ideogram 4's `attention.qkv` (q, k, v stacked
    on the output dimension) and `attention.o`, diffusers' names elsewhere; Krea 2's and
    ERNIE-Image's LoRAs by diffusers' names. Every written module carries `.alpha`."""
    from dpipe.models.comfyui import apply_comfy_lora

    run = _run(model)
    spec = build_spec(run.model)
    spec.ensure_available()
    denoiser = adapted(spec.load_denoiser(torch.float32), run, spec, seed=3)
    export_lora(spec, adapter_state(denoiser), tmp_path)
    comfy = load_file(next(tmp_path.glob("*_lora_comfyui.safetensors")))
    modules = {k.rsplit(".lora_", 1)[0] for k in comfy if ".lora_A." in k}
    assert modules == {k.removesuffix(".alpha") for k in comfy if k.endswith(".alpha")}
    native = {k.replace(".base_layer.", "."): v for k, v in denoiser.state_dict().items()
              if k.endswith(".weight") and not is_adapter_param(k)}
    if fused:
        for block in {k.split(".attention.")[0] for k in native if ".attention.to_q." in k}:
            qkv = [native.pop(f"{block}.attention.to_{x}.weight") for x in "qkv"]
            native[f"{block}.attention.qkv.weight"] = torch.cat(qkv)
            native[f"{block}.attention.o.weight"] = native.pop(f"{block}.attention.to_out.0.weight")
        assert "diffusion_model.layers.0.attention.qkv" in modules
    merged = apply_comfy_lora(native, comfy)
    expected = {}
    for name, module in denoiser.named_modules():
        if hasattr(module, "get_delta_weight"):
            weight = module.get_base_layer().weight
            expected[name] = (weight + module.get_delta_weight("default")).detach()
    for name, weight in expected.items():
        if fused and ".attention.to_" in name:
            block, part = name.split(".attention.")
            if part == "to_out.0":
                got = merged[f"{block}.attention.o.weight"]
            else:
                index = ["to_q", "to_k", "to_v"].index(part)
                got = merged[f"{block}.attention.qkv.weight"].chunk(3)[index]
        else:
            got = merged[f"{name}.weight"]
        torch.testing.assert_close(got, weight, rtol=1e-5, atol=1e-6, msg=name)
