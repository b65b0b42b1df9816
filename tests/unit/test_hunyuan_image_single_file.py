"""HunyuanImage 2.1 single files in Tencent's original layout (hunyuan_image/original.py), beyond
the checks every image family gets in test_image_single_file.py: the table's names against the
names diffusers' conversion script reads, at the real model's sizes; the final layer's (shift,
scale) order; a file saved under ComfyUI's renamed keys; a file of another width; the ComfyUI
LoRA names being ComfyUI's renames of the file's own."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
import re

import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import save_file

from dpipe.config.schema import ModelConfig
from dpipe.errors import ModelLoadError
from dpipe.models.hunyuan_image.comfyui import comfyui_mapping
from dpipe.models.hunyuan_image.original import (
    COMFYUI, FUSED, SPLIT, comfyui_key, file_form, from_original, to_original)
from dpipe.models.hunyuan_image.spec import HunyuanImageSpec
from dpipe.models.hunyuan_image.tiny import make_tiny_hunyuan_image, write_single_file
from dpipe.models.registry import build_spec

FILE = "hunyuanimage2.1_bf16.safetensors"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_hunyuan_image(tmp_path_factory.mktemp("models") / "hunyuan_image")


def _spec(path, **values) -> HunyuanImageSpec:
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), {
        "family": "hunyuan_image", "path": str(path), "max_text_tokens": 16, **values}))
    return build_spec(cfg)


def _keys(file) -> dict[str, torch.Tensor]:
    with safe_open(file, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _script_names(double: int, single: int, refiner: int, form: str) -> set[str]:
    """The original keys of a distilled (guidance + meanflow) HunyuanImage 2.1 as diffusers'
    scripts/convert_hunyuan_image_to_diffusers.py pops them (SPLIT), or as the Tencent function
    it carries, convert_hunyuan_dict_for_tensor_parallel, takes them before splitting (FUSED:
    `*_attn_qkv`, `linear1`, `linear2`); written out here from that script."""
    wb = ("weight", "bias")
    names = {f"byt5_in.{m}.{p}" for m in ("layernorm", "fc1", "fc2", "fc3") for p in wb}
    names |= {f"{m}.{p}" for m in (
        "img_in.proj", "txt_in.input_embedder", "txt_in.t_embedder.mlp.0", "txt_in.t_embedder.mlp.2",
        "txt_in.c_embedder.linear_1", "txt_in.c_embedder.linear_2", "time_in.mlp.0", "time_in.mlp.2",
        "time_r_in.mlp.0", "time_r_in.mlp.2", "guidance_in.mlp.0", "guidance_in.mlp.2",
        "final_layer.linear", "final_layer.adaLN_modulation.1") for p in wb}
    for i in range(refiner):
        o = f"txt_in.individual_token_refiner.blocks.{i}"
        names |= {f"{o}.{m}.{p}" for m in ("norm1", "norm2", "self_attn_qkv", "self_attn_proj",
                                             "mlp.fc1", "mlp.fc2", "adaLN_modulation.1") for p in wb}
    for i in range(double):
        o = f"double_blocks.{i}"
        for s in ("img", "txt"):
            qkv = ("attn_qkv",) if form == FUSED else ("attn_q", "attn_k", "attn_v")
            names |= {f"{o}.{s}_{m}.{p}" for m in ("mod.linear", *qkv, "attn_proj",
                                                   "mlp.fc1", "mlp.fc2") for p in wb}
            names |= {f"{o}.{s}_attn_q_norm.weight", f"{o}.{s}_attn_k_norm.weight"}
    for i in range(single):
        o = f"single_blocks.{i}"
        linears = (("linear1", "linear2") if form == FUSED else
                   ("linear1_q", "linear1_k", "linear1_v", "linear1_mlp", "linear2.fc"))
        names |= {f"{o}.{m}.{p}" for m in ("modulation.linear", *linears) for p in wb}
        names |= {f"{o}.q_norm.weight", f"{o}.k_norm.weight"}
    return names


@pytest.mark.parametrize("form", [FUSED, SPLIT])
def test_the_table_gives_the_script_names_at_the_real_sizes(form):
    """HunyuanImage 2.1 distilled's config (diffusers' defaults: 28 heads x 128, mlp 4, Qwen
    3584; ByT5 1472 as the released config sets it), one block of each kind: every weight has
    exactly the original name the script reads, fused weights have the rows of their parts, and
    they convert back to the model's shapes."""
    from diffusers import HunyuanImageTransformer2DModel

    with torch.device("meta"):
        model = HunyuanImageTransformer2DModel(num_layers=1, num_single_layers=1,
                                               text_embed_2_dim=1472, guidance_embeds=True,
                                               use_meanflow=True)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    native = to_original({k: torch.empty(s, device="meta") for k, s in shapes.items()},
                         dict(model.config), form)
    assert set(native) == _script_names(1, 1, model.config.num_refiner_layers, form)
    assert file_form(native) == form
    hidden = 28 * 128
    if form == FUSED:
        assert native["double_blocks.0.img_attn_qkv.weight"].shape == (3 * hidden, hidden)
        assert native["single_blocks.0.linear1.weight"].shape == (3 * hidden + 4 * hidden, hidden)
    assert native["txt_in.individual_token_refiner.blocks.0.self_attn_qkv.weight"].shape == (
        3 * hidden, hidden)
    back = from_original(native, model)
    assert {k: v.shape for k, v in back.items()} == shapes


