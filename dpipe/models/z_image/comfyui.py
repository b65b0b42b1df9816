"""Z-Image in the original checkpoint's names, which ComfyUI runs (those of the single-file
`z_image_turbo_bf16.safetensors` and of its GGUFs): fused attention.qkv, attention.out,
x_embedder, final_layer. diffusers' `convert_z_image_transformer_checkpoint_to_diffusers` maps
them to diffusers' names (`from_native`); `native_state_dict` the other way.
"""

from __future__ import annotations

import torch

from dpipe.models.comfyui import fused_qkv_lora_pairs, fused_qkv_state

# Z-Image's caption pad token: in its original files, not in Lumina 2's (which have its blocks).
Z_IMAGE_KEY = "cap_pad_token"
_TO_NATIVE = {".attention.to_out.0": ".attention.out", "all_final_layer.2-1.": "final_layer.",
              "all_x_embedder.2-1.": "x_embedder."}


def from_native(state: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """A single file's original names (prefix removed) -> ZImageTransformer2DModel's, by
    diffusers' converter: q/k/v split from qkv in equal thirds, along rows (so a GGUF's blocks
    split whole), and `norm_final`, which the model does not use, dropped. A Lumina 2 file (the
    same block names, and the same `lumina2` in its GGUFs) is refused as such."""
    from diffusers.loaders.single_file_utils import (
        convert_z_image_transformer_checkpoint_to_diffusers)

    if Z_IMAGE_KEY not in state:
        raise ValueError(f"it has no {Z_IMAGE_KEY}, which Z-Image's files hold: a Lumina-Image "
                         "2.0 transformer? Train that with model=lumina2")
    return convert_z_image_transformer_checkpoint_to_diffusers(dict(state))


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
