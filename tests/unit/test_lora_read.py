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
from dpipe.train.adapter_init import init_adapter
from dpipe.train.lora import make_trainable
from tests.exports import export_lora

# One family per kind of writer: fused weights (FLUX.1's single blocks), fused with exchanged
# output halves (HunyuanVideo's final modulation), kohya's names (SDXL), the original
# checkpoint's names (Wan), `.alpha` tensors (Qwen-Image), two components (Anima), fused q, k, v
# with `.alpha` (Ideogram 4). Every other family's writer is one of these (dpipe.models.comfyui);
# the 20 families that wrote a format before Ideogram 4, Krea 2 and ERNIE-Image all pass (85 s).
WRITERS = ["tiny_flux", "tiny_hunyuan_video", pytest.param("tiny_sdxl", marks=pytest.mark.slow),
           "tiny_wan", "tiny_qwen_image", "tiny_anima", "tiny_ideogram4"]


def _adapted(denoiser, run, spec, seed=None):
    """`denoiser` (in place) with the run's adapter, trained-looking with a `seed`."""
    make_trainable(denoiser, run.model, spec.lora_targets())
    if seed is not None:  # trained-looking: B starts at zero, which would hide a wrong scale
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in denoiser.named_parameters():
                if is_adapter_param(name):
                    param.add_(0.3 * torch.randn(param.shape, generator=generator))
    return denoiser


def _adapter_state(denoiser):
    return {n: p.detach().clone() for n, p in denoiser.named_parameters() if is_adapter_param(n)}


def _init_from(denoiser, run, spec, file):
    """`denoiser`'s adapter (NaN first, so no weight survives unread) from `file` by
    model.lora.init_from; its adapter state."""
    with torch.no_grad():
        for name, param in denoiser.named_parameters():
            if is_adapter_param(name):
                param.fill_(float("nan"))
    run.model.lora.init_from = str(file)
    init_adapter(denoiser, run.model, spec)
    return _adapter_state(denoiser)


def _run(model, *more):
    return compose_run([f"model={model}", "dataset=synthetic", "dataset.path=/unused",
                        "model.lora.alpha=2", *more])


@pytest.mark.parametrize("model", WRITERS)
def test_init_from_each_written_format_gives_the_diffusers_file_s_start(model, tmp_path):
    run = _run(model)
    spec = build_spec(run.model)
    spec.ensure_available()
    denoiser = _adapted(spec.load_denoiser(torch.float32), run, spec, seed=0)
    trained = _adapter_state(denoiser)
    files = export_lora(spec, trained, tmp_path)
    record = json.loads((tmp_path / "exports.json").read_text())["formats"]
    assert len(files) > 1, record
    for file in files:
        if record[file.name]["left_out"]:  # a format without some modules: the run names them
            with pytest.raises(ConfigError, match="no weights for"):
                _init_from(denoiser, run, spec, file)
            continue
        got = _init_from(denoiser, run, spec, file)
        assert sorted(got) == sorted(trained)
        for key, value in trained.items():
            torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-7,
                                       msg=f"{file.name} {key}")


def _as_musubi(comfy: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A ComfyUI-named LoRA as musubi-tuner and kohya's sd-scripts write theirs: `lora_unet_`
    and the module's name with dots as underscores, lora_down / lora_up, an `.alpha` each (here
    the rank: the file's scale is folded into lora_up)."""
    out = {}
    for key, value in comfy.items():
        module, part = key.removeprefix("diffusion_model.").rsplit(".lora_", 1)
        name = "lora_unet_" + module.replace(".", "_")
        out[f"{name}.lora_{'down' if part.startswith('A') else 'up'}.weight"] = value
        if part.startswith("A"):
            out[f"{name}.alpha"] = torch.tensor(float(value.shape[0]))
    return out


def test_files_of_other_tools_and_a_text_encoder_lora_start_where_the_export_does(tmp_path):
    """FLUX.1's ComfyUI export renamed as musubi-tuner writes it (with a text-encoder module,
    which is left out), and its diffusers export as a PeftModel saves it (`base_model.model.`,
    the adapter's name in each key, alpha in adapter_config.json)."""
    run = _run("tiny_flux")
    spec = build_spec(run.model)
    spec.ensure_available()
    denoiser = _adapted(spec.load_denoiser(torch.float32), run, spec, seed=1)
    trained = _adapter_state(denoiser)
    export_lora(spec, trained, tmp_path)
    musubi = _as_musubi(load_file(tmp_path / "flux_lora_comfyui.safetensors"))
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
        got = _init_from(denoiser, run, spec, file)
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
    denoiser = _adapted(spec.load_denoiser(torch.float32), run, spec)
    with pytest.raises(ConfigError, match=r"init_from=.*wan.safetensors: 1 of its 1 modules fit "
                                          r"no module of flux: diffusion_model.blocks.0.self_attn.q "
                                          r"\(read as a ComfyUI file; dpipe reads diffusers, peft"):
        _init_from(denoiser, run, spec, file)


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
    adapted = _adapted(spec.load_denoiser(torch.float32), run, spec, seed=3)
    export_lora(spec, _adapter_state(adapted), tmp_path)
    comfy = load_file(next(tmp_path.glob("*_lora_comfyui.safetensors")))
    modules = {k.rsplit(".lora_", 1)[0] for k in comfy if ".lora_A." in k}
    assert modules == {k.removesuffix(".alpha") for k in comfy if k.endswith(".alpha")}
    native = {k.replace(".base_layer.", "."): v for k, v in adapted.state_dict().items()
              if k.endswith(".weight") and not is_adapter_param(k)}
    if fused:
        for block in {k.split(".attention.")[0] for k in native if ".attention.to_q." in k}:
            qkv = [native.pop(f"{block}.attention.to_{x}.weight") for x in "qkv"]
            native[f"{block}.attention.qkv.weight"] = torch.cat(qkv)
            native[f"{block}.attention.o.weight"] = native.pop(f"{block}.attention.to_out.0.weight")
        assert "diffusion_model.layers.0.attention.qkv" in modules
    merged = apply_comfy_lora(native, comfy)
    expected = {}
    for name, module in adapted.named_modules():
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
