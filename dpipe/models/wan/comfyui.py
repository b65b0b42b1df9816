"""Wan weights under the original (Wan-Video) module names, as ComfyUI and musubi/diffusion-pipe
users hold them.

A Wan LoRA for ComfyUI names each module as the original checkpoint does, prefixed with
`diffusion_model.`: `diffusion_model.blocks.0.self_attn.q.lora_A.weight` / `.lora_B.weight`,
`diffusion_model.time_embedding.0...`, `head.head`. diffusers' `WanPipeline.load_lora_weights`
reads that layout too (it converts it back). The mapping is one to one: Wan's original blocks keep
q, k, v, o apart, as diffusers does.

Single-file transformers (wan2.1_t2v_14B_bf16.safetensors, ...) hold the whole state dict under
those names without a prefix; `original_state_dict` writes it, `from_original` reads it back
(diffusers' converter, as `WanTransformer3DModel.from_single_file`).
"""

from __future__ import annotations

import re

import torch

from dpipe.models.comfyui import in_original_names, original_linear_name

# diffusers module name -> original Wan module name, for every Linear of a block.
_BLOCK_RENAMES = {
    "attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
    "attn1.to_out.0": "self_attn.o",
    "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k", "attn2.to_v": "cross_attn.v",
    "attn2.to_out.0": "cross_attn.o",
    "attn2.add_k_proj": "cross_attn.k_img", "attn2.add_v_proj": "cross_attn.v_img",
    "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2",
}
# diffusers module outside the blocks -> original Wan module, for every Linear there (the
# condition embedder's MLPs, the image embedder's MLP inside `img_emb.proj`, the head).
_TOP_LINEARS = {
    "condition_embedder.time_embedder.linear_1": "time_embedding.0",
    "condition_embedder.time_embedder.linear_2": "time_embedding.2",
    "condition_embedder.time_proj": "time_projection.1",
    "condition_embedder.text_embedder.linear_1": "text_embedding.0",
    "condition_embedder.text_embedder.linear_2": "text_embedding.2",
    "condition_embedder.image_embedder.ff.net.0.proj": "img_emb.proj.1",
    "condition_embedder.image_embedder.ff.net.2": "img_emb.proj.3",
    "proj_out": "head.head",
}
_BLOCK_MODULE = re.compile(r"blocks\.(\d+)\.(.+)")


def original_module_name(diffusers_name: str) -> str:
    """The original Wan name of a Linear ("blocks.3.attn1.to_q" -> "blocks.3.self_attn.q",
    "condition_embedder.time_proj" -> "time_projection.1"); raises KeyError for a module outside
    the mapping, so a trained weight is never dropped or misnamed silently."""
    return original_linear_name(diffusers_name, _TOP_LINEARS, _BLOCK_MODULE, _BLOCK_RENAMES,
                                "Wan")


def lora_to_comfyui(weights: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """ComfyUI LoRA weights from diffusers-format ones, under the original Wan names."""
    return in_original_names(weights, scale, original_module_name, "ComfyUI (original Wan)")


# Whole-transformer names (a full fine-tune in the original / ComfyUI single-file layout): the
# inverse of diffusers' `convert_wan_transformer_to_diffusers`.
_TOP_RENAMES = {
    **_TOP_LINEARS,
    "patch_embedding": "patch_embedding",
    "condition_embedder.image_embedder.norm1": "img_emb.proj.0",
    "condition_embedder.image_embedder.norm2": "img_emb.proj.4",
}
_BLOCK_PARTS = {  # diffusers module in a block -> original module (its .weight/.bias follow)
    **_BLOCK_RENAMES,
    "attn1.norm_q": "self_attn.norm_q", "attn1.norm_k": "self_attn.norm_k",
    "attn2.norm_q": "cross_attn.norm_q", "attn2.norm_k": "cross_attn.norm_k",
    "attn2.norm_added_k": "cross_attn.norm_k_img",
    "norm2": "norm3",  # the cross-attention norm; the other norms carry no weights
}


def original_state_dict(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers WanTransformer3DModel state dict under the original Wan names, as single-file
    (ComfyUI) checkpoints hold it. Raises KeyError for a weight it has no name for."""
    out = {}
    for key, value in weights.items():
        out[_original_key(key)] = value
    return out


def _original_key(key: str) -> str:
    if key == "scale_shift_table":
        return "head.modulation"
    block = _BLOCK_MODULE.fullmatch(key)
    if block is not None:
        index, rest = block.groups()
        if rest == "scale_shift_table":
            return f"blocks.{index}.modulation"
        module, param = rest.rsplit(".", 1)
        if module in _BLOCK_PARTS:
            return f"blocks.{index}.{_BLOCK_PARTS[module]}.{param}"
    else:
        module, param = key.rsplit(".", 1)
        if module in _TOP_RENAMES:
            return f"{_TOP_RENAMES[module]}.{param}"
    raise KeyError(f"no original Wan name for {key!r}")


def from_original(state: dict[str, torch.Tensor], _model) -> dict[str, torch.Tensor]:
    """A single file's original Wan names -> diffusers', by diffusers' converter."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    return convert_wan_transformer_to_diffusers(state)
