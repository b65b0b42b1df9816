"""HunyuanImage 2.1's transformer in Tencent's original layout: single files and ComfyUI's names.

Users hold the transformer as one file in Tencent's layout (`hunyuanimage2.1.safetensors` as
released, `hunyuanimage2.1_bf16.safetensors` as Comfy-Org repackages it, often behind ComfyUI's
`model.diffusion_model.`). Its names, for every weight, are those diffusers'
`scripts/convert_hunyuan_image_to_diffusers.py` reads from the released files (the script is not
shipped in the wheel, so diffusers 0.42.1 has no single-file converter for this model), here in
the fused form (the split form below):
`img_in.proj`, `txt_in.input_embedder`, `txt_in.t_embedder.mlp.0/2`, `txt_in.c_embedder.linear_1/2`,
`txt_in.individual_token_refiner.blocks.N.{norm1, self_attn_qkv, self_attn_proj, norm2, mlp.fc1,
mlp.fc2, adaLN_modulation.1}`, `byt5_in.{layernorm, fc1, fc2, fc3}`, `time_in.mlp.0/2` (and
`time_r_in`, `guidance_in` on the distilled model), `double_blocks.N.{img,txt}_{mod.linear,
attn_qkv, attn_q_norm, attn_k_norm, attn_proj, mlp.fc1, mlp.fc2}`, `single_blocks.N.{modulation.
linear, linear1, q_norm, k_norm, linear2}`, `final_layer.{linear, adaLN_modulation.1}`. The fused
form joins what diffusers keeps apart: q, k, v in `*_attn_qkv` / `self_attn_qkv`, and q, k, v and
the MLP input in the single blocks' `linear1` (split at the model's own widths); the final
modulation emits (shift, scale), diffusers' (scale, shift).

ComfyUI runs the model on its HunyuanVideo code and renames the file's keys on load (its
HunyuanVideo `process_unet_state_dict`: `_attn_qkv.` -> `_attn.qkv.`, `_mod.linear.` ->
`_mod.lin.`, `mlp.fc1.` -> `mlp.0.`, ...; `comfyui_key`). Its LoRAs name those renamed modules.

Which of two forms the released files use is not settled by the sources: diffusers' script pops
q, k, v and `linear1`'s parts split (`img_attn_q`, `linear1_q` .. `linear1_mlp`, `linear2.fc`), the
names Tencent's `convert_hunyuan_dict_for_tensor_parallel` makes from the fused ones (the script
carries that function but, through a mismatched model-type string, never calls it); ComfyUI's
renames start from the fused names. Both are read (and a file saved under ComfyUI's renamed keys):
`file_form` tells them apart, and a fine-tune is written back in the form it came in.

One table (`layout`) lists every weight of the original layout with the diffusers modules stacked
in it, at the model's own sizes; it drives loading (`from_original`), writing a file in that
layout (tiny files for tests, a full fine-tune back in the layout it came in: `to_original`),
the split form (`_split`) and, through `comfyui_key`, the ComfyUI LoRA (`comfyui.py`). It is
driven by the shared table engine (`dpipe.models.common.key_tables`), as FLUX's BFL layout is;
the final layer is swapped alike.
No real HunyuanImage file was loaded here (offline): the names rest on the sources above.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# ComfyUI runs this model on its HunyuanVideo code, renaming the file's keys as for HunyuanVideo.
from dpipe.models.common.comfyui_hunyuan import comfyui_key
from dpipe.models.common.key_tables import from_original as _split_original, to_original as _stack_original

# (original module, the diffusers modules stacked in it along the output, their output sizes;
# None for weights that are never split and are no LoRA target: norms, embedders' inputs, head)
Linear = tuple[str, list[str], list[int | None]]


def _one(original: str, diffusers: str, size: int | None = None) -> Linear:
    return original, [diffusers], [size]


def _mlp(original: str, diffusers: str, size: int) -> list[Linear]:
    """A 2-layer embedder MLP (Linear, SiLU, Linear)."""
    return [_one(f"{original}.mlp.0", f"{diffusers}.linear_1", size),
            _one(f"{original}.mlp.2", f"{diffusers}.linear_2", size)]


def layout(config: dict[str, Any]) -> list[Linear]:
    """Every weight of a HunyuanImageTransformer2DModel with this config in the original layout
    (norms too, as one-to-one entries): blocks first, in the order of ComfyUI's LoRA mapping."""
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    mlp = int(hidden * config.get("mlp_ratio", 4.0))
    out: list[Linear] = []
    for i in range(config["num_layers"]):
        o, d = f"double_blocks.{i}", f"transformer_blocks.{i}"
        out += [
            (f"{o}.img_attn_qkv", [f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v"], [hidden] * 3),
            (f"{o}.txt_attn_qkv", [f"{d}.attn.add_q_proj", f"{d}.attn.add_k_proj",
                                   f"{d}.attn.add_v_proj"], [hidden] * 3),
            _one(f"{o}.img_attn_proj", f"{d}.attn.to_out.0", hidden),
            _one(f"{o}.txt_attn_proj", f"{d}.attn.to_add_out", hidden),
            _one(f"{o}.img_mlp.fc1", f"{d}.ff.net.0.proj", mlp),
            _one(f"{o}.img_mlp.fc2", f"{d}.ff.net.2", hidden),
            _one(f"{o}.txt_mlp.fc1", f"{d}.ff_context.net.0.proj", mlp),
            _one(f"{o}.txt_mlp.fc2", f"{d}.ff_context.net.2", hidden),
            _one(f"{o}.img_mod.linear", f"{d}.norm1.linear", 6 * hidden),
            _one(f"{o}.txt_mod.linear", f"{d}.norm1_context.linear", 6 * hidden),
            _one(f"{o}.img_attn_q_norm", f"{d}.attn.norm_q"),
            _one(f"{o}.img_attn_k_norm", f"{d}.attn.norm_k"),
            _one(f"{o}.txt_attn_q_norm", f"{d}.attn.norm_added_q"),
            _one(f"{o}.txt_attn_k_norm", f"{d}.attn.norm_added_k")]
    for i in range(config["num_single_layers"]):
        o, d = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
        out += [
            (f"{o}.linear1", [f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v", f"{d}.proj_mlp"],
             [hidden, hidden, hidden, mlp]),
            _one(f"{o}.linear2", f"{d}.proj_out", hidden),
            _one(f"{o}.modulation.linear", f"{d}.norm.linear", 3 * hidden),
            _one(f"{o}.q_norm", f"{d}.attn.norm_q"), _one(f"{o}.k_norm", f"{d}.attn.norm_k")]
    c, t = "context_embedder", "context_embedder.time_text_embed"
    out += [_one("img_in.proj", "x_embedder.proj", hidden),
            _one("txt_in.input_embedder", f"{c}.proj_in", hidden),
            *_mlp("txt_in.t_embedder", f"{t}.timestep_embedder", hidden),
            _one("txt_in.c_embedder.linear_1", f"{t}.text_embedder.linear_1", hidden),
            _one("txt_in.c_embedder.linear_2", f"{t}.text_embedder.linear_2", hidden)]
    for i in range(config.get("num_refiner_layers", 2)):
        o, d = f"txt_in.individual_token_refiner.blocks.{i}", f"{c}.token_refiner.refiner_blocks.{i}"
        out += [
            (f"{o}.self_attn_qkv", [f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v"], [hidden] * 3),
            _one(f"{o}.self_attn_proj", f"{d}.attn.to_out.0", hidden),
            _one(f"{o}.norm1", f"{d}.norm1"), _one(f"{o}.norm2", f"{d}.norm2"),
            _one(f"{o}.mlp.fc1", f"{d}.ff.net.0.proj", mlp),
            _one(f"{o}.mlp.fc2", f"{d}.ff.net.2", hidden),
            _one(f"{o}.adaLN_modulation.1", f"{d}.norm_out.linear", 2 * hidden)]
    if config.get("text_embed_2_dim") is not None:  # the ByT5 glyph-text projection
        out += [_one("byt5_in.layernorm", "context_embedder_2.norm"),
                *[_one(f"byt5_in.fc{n}", f"context_embedder_2.linear_{n}") for n in (1, 2, 3)]]
    g = "time_guidance_embed"
    out += _mlp("time_in", f"{g}.timestep_embedder", hidden)
    if config.get("use_meanflow"):
        out += _mlp("time_r_in", f"{g}.timestep_embedder_r", hidden)
    if config.get("guidance_embeds"):
        out += _mlp("guidance_in", f"{g}.guidance_embedder", hidden)
    # (shift, scale) in the file: common.key_tables swaps it to diffusers' (scale, shift)
    out += [_one("final_layer.linear", "proj_out"),
            _one("final_layer.adaLN_modulation.1", "norm_out.linear", 2 * hidden)]
    return out


# The forms a file of this layout comes in (`file_form`): q, k, v (and the single blocks' MLP input)
# fused, as Tencent's `convert_hunyuan_dict_for_tensor_parallel` reads them; split, as that
# function writes them and as diffusers' conversion script pops them from the released files
# (`img_attn_q`, `linear1_q` .. `linear1_mlp`, `linear2.fc`); or fused under ComfyUI's renames.
FUSED, SPLIT, COMFYUI = "fused", "split", "comfyui"
_SPLIT_QKV = ("_attn_q", "_attn_k", "_attn_v")
_SPLIT_LINEAR1 = ("linear1_q", "linear1_k", "linear1_v", "linear1_mlp")


def _split(table: list[Linear]) -> list[Linear]:
    """The table with the blocks' fused Linears as Tencent's tensor-parallel split names them (the
    token refiner's `self_attn_qkv` stays fused there)."""
    out: list[Linear] = []
    for module, parts, sizes in table:
        block, _, name = module.rpartition(".")
        if block.startswith("double_blocks.") and name.endswith("_attn_qkv"):
            stream = name.removesuffix("_attn_qkv")
            out += [(f"{block}.{stream}{x}", [p], [n]) for x, p, n in zip(_SPLIT_QKV, parts, sizes)]
        elif block.startswith("single_blocks.") and name == "linear1":
            out += [(f"{block}.{x}", [p], [n]) for x, p, n in zip(_SPLIT_LINEAR1, parts, sizes)]
        elif block.startswith("single_blocks.") and name == "linear2":
            out.append((f"{module}.fc", parts, sizes))
        else:
            out.append((module, parts, sizes))
    return out


def file_form(keys) -> str:
    """FUSED, SPLIT or COMFYUI: which form of the original layout these (unprefixed) keys use."""
    keys = list(keys)
    if any(k.startswith("double_blocks.") and k.endswith("_attn_q.weight") or ".linear1_q." in k
           for k in keys):
        return SPLIT
    if any(k.startswith("double_blocks.") and "_attn.qkv." in k or "_mod.lin." in k for k in keys):
        return COMFYUI
    return FUSED


def to_original(state_dict: dict[str, torch.Tensor], config: dict[str, Any],
                form: str = FUSED) -> dict[str, torch.Tensor]:
    """A diffusers state dict in the original layout, in `form` (fused weights concatenated in
    order); every weight must have a place (ValueError naming those without)."""
    table = layout(config)
    native = _stack_original(state_dict, _split(table) if form == SPLIT else table, "original HunyuanImage")
    return {comfyui_key(k): v for k, v in native.items()} if form == COMFYUI else native


def from_original(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Original-named weights (any form) -> `model`'s diffusers names, fused weights split at the
    model's own sizes (ValueError where the rows differ: another model). Unknown names pass
    through, for the loader to report as unexpected."""
    table, form = layout(dict(model.config)), file_form(state)
    if form == COMFYUI:
        known = {f"{m}.{p}" for m, _, _ in table for p in ("weight", "bias")}
        renamed = {comfyui_key(k): k for k in known}
        state = {renamed.get(k, k): v for k, v in state.items()}
    return _split_original(state, _split(table) if form == SPLIT else table)