def test_the_final_layer_is_shift_then_scale_in_the_file(folder, tmp_path):
    """diffusers' script: the file's final adaLN_modulation.1 is (shift, scale), diffusers'
    norm_out.linear is (scale, shift)."""
    weights = _spec(folder).load_denoiser(torch.float32).state_dict()
    native = _keys(write_single_file(folder, tmp_path / FILE))
    shift, scale = native["final_layer.adaLN_modulation.1.weight"].chunk(2)
    assert torch.equal(torch.cat([scale, shift]), weights["norm_out.linear.weight"])
    hidden = weights["transformer_blocks.0.attn.to_q.weight"].shape[0]
    assert torch.equal(native["single_blocks.0.linear1.weight"][hidden:2 * hidden],
                       weights["single_transformer_blocks.0.attn.to_k.weight"])


@pytest.mark.parametrize("form", [SPLIT, COMFYUI])
@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_the_other_forms_load_as_the_folder_and_export_as_they_came(folder, tmp_path, form, prefix):
    """The split form and a file under ComfyUI's renamed keys (`img_attn.qkv`, `img_mod.lin`,
    `norm.query_norm.scale`...) load equal to the folder; a full fine-tune is written back in the
    source's form and reads back as the trained weights."""
    file = write_single_file(folder, tmp_path / FILE, prefix, form)
    source = _keys(file)
    marker = {SPLIT: "single_blocks.0.linear1_mlp.weight",
              COMFYUI: "single_blocks.0.norm.query_norm.scale"}[form]
    assert prefix + marker in source
    want = _spec(folder).load_denoiser(torch.float32).state_dict()
    spec = _spec(file, single_file_config=str(folder), mode="full")
    denoiser = spec.load_denoiser(torch.float32)
    got = denoiser.state_dict()
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key

    with torch.no_grad():
        for param in denoiser.parameters():
            param.add_(0.01 * torch.randn_like(param))
    shard = tmp_path / "stage-0.safetensors"
    save_file({k: v.contiguous() for k, v in denoiser.state_dict().items()}, shard)
    spec.export_full([shard], tmp_path / "model")
    written = _keys(tmp_path / "model" / FILE)
    assert list(written) == list(source)
    back = _spec(tmp_path / "model" / FILE, single_file_config=str(folder)).load_denoiser(
        torch.float32).state_dict()
    for key, value in denoiser.state_dict().items():
        assert torch.equal(back[key], value), key


