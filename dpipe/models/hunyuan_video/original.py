"""HunyuanVideo transformer weights under the original (Tencent) names, as single-file and ComfyUI
checkpoints hold them: hunyuan_video_720_cfgdistill_bf16.safetensors,
hunyuan_video_t2v_720p_bf16.safetensors, ... with keys `double_blocks.N.img_attn_qkv.weight`,
`single_blocks.N.linear1.weight`, `txt_in.individual_token_refiner.blocks.N...` (ComfyUI's own
saves put `model.diffusion_model.` in front, which the loader strips).

Reading uses diffusers' `convert_hunyuan_video_transformer_to_diffusers`, except for one thing it
cannot do for any model but the 13B one: it splits each single block's fused `linear1` at a fixed
hidden size of 3072. That split is done here at the model's own sizes; every other name goes
through diffusers' converter. `original_state_dict` is the inverse (for tests and single-file
export), checked against diffusers' converter.
"""

from __future__ import annotations

import torch
from torch import nn

from dpipe.models.common.comfyui_hunyuan import comfyui_module
from dpipe.models.common.key_tables import swap_halves
from dpipe.models.single_file import (LINEAR1_PARTS, SINGLE_LINEAR1, FusedWeights,
                                      block_original_module, split_linear1)

# A key every original HunyuanVideo transformer has (diffusers detects the family by it).
MARKER = "txt_in.individual_token_refiner.blocks.0.adaLN_modulation.1.bias"


