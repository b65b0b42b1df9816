"""Z-Image in the original checkpoint's names, which ComfyUI runs (those of the single-file
`z_image_turbo_bf16.safetensors`): fused attention.qkv, attention.out, x_embedder, final_layer.
diffusers' `convert_z_image_transformer_checkpoint_to_diffusers` maps them the other way.
"""

from __future__ import annotations

import torch

from dpipe.models.comfyui import fused_qkv_lora_pairs, fused_qkv_state

_TO_NATIVE = {".attention.to_out.0": ".attention.out", "all_final_layer.2-1.": "final_layer.",
              "all_x_embedder.2-1.": "x_embedder."}


def native_module_name(name: str) -> str:
    for diffusers_name, native in _TO_NATIVE.items():
        name = name.replace(diffusers_name, native)
    return name


def native_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers ZImageTransformer2DModel state dict under the original (ComfyUI) names: the
    inverse of diffusers' single-file conversion (q/k/v fused into qkv, norm_q -> q_norm, ...)."""
    return fused_qkv_state(state_dict, ".attention", native_weight_name)


def native_weight_name(key: str) -> str:
    key = native_module_name(key).replace(".attention.norm_q.", ".attention.q_norm.")
    return key.replace(".attention.norm_k.", ".attention.k_norm.")


def comfy_lora_pairs(weights: dict[str, torch.Tensor], alpha: float):
    """diffusers-named LoRA weights -> {ComfyUI module: (A, B, alpha)}; q/k/v fused into qkv."""
    return fused_qkv_lora_pairs(weights, alpha, ".attention", native_module_name, "Z-Image")
