"""Ideogram 4's LoRA in ComfyUI's names (ComfyUI 0.33.0, upstream 783545f6,
`comfy/ldm/ideogram4/model.py`): its model keeps diffusers' module names but for attention,
where one `layers.N.attention.qkv` stacks q, k and v along the output dimension (split as
`view(..., 3, heads, head_dim)`) and `layers.N.attention.o` is `to_out.0`. A diffusers-named
LoRA applies none of its attention keys there, so the LoRA on q, k, v is written fused.
"""

from __future__ import annotations

import re

import torch

from dpipe.models.comfyui import peft_pairs, to_comfyui, with_alpha

ATTENTION = re.compile(r"(layers\.\d+\.attention)\.(to_q|to_k|to_v|to_out\.0)")


def lora_to_comfyui(weights: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """Diffusers-named LoRA weights -> ComfyUI's (`diffusion_model.<module>`), the scale folded
    into B and `.alpha` = the rank of each written module."""
    pairs = peft_pairs(weights)
    mapping, fused = [], {}
    for module, (_, b) in pairs.items():
        match = ATTENTION.fullmatch(module)
        if match is None:
            mapping.append((module, [module], [None]))
        elif match[2] == "to_out.0":
            mapping.append((f"{match[1]}.o", [module], [None]))
        else:  # q, k and v have the hidden size each: a part without a LoRA adds zero rows
            fused[match[1]] = b.shape[0]
    for block, hidden in fused.items():
        mapping.append((f"{block}.qkv", [f"{block}.to_{x}" for x in "qkv"], [hidden] * 3))
    return with_alpha(to_comfyui(weights, scale, mapping))
