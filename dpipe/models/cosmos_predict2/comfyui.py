"""Cosmos-Predict2 weights under NVIDIA's original module names, as ComfyUI loads them.

ComfyUI's Cosmos-Predict2 model ("MiniTrainDIT") keeps the names of NVIDIA's checkpoints without
their `net.` prefix, and its LoRA loader takes `diffusion_model.<module>.lora_A.weight` /
`.lora_B.weight`: `diffusion_model.blocks.0.self_attn.q_proj.lora_A.weight`. The mapping is one to
one (diffusers' `convert_cosmos_transformer_checkpoint_to_diffusers`, inverted, for the Linears of
the blocks).
"""

from __future__ import annotations

import re

import torch

COMFY_PREFIX = "diffusion_model."

_BLOCK_RENAMES = {
    "attn1.to_q": "self_attn.q_proj", "attn1.to_k": "self_attn.k_proj",
    "attn1.to_v": "self_attn.v_proj", "attn1.to_out.0": "self_attn.output_proj",
    "attn2.to_q": "cross_attn.q_proj", "attn2.to_k": "cross_attn.k_proj",
    "attn2.to_v": "cross_attn.v_proj", "attn2.to_out.0": "cross_attn.output_proj",
    "ff.net.0.proj": "mlp.layer1", "ff.net.2": "mlp.layer2",
    "norm1.linear_1": "adaln_modulation_self_attn.1",
    "norm1.linear_2": "adaln_modulation_self_attn.2",
    "norm2.linear_1": "adaln_modulation_cross_attn.1",
    "norm2.linear_2": "adaln_modulation_cross_attn.2",
    "norm3.linear_1": "adaln_modulation_mlp.1", "norm3.linear_2": "adaln_modulation_mlp.2",
}
_BLOCK_MODULE = re.compile(r"transformer_blocks\.(\d+)\.(.+)")


def original_module_name(diffusers_name: str) -> str:
    """NVIDIA's name (without `net.`) of a Linear in a transformer block; KeyError for anything
    outside the mapping, so a trained weight is never dropped or misnamed silently."""
    match = _BLOCK_MODULE.fullmatch(diffusers_name)
    if match is None or match.group(2) not in _BLOCK_RENAMES:
        raise KeyError(f"no ComfyUI name for Cosmos module {diffusers_name!r}")
    return f"blocks.{match.group(1)}.{_BLOCK_RENAMES[match.group(2)]}"


def lora_to_comfyui(weights: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """ComfyUI LoRA weights from diffusers-format ones; the scale alpha/rank is folded into B and
    no `.alpha` is written, so every loader applies 1."""
    out = {}
    for key, value in weights.items():
        module, part = key.rsplit(".lora_", 1)
        if not part.startswith(("A.", "B.")):
            raise KeyError(f"not a LoRA weight: {key!r}")
        value = value * scale if part.startswith("B.") else value
        out[f"{COMFY_PREFIX}{original_module_name(module)}.lora_{part}"] = value.contiguous()
    return out