def test_a_file_of_another_width_fails_naming_it(folder, tmp_path):
    native = _keys(write_single_file(folder, tmp_path / FILE))
    native["double_blocks.0.img_attn_qkv.weight"] = native["double_blocks.0.img_attn_qkv.weight"][:-3]
    file = tmp_path / "wider.safetensors"
    save_file(native, file)
    spec = _spec(file, single_file_config=str(folder))
    with pytest.raises(ModelLoadError, match=re.escape(str(file)) + ".*img_attn_qkv.weight has"):
        spec.load_denoiser(torch.float32)


def test_comfyui_lora_names_are_comfyuis_renames_of_the_file(folder, tmp_path):
    """The ComfyUI LoRA addresses the file's block Linears under the names ComfyUI gives them on
    load: one table for both."""
    config = json.loads((folder / "transformer" / "config.json").read_text())
    native = _keys(write_single_file(folder, tmp_path / FILE))
    renamed = {comfyui_key(k) for k in native}
    modules = [m for m, _, _ in comfyui_mapping(config)]
    blocks = [m for m in modules if m.startswith(("double_blocks.", "single_blocks."))]
    assert len(blocks) == 10 * config["num_layers"] + 3 * config["num_single_layers"]
    for module in modules:
        assert f"{module}.weight" in renamed and f"{module}.bias" in renamed, module
    assert "double_blocks.0.img_attn.qkv" in modules and "single_blocks.1.modulation.lin" in modules
    assert "time_in.in_layer" in modules and "txt_in.individual_token_refiner.blocks.0.self_attn.qkv" in modules


def test_dpipe_lora_merges_the_comfyui_lora_into_the_file_as_comfyui_applies_it(folder, tmp_path):
    """`dpipe-lora merge base=<the file> lora=<the family's ComfyUI LoRA>`: the LoRA names the
    modules ComfyUI renames the file's to on loading (`img_mlp.0` for `img_mlp.fc1`, ...), so
    the merge places each on the file's own weight and adds what ComfyUI adds there (its rule,
    `apply_comfy_lora`, on the file's weights under ComfyUI's names). ComfyUI 0.33.0 applied
    every key of such a file (docs/bench-results/comfyui-0.33.0-loads)."""
    from dpipe.models import lora_tools
    from dpipe.models.comfyui import apply_comfy_lora
    from dpipe.models.lora_names import layer_shapes, lora_names

    file = write_single_file(folder, tmp_path / FILE)
    spec = _spec(file, single_file_config=str(folder))
    generator = torch.Generator().manual_seed(0)
    weights = {}
    for module, shape in layer_shapes(spec.load_denoiser(torch.float32)).items():
        weights[f"{module}.lora_A.weight"] = torch.randn(2, shape[1], generator=generator)
        weights[f"{module}.lora_B.weight"] = torch.randn(shape[0], 2, generator=generator)
    comfy_format, = spec.lora_formats(weights, {"r": 2, "lora_alpha": 4})
    lora = comfy_format.build()
    save_file(lora, tmp_path / "lora.safetensors")
    names = lora_names(spec, lora_tools.weight_shapes(lora_tools.weight_files(file)))
    merged = lora_tools.merge(file, [(tmp_path / "lora.safetensors", 1.0)],
                              tmp_path / "merged.safetensors", names=names,
                              family="hunyuan_image")
    base = {comfyui_key(k): v for k, v in _keys(file).items()}
    want = apply_comfy_lora(base, lora)
    got = {comfyui_key(k): v for k, v in _keys(merged).items()}
    changed = [k for k in base if not torch.equal(want[k], base[k])]
    assert len(changed) == len([k for k in lora if k.endswith(".lora_A.weight")])
    for key in base:
        torch.testing.assert_close(got[key].float(), want[key].float(), rtol=1e-2, atol=1e-2)
