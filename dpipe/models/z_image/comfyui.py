"""Z-Image in the original checkpoint's names, which ComfyUI runs (those of the single-file
`z_image_turbo_bf16.safetensors` and of its GGUFs): fused attention.qkv, attention.out,
x_embedder, final_layer. diffusers' `convert_z_image_transformer_checkpoint_to_diffusers` maps
them to diffusers' names (`from_native`); `native_state_dict` the other way.
"""

from __future__ import annotations

import torch

from dpipe.models.comfyui import fused_pair, peft_pairs

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
    out = {}
    for key, value in state_dict.items():
        if ".attention.to_k." in key or ".attention.to_v." in key:
            continue
        if ".attention.to_q." in key:
            base, _, tail = key.partition(".attention.to_q.")
            out[f"{base}.attention.qkv.{tail}"] = torch.cat(
                [state_dict[f"{base}.attention.to_{n}.{tail}"] for n in "qkv"], dim=0)
            continue
        key = native_module_name(key).replace(".attention.norm_q.", ".attention.q_norm.")
        out[key.replace(".attention.norm_k.", ".attention.k_norm.")] = value
    return out


def comfy_lora_pairs(weights: dict[str, torch.Tensor], alpha: float):
    """diffusers-named LoRA weights -> {ComfyUI module: (A, B, alpha)}; q/k/v fused into qkv."""
    pairs = peft_pairs(weights)
    out = {}
    for module, (a, b) in pairs.items():
        if module.endswith((".attention.to_k", ".attention.to_v")):
            continue
        if module.endswith(".attention.to_q"):
            base = module[: -len(".to_q")]
            parts = [pairs.get(f"{base}.{n}") for n in ("to_q", "to_k", "to_v")]
            if any(p is None for p in parts):
                raise ValueError(f"{base}: a ComfyUI LoRA needs all of to_q, to_k and to_v "
                                 "(ComfyUI's Z-Image has one fused qkv Linear)")
            fa, fb = fused_pair(parts, [p[1].shape[0] for p in parts], 1.0)
            out[f"{base}.qkv"] = (fa, fb, alpha * 3)  # alpha / rank stays as it was
        else:
            out[native_module_name(module)] = (a, b, alpha)
    return out