def from_original(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Original-named weights -> `model`'s diffusers names. A state dict already in diffusers'
    names (a transformer saved by diffusers as one file) is returned as is."""
    from diffusers.loaders.single_file_utils import convert_hunyuan_video_transformer_to_diffusers

    if MARKER not in state and set(state) <= set(model.state_dict()):
        return state
    state, out = dict(state), {}
    for key in [k for k in state if SINGLE_LINEAR1.fullmatch(k)]:
        out.update(split_linear1(key, state.pop(key), model))
    out.update(convert_hunyuan_video_transformer_to_diffusers(state))
    return out


# diffusers module -> original module, for the weights renamed one to one.
_TOP = {
    "x_embedder.proj": "img_in.proj",
    "time_text_embed.timestep_embedder.linear_1": "time_in.mlp.0",
    "time_text_embed.timestep_embedder.linear_2": "time_in.mlp.2",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in.mlp.0",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in.mlp.2",
    "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
    "context_embedder.proj_in": "txt_in.input_embedder",
    "context_embedder.time_text_embed.timestep_embedder.linear_1": "txt_in.t_embedder.mlp.0",
    "context_embedder.time_text_embed.timestep_embedder.linear_2": "txt_in.t_embedder.mlp.2",
    "context_embedder.time_text_embed.text_embedder.linear_1": "txt_in.c_embedder.linear_1",
    "context_embedder.time_text_embed.text_embedder.linear_2": "txt_in.c_embedder.linear_2",
    "proj_out": "final_layer.linear",
    "norm_out.linear": "final_layer.adaLN_modulation.1",  # (scale, shift) -> (shift, scale)
}
_REFINER = {
    "norm1": "norm1", "norm2": "norm2", "attn.to_out.0": "self_attn_proj",
    "ff.net.0.proj": "mlp.fc1", "ff.net.2": "mlp.fc2", "norm_out.linear": "adaLN_modulation.1",
}
_DOUBLE = {
    "norm1.linear": "img_mod.linear", "norm1_context.linear": "txt_mod.linear",
    "attn.norm_q": "img_attn_q_norm", "attn.norm_k": "img_attn_k_norm",
    "attn.norm_added_q": "txt_attn_q_norm", "attn.norm_added_k": "txt_attn_k_norm",
    "attn.to_out.0": "img_attn_proj", "attn.to_add_out": "txt_attn_proj",
    "ff.net.0.proj": "img_mlp.fc1", "ff.net.2": "img_mlp.fc2",
    "ff_context.net.0.proj": "txt_mlp.fc1", "ff_context.net.2": "txt_mlp.fc2",
}
_SINGLE = {"attn.norm_q": "q_norm", "attn.norm_k": "k_norm", "norm.linear": "modulation.linear",
           "proj_out": "linear2"}
# (diffusers block prefix, original block prefix, renames, {original fused module: its parts})
_BLOCKS = [
    (r"context_embedder\.token_refiner\.refiner_blocks", "txt_in.individual_token_refiner.blocks",
     _REFINER, {"self_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v")}),
    (r"transformer_blocks", "double_blocks", _DOUBLE,
     {"img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
      "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}),
    (r"single_transformer_blocks", "single_blocks", _SINGLE,
     {"linear1": LINEAR1_PARTS}),
]


def original_state_dict(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers HunyuanVideoTransformer3DModel state dict under the original names (fused
    q/k/v(/mlp) concatenated along the output dimension). Raises KeyError for a weight it has no
    name for, so nothing is dropped silently."""
    out: dict[str, torch.Tensor] = {}
    fused = FusedWeights()
    for key, value in weights.items():
        module, param = key.rsplit(".", 1)
        original, parts, part = _original_module(key, module)
        if parts is None:
            if module == "norm_out.linear":
                value = swap_halves(value)
            out[f"{original}.{param}"] = value
        else:
            fused.add(f"{original}.{param}", parts, part, value)
    return out | fused.stacked()


# ComfyUI's LoRA loader also reads a HunyuanVideo LoRA under the original names (the format of
# diffusion-pipe's LoRAs) by undoing these renames of its module names; it does not undo the
# embedders' (`time_in.in_layer` stays, where the original says `time_in.mlp.0`).
_UNDONE_FOR_LORAS = [
    ("_mod.lin.", "_mod.linear."), ("_attn.qkv.", "_attn_qkv."), ("_attn.proj.", "_attn_proj."),
    ("mlp.0.", "mlp.fc1."), ("mlp.2.", "mlp.fc2."), (".modulation.lin.", ".modulation.linear."),
]


def lora_module(original: str) -> str:
    """The name this family's ComfyUI LoRA gives an original module: the original name where
    ComfyUI's loader maps it back onto its module (every block Linear, as diffusion-pipe's
    LoRAs name them), else ComfyUI's own name (the embedder MLPs)."""
    mapped_back = comfyui_module(original) + ".weight"
    for new, old in _UNDONE_FOR_LORAS:
        mapped_back = mapped_back.replace(new, old)
    return original if mapped_back == original + ".weight" else comfyui_module(original)


def lora_linears(config: dict, weights: dict[str, torch.Tensor]
                 ) -> list[tuple[str, list[str], list[int]]]:
    """(LoRA module name, the diffusers modules stacked in it, their output sizes) for every
    original Linear holding a module with LoRA weights in `weights` (diffusers-named). A module
    without an original name is left out (the writer then reports it)."""
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    mlp = int(hidden * config.get("mlp_ratio", 4.0))
    rows = {k.rsplit(".lora_B.", 1)[0]: v.shape[0] for k, v in weights.items() if ".lora_B." in k}
    out: dict[str, tuple[list[str], list[int]]] = {}
    for module in sorted(rows):
        try:
            original, parts, part = _original_module(module, module)
        except KeyError:
            continue
        if parts is None:
            out[lora_module(original)] = [module], [rows[module]]
            continue
        block = module.removesuffix(part)
        out[lora_module(original)] = ([block + p for p in parts],
                                      [mlp if p == "proj_mlp" else hidden for p in parts])
    return [(name, parts, sizes) for name, (parts, sizes) in out.items()]


def _original_module(key: str, module: str):
    """(original module, the diffusers parts it fuses or None, which part this one is)."""
    if module in _TOP:
        return _TOP[module], None, None
    found = block_original_module(module, _BLOCKS)
    if found is not None:
        return found
    raise KeyError(f"no original HunyuanVideo name for {key!r}")
