"""FLUX.1, FLUX.1 Kontext and FLUX.2 in the formats users hold: single-file transformers in Black
Forest Labs' layout (plain, or with ComfyUI's `model.diffusion_model.` prefix) and ComfyUI LoRAs."""

import os

# Before any Hugging Face import: a hub lookup offline would stall ~48 s on retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dpipe.config.schema import ModelConfig
from dpipe.errors import ConfigError, ModelLoadError
from dpipe.models.comfyui import apply_comfy_lora
from dpipe.models.common.bfl_layout import flux1_layout, flux2_layout, from_bfl, to_bfl
from dpipe.models.flux.tiny import write_bfl_single_file
from dpipe.models.registry import build_spec
from tests.exports import export_lora
from tests.unit.test_gguf_files import assert_gguf_keeps_the_values

FAMILIES = {
    "flux": ("dpipe.models.flux.tiny", "make_tiny_flux", flux1_layout),
    "flux_kontext": ("dpipe.models.flux.tiny", "make_tiny_flux_kontext", flux1_layout),
    "flux2": ("dpipe.models.flux2.tiny", "make_tiny_flux2", flux2_layout),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> its tiny diffusers folder (built once per module)."""
    import importlib

    made = {}

    def get(family: str) -> Path:
        if family not in made:
            module, fn, _ = FAMILIES[family]
            made[family] = getattr(importlib.import_module(module), fn)(
                tmp_path_factory.mktemp("models") / family)
        return made[family]
    return get


def _spec(family: str, path: Path, **overrides):
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig),
                          {"family": family, "path": str(path), "max_text_tokens": 16, **overrides})
    return build_spec(OmegaConf.to_object(cfg))


def _layout(family: str, spec):
    import json

    return FAMILIES[family][2](json.loads((spec.path / "transformer/config.json").read_text()))


# ---- the layout tables against diffusers' own converters ------------------------------------------
def _labelled(shape) -> torch.Tensor:
    """A tensor whose every row holds its row index, stored as one column (no memory for the real
    widths): splits, swaps and concatenations along dim 0 show in the values."""
    rows = torch.arange(shape[0], dtype=torch.int32)
    return rows.view(-1, *([1] * (len(shape) - 1))).expand(*shape)


def test_flux1_split_agrees_with_diffusers_converter_at_real_sizes():
    """diffusers' FLUX.1 converter hard-codes FLUX.1-dev's widths (3072, 12288) to split the
    single blocks' linear1, so dpipe splits at the model's own sizes; at the real sizes both give
    the same weights for every key (one block of each kind, rows labelled)."""
    from diffusers import FluxTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    # FLUX.1-dev's transformer config, with one block of each kind.
    config = dict(in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                  guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in FluxTransformer2DModel(**config).state_dict().items()}
    layout = flux1_layout(config)
    bfl_shapes = {k: v.shape for k, v in to_bfl(
        {k: torch.empty(s, device="meta") for k, s in shapes.items()}, layout).items()}
    assert bfl_shapes["single_blocks.0.linear1.weight"] == (3 * 3072 + 12288, 3072)
    native = {k: _labelled(s) for k, s in bfl_shapes.items()}
    theirs = convert_flux_transformer_checkpoint_to_diffusers(dict(native))
    ours = from_bfl(native, layout)
    assert ours.keys() == theirs.keys() == shapes.keys()
    for key in theirs:
        assert ours[key].shape == shapes[key], key
        assert torch.equal(ours[key], theirs[key]), key


@pytest.mark.parametrize("family", ["flux", "flux2"])
def test_bfl_layout_round_trips(tiny, family):
    """diffusers -> BFL (the tiny single files) -> diffusers gives every weight back exactly; for
    FLUX.2 the way back is diffusers' own converter, which checks the names as well."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    spec = _spec(family, tiny(family))
    state = spec.load_denoiser(torch.float32).state_dict()
    native = to_bfl(state, _layout(family, spec))
    assert "double_blocks.0.img_attn.qkv.weight" in native and "single_blocks.1.linear1.weight" in native
    back = (convert_flux2_transformer_checkpoint_to_diffusers(dict(native)) if family == "flux2"
            else from_bfl(native, _layout(family, spec)))
    assert back.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(back[key], value), key


# ---- single-file loading ------------------------------------------------------------------------
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_single_file_transformer_loads_as_the_folder(tiny, tmp_path, family, prefix):
    """model.path names the transformer as one BFL-layout file (ComfyUI's prefix or none),
    model.single_file_config the diffusers folder: the loaded weights equal the folder's."""
    folder = tiny(family)
    file = write_bfl_single_file(folder, tmp_path / f"{family}.safetensors", prefix)
    keys = load_file(file).keys()
    assert f"{prefix}double_blocks.0.img_attn.qkv.weight" in keys
    assert not any("transformer_blocks" in k for k in keys)
    spec = _spec(family, file, single_file_config=str(folder))
    spec.ensure_available()
    assert spec.path == folder and spec.single_file == file
    got = spec.load_denoiser(torch.float32).state_dict()
    want = _spec(family, folder).load_denoiser(torch.float32).state_dict()
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key].dtype == torch.float32 and torch.equal(got[key], value), key
    if prefix:  # the same file as city96's GGUF
        assert_gguf_keeps_the_values(
            lambda path: _spec(family, path, single_file_config=str(folder)), file, tmp_path)


