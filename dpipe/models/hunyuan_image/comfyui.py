"""A HunyuanImage 2.1 LoRA in the module names ComfyUI runs the model with, for every Linear.

ComfyUI runs HunyuanImage 2.1 on its HunyuanVideo model (its model detection sends checkpoints
with `txt_in.individual_token_refiner...` and `byt5_in` there), renaming the file's original keys
on load (`original.comfyui_key`: `img_attn_qkv` -> `img_attn.qkv`, ...), so its blocks are
Flux-style:
`double_blocks.N.img_attn.qkv` (q, k, v fused), `img_attn.proj`, `img_mlp.0` / `.2`,
`img_mod.lin` and the same for `txt_`; `single_blocks.N.linear1` (q, k, v and the MLP input
fused, in that order), `linear2`, `modulation.lin`. kohya's sd-scripts converts its HunyuanImage
LoRAs to ComfyUI's by exactly these renames (`img_mlp_fc1` -> `img_mlp_0`, `img_mod_linear` ->
`img_mod_lin`, `modulation_linear` -> `modulation_lin`; its `img_attn_qkv`, `linear1` already
match). Outside the blocks the same renames give the token refiner's `self_attn.qkv`,
`self_attn.proj`, `mlp.0` / `.2`, the embedder MLPs' `in_layer` / `out_layer` (`time_in`,
`txt_in.t_embedder`, `txt_in.c_embedder`), and leave `txt_in.input_embedder`, `byt5_in.fc1..3`
and `final_layer.linear` / `.adaLN_modulation.1` as they are; the final modulation is
(shift, scale) there, so its B's halves are exchanged. Read in both sources; ComfyUI 0.33.0
applied every key of the tiny model's file, each weight as dpipe's merge
(docs/bench-results/comfyui-0.33.0-loads).

ComfyUI's LoRA loader takes `diffusion_model.<module>.lora_A.weight` / `.lora_B.weight` for any
model. LoRAs on the separate diffusers projections become one exact LoRA on the fused Linear
(A stacked, B block-diagonal); alpha / rank is folded into B, so no alpha is written.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from dpipe.models.comfyui import to_comfyui
from dpipe.models.common.comfyui_hunyuan import comfyui_module
from dpipe.models.common.key_tables import FINAL_MODULATION
from dpipe.models.hunyuan_image.original import layout


def comfyui_mapping(config: dict[str, Any]) -> Iterator[tuple[str, list[str], list[int | None]]]:
    """(ComfyUI module, the diffusers modules stacked in it, their output sizes) for every
    Linear of the original layout (`original.py`, the table single files load by: the blocks,
    the token refiner, the embedders and the final layer) under the names ComfyUI renames them
    to. The norms are left out: no LoRA targets them."""
    for original, parts, sizes in layout(config):
        if not parts[0].rsplit(".", 1)[-1].startswith("norm"):
            yield comfyui_module(original), parts, sizes


def comfyui_lora(weights: dict[str, torch.Tensor], scale: float,
                 config: dict[str, Any]) -> dict[str, torch.Tensor]:
    return to_comfyui(weights, scale, comfyui_mapping(config), swapped=FINAL_MODULATION)


def comfyui_block_weights(state_dict: dict[str, torch.Tensor],
                          config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The block Linears' weights and biases of a diffusers state dict, fused under ComfyUI's
    names (what a ComfyUI LoRA is merged into; for checks)."""
    out = {}
    for original, parts, _ in comfyui_mapping(config):
        if not original.startswith(("double_blocks.", "single_blocks.")):
            continue
        for param in ("weight", "bias"):
            keys = [f"{p}.{param}" for p in parts]
            if all(k in state_dict for k in keys):
                out[f"{original}.{param}"] = torch.cat([state_dict[k] for k in keys], dim=0)
    return out
