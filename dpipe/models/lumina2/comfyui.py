"""Lumina 2 in the original checkpoint's names, which ComfyUI runs: the transformer's weights
(single files) and its LoRAs.

ComfyUI runs Lumina 2 with the original checkpoint's names (diffusers'
`convert_lumina2_to_diffusers` maps them the other way): attention.qkv (fused), attention.out,
feed_forward.w1/w2/w3, adaLN_modulation.1 for the modulation.
"""

from __future__ import annotations

import torch
from torch import nn

from dpipe.models.comfyui import fused_qkv_lora_pairs, fused_qkv_state

_TO_NATIVE = [(".attn.to_out.0", ".attention.out"), (".feed_forward.linear_1", ".feed_forward.w1"),
              (".feed_forward.linear_2", ".feed_forward.w2"),
              (".feed_forward.linear_3", ".feed_forward.w3"), (".norm1.linear", ".adaLN_modulation.1")]


def native_module_name(name: str) -> str:
    for diffusers_name, native in _TO_NATIVE:
        name = name.replace(diffusers_name, native)
    return name


_TO_NATIVE_WEIGHTS = [
    ("time_caption_embed.caption_embedder", "cap_embedder"),
    ("time_caption_embed.timestep_embedder.linear_1", "t_embedder.mlp.0"),
    ("time_caption_embed.timestep_embedder.linear_2", "t_embedder.mlp.2"),
    ("norm_out.linear_1", "final_layer.adaLN_modulation.1"), ("norm_out.linear_2", "final_layer.linear"),
    (".norm1.norm.", ".attention_norm1."), (".norm2.", ".attention_norm2."),
    (".attn.norm_q.", ".attention.q_norm."), (".attn.norm_k.", ".attention.k_norm."),
]


def native_weight_name(key: str) -> str:
    if key.startswith("context_refiner.") and ".norm1." in key:
        key = key.replace(".norm1.", ".attention_norm1.")  # no modulation: a plain RMSNorm
    for diffusers_name, native in _TO_NATIVE_WEIGHTS:
        key = key.replace(diffusers_name, native)
    return native_module_name(key)


def native_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers Lumina2Transformer2DModel state dict under the original (ComfyUI) names: the
    inverse of diffusers' `convert_lumina2_to_diffusers` (q/k/v fused into attention.qkv)."""
    return fused_qkv_state(state_dict, ".attn", native_weight_name)


def from_native(native: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Original/ComfyUI-named weights -> `model`'s diffusers names: qkv split at the model's own
    sizes here, every other name by diffusers' `convert_lumina2_to_diffusers`."""
    from diffusers.loaders.single_file_utils import convert_lumina2_to_diffusers

    native = {k.removeprefix("model.").removeprefix("diffusion_model."): v
              for k, v in native.items() if k != "norm_final.weight"}  # unused in the original
    if "cap_pad_token" in native:  # Z-Image's blocks are Lumina 2's, its GGUFs `lumina2` too
        raise ValueError("it holds cap_pad_token: a Z-Image transformer. Train it with "
                         "model=z_image")
    out = {}
    for key in [k for k in native if ".attention.qkv." in k]:
        base = key.split(".attention.qkv.")[0]
        attn = model.get_submodule(base).attn
        sizes = [attn.to_q.out_features, attn.to_k.out_features, attn.to_v.out_features]
        for name, part in zip(("to_q", "to_k", "to_v"), native.pop(key).split(sizes, dim=0)):
            out[f"{base}.attn.{name}.weight"] = part
    out.update(convert_lumina2_to_diffusers(native))
    return out


def comfy_lora_pairs(weights: dict[str, torch.Tensor], alpha: float):
    """diffusers-named LoRA weights -> {ComfyUI module: (A, B, alpha)}; q/k/v fused into qkv."""
    return fused_qkv_lora_pairs(weights, alpha, ".attn", native_module_name, "Lumina 2")