@pytest.mark.parametrize("family", ["flux", "flux2"])
def test_a_file_that_is_not_this_flux_is_refused_naming_it(tiny, tmp_path, family):
    other = {"flux": "flux2", "flux2": "flux"}[family]
    wrong = write_bfl_single_file(tiny(other), tmp_path / f"{other}.safetensors")
    junk = tmp_path / "not_a_model.safetensors"
    save_file({"blocks.0.ffn.0.weight": torch.zeros(4, 4)}, junk)
    for file in (wrong, junk):
        spec = _spec(family, file, single_file_config=str(tiny(family)))
        spec.ensure_available()
        with pytest.raises(ModelLoadError, match=re.escape(str(file))):
            spec.load_denoiser(torch.float32)


def test_single_file_needs_the_diffusers_folder(tiny, tmp_path):
    file = write_bfl_single_file(tiny("flux"), tmp_path / "flux1-dev.safetensors")
    with pytest.raises(ConfigError, match="single_file_config"):
        _spec("flux", file)
    with pytest.raises(ConfigError, match="single_file_config"):
        _spec("flux", tiny("flux"), single_file_config=str(tiny("flux")))
    spec = _spec("flux", tmp_path / "missing.safetensors", single_file_config=str(tiny("flux")))
    with pytest.raises(ModelLoadError, match="missing.safetensors"):
        spec.ensure_available()


# ---- ComfyUI LoRA -----------------------------------------------------------------------------------
def _lora_denoiser(spec, rank: int, alpha: float, targets):
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    denoiser = spec.load_denoiser(torch.float32)
    base = {k: v.clone() for k, v in denoiser.state_dict().items()}
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                       init_lora_weights=False), denoiser)
    return denoiser, base, get_peft_model_state_dict(denoiser, adapter_name="default")


def _merged(denoiser) -> dict[str, torch.Tensor]:
    """The diffusers-layout weights with the LoRA merged by peft itself (W + alpha/r B A)."""
    from peft.tuners.lora import LoraLayer

    for module in denoiser.modules():
        if isinstance(module, LoraLayer):
            module.merge()
    return {k.replace(".base_layer", ""): v for k, v in denoiser.state_dict().items()
            if "lora_" not in k}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_comfyui_lora_merged_into_bfl_weights_equals_the_diffusers_lora(tiny, tmp_path, family):
    """The ComfyUI file, merged into the BFL-layout base weights as ComfyUI merges it (keys
    `diffusion_model.<BFL module>.lora_A/lora_B.weight`), equals the diffusers-layout weights with
    the LoRA merged, converted to BFL's layout: the fused q/k/v(/mlp) LoRAs are exact."""
    spec = _spec(family, tiny(family), lora={"rank": 2, "alpha": 3})
    denoiser, base, lora = _lora_denoiser(spec, 2, 3, spec.lora_targets())
    files = export_lora(spec, lora, tmp_path)
    assert [f.name for f in files] == ["pytorch_lora_weights.safetensors",
                                       f"{family}_lora_comfyui.safetensors"]
    comfy = load_file(files[1])
    assert "diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight" in comfy
    assert "diffusion_model.double_blocks.1.txt_attn.qkv.lora_B.weight" in comfy
    assert "diffusion_model.single_blocks.0.linear1.lora_A.weight" in comfy
    a = comfy["diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight"]
    assert a.shape[0] == 3 * 2  # the three rank-2 LoRAs stacked
    assert all(k.startswith("diffusion_model.") and "transformer_blocks" not in k for k in comfy)
    assert not any(k.endswith(".alpha") for k in comfy)  # alpha / rank is folded into lora_B

    layout = _layout(family, spec)
    got = apply_comfy_lora(to_bfl(base, layout), comfy)
    want = to_bfl(_merged(denoiser), layout)
    assert got.keys() == want.keys()
    changed = 0
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)
        changed += not torch.equal(value, to_bfl(base, layout)[key])
    assert changed >= 8, "the LoRA should change the fused and unfused weights"


def test_comfyui_lora_of_some_projections_only(tiny, tmp_path):
    """A LoRA on to_q alone (user-chosen targets) becomes a LoRA on the fused qkv whose k and v
    rows are zero: merging it changes only the q rows. A LoRA on the final modulation has its
    output rows swapped as the weight is."""
    spec = _spec("flux", tiny("flux"), lora={"rank": 2, "alpha": 2, "targets": [
        "transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.proj_mlp",
        "norm_out.linear"]})  # the last: rows (scale, shift) in diffusers, (shift, scale) in BFL
    denoiser, base, lora = _lora_denoiser(spec, 2, 2, spec.cfg.lora.targets)
    comfy = load_file(export_lora(spec, lora, tmp_path)[1])
    assert sorted(comfy) == [f"diffusion_model.{m}.lora_{x}.weight"
                             for m in ("double_blocks.0.img_attn.qkv",
                                       "final_layer.adaLN_modulation.1", "single_blocks.0.linear1")
                             for x in "AB"]
    layout = _layout("flux", spec)
    got = apply_comfy_lora(to_bfl(base, layout), comfy)
    want = to_bfl(_merged(denoiser), layout)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)
    qkv = "double_blocks.0.img_attn.qkv.weight"
    inner = base["transformer_blocks.0.attn.to_q.weight"].shape[0]
    delta = got[qkv] - to_bfl(base, layout)[qkv]
    assert delta[:inner].abs().max() > 1e-4 and delta[inner:].abs().max() == 0


# ---- full fine-tunes of a single-file model ------------------------------------------------------
@pytest.mark.parametrize("family", ["flux", "flux2"])
def test_full_export_of_a_single_file_model_writes_that_layout_too(tiny, tmp_path, family):
    """Next to the diffusers folder, the fine-tune is written as the file it came from: same
    name, key prefix and dtype; loaded back as a single file it equals the exported folder."""
    folder = tiny(family)
    file = write_bfl_single_file(folder, tmp_path / f"{family}-dev.safetensors",
                                 prefix="model.diffusion_model.")  # stored bf16, as the real ones
    spec = _spec(family, file, single_file_config=str(folder))
    spec.ensure_available()
    denoiser = spec.load_denoiser(torch.float32)
    with torch.no_grad():
        for p in denoiser.parameters():
            p.add_(0.01)  # "trained": differs from the base everywhere
    keys = sorted(denoiser.state_dict())
    shards = []
    for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:])):
        shards.append(tmp_path / f"stage-{i}.safetensors")
        save_file({k: denoiser.state_dict()[k].contiguous() for k in part}, shards[-1])
    out = tmp_path / "model"
    assert spec.export_full(shards, out) == out / "transformer"
    written = load_file(out / file.name)
    assert all(k.startswith("model.diffusion_model.") for k in written)
    assert {v.dtype for v in written.values()} == {torch.bfloat16}
    again = _spec(family, out / file.name, single_file_config=str(folder)).load_denoiser(
        torch.float32).state_dict()
    exported = spec.load_exported_full(out).state_dict()
    base = _spec(family, folder).load_denoiser(torch.float32).state_dict()
    assert again.keys() == exported.keys()
    for key, value in exported.items():
        assert torch.equal(again[key], value.to(torch.bfloat16).float()), key
        assert not torch.equal(again[key], base[key]), key  # the fine-tune, not the base


# ---- the ComfyUI LoRA read back by diffusers' own converters ----------------------------------------
def test_flux2_comfyui_lora_loads_in_diffusers_like_the_diffusers_lora(tiny, tmp_path):
    """diffusers reads `diffusion_model.`-keyed (ai-toolkit / ComfyUI) FLUX.2 LoRAs itself: loaded
    with Flux2Pipeline.load_lora_weights, the ComfyUI file gives the diffusers file's weights."""
    from diffusers import Flux2Pipeline

    spec = _spec("flux2", tiny("flux2"), lora={"rank": 2, "alpha": 3})
    _, _, lora = _lora_denoiser(spec, 2, 3, spec.lora_targets())
    diffusers_file, comfy_file = export_lora(spec, lora, tmp_path)
    fused = {}
    for name in (diffusers_file.name, comfy_file.name):
        pipe = Flux2Pipeline.from_pretrained(spec.path, text_encoder=None, vae=None, tokenizer=None)
        pipe.load_lora_weights(str(tmp_path), weight_name=name)
        pipe.transformer.fuse_lora()
        fused[name] = {k.replace(".base_layer", ""): v for k, v in
                       pipe.transformer.state_dict().items() if "lora_" not in k}
    a, b = fused[diffusers_file.name], fused[comfy_file.name]
    base = spec.load_denoiser(torch.float32).state_dict()
    assert a.keys() == b.keys() == base.keys()
    assert sum(not torch.equal(a[k], base[k]) for k in a) >= 10
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6, msg=key)


def test_flux1_comfyui_lora_is_what_diffusers_reads_as_kohya_at_real_sizes():
    """ComfyUI also accepts each of its keys as kohya's `lora_unet_<module with underscores>`;
    diffusers' kohya FLUX.1 converter (which has FLUX.1-dev's widths built in) reads the file so
    renamed back into exactly the per-projection LoRAs it came from, for a LoRA on every Linear
    of one block of each kind at FLUX.1-dev's sizes."""
    from diffusers import FluxTransformer2DModel
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers

    from dpipe.models.common.bfl_layout import comfyui_lora

    config = dict(in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                  guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    with torch.device("meta"):
        model = FluxTransformer2DModel(**config)
    gen = torch.Generator().manual_seed(0)
    lora = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and "transformer_blocks" in name:
            lora[f"{name}.lora_A.weight"] = torch.randn(4, module.in_features, generator=gen)
            lora[f"{name}.lora_B.weight"] = torch.randn(module.out_features, 4, generator=gen)
    comfy = comfyui_lora(lora, 0.5, flux1_layout(config))
    kohya = {}
    for key, value in comfy.items():
        module, _, part = key.removeprefix("diffusion_model.").rpartition(".lora_")
        kohya[f"lora_unet_{module.replace('.', '_')}.lora_{'down' if part.startswith('A') else 'up'}.weight"] = value
    back = {k.removeprefix("transformer."): v for k, v in _convert_kohya_flux_lora_to_diffusers(kohya).items()}
    assert back.keys() == lora.keys()
    for key, value in lora.items():
        want = value * 0.5 if ".lora_B." in key else value
        torch.testing.assert_close(back[key], want, msg=key)
