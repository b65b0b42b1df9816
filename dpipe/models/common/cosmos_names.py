"""Cosmos-Predict2 weights under NVIDIA's original module names, as ComfyUI loads them (Anima's
transformer is Cosmos-Predict2's and keeps these names in its files).

ComfyUI's Cosmos-Predict2 model ("MiniTrainDIT") keeps the names of NVIDIA's checkpoints without
their `net.` prefix, and its LoRA loader takes `diffusion_model.<module>.lora_A.weight` /
`.lora_B.weight`: `diffusion_model.blocks.0.self_attn.q_proj.lora_A.weight`. The mapping is one to
one (diffusers' `convert_cosmos_transformer_checkpoint_to_diffusers`, inverted, for every Linear:
the blocks', `x_embedder.proj.1`, `t_embedder.1.linear_1/2`, `final_layer.adaln_modulation.1/2`
and `final_layer.linear`).

Whole transformers (single files): NVIDIA's checkpoints and ComfyUI's repackaged files hold the
state dict under the same names, with `net.` in front (ComfyUI also loads them without it), plus
buffers of NVIDIA's training code (`pos_embedder.*`, `accum_*`) that diffusers' converter drops.
`from_original` reads them with that converter; `original_state_dict` writes them.
"""

from __future__ import annotations

import re

import torch

from dpipe.models.comfyui import in_original_names, original_linear_name

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
# Whole-transformer names: diffusers module -> NVIDIA module (its .weight follows).
_TOP_RENAMES = {
    "patch_embed.proj": "x_embedder.proj.1",
    "time_embed.t_embedder.linear_1": "t_embedder.1.linear_1",
    "time_embed.t_embedder.linear_2": "t_embedder.1.linear_2",
    "time_embed.norm": "t_embedding_norm",
    "norm_out.linear_1": "final_layer.adaln_modulation.1",
    "norm_out.linear_2": "final_layer.adaln_modulation.2",
    "proj_out": "final_layer.linear",
}
# The Linears among them (the time embedding's norm is an RMSNorm); their halves keep their order:
# diffusers' converter renames the final layer's modulation without swapping it.
_TOP_LINEARS = {k: v for k, v in _TOP_RENAMES.items() if k != "time_embed.norm"}
_BLOCK_PARTS = {
    **_BLOCK_RENAMES,
    "attn1.norm_q": "self_attn.q_norm", "attn1.norm_k": "self_attn.k_norm",
    "attn2.norm_q": "cross_attn.q_norm", "attn2.norm_k": "cross_attn.k_norm",
}
_BLOCK_MODULE = re.compile(r"transformer_blocks\.(\d+)\.(.+)")


def original_module_name(diffusers_name: str) -> str:
    """NVIDIA's name (without `net.`) of a Linear: in a transformer block, or outside (the patch
    embedder, the time embedder, the final layer); KeyError for anything outside the mapping, so
    a trained weight is never dropped or misnamed silently."""
    return original_linear_name(diffusers_name, _TOP_LINEARS, _BLOCK_MODULE, _BLOCK_RENAMES,
                                "Cosmos")


def lora_to_comfyui(weights: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """ComfyUI LoRA weights from diffusers-format ones, under the original Cosmos-Predict2 names."""
    return in_original_names(weights, scale, original_module_name, "ComfyUI (original Cosmos-Predict2)")


def original_state_dict(weights: dict[str, torch.Tensor], prefix: str = "net.") -> dict[str, torch.Tensor]:
    """A diffusers CosmosTransformer3DModel (Predict2) state dict under NVIDIA's names, with
    `prefix` in front as NVIDIA's checkpoints have it. Raises KeyError for a weight it has no name
    for, so nothing is dropped silently."""
    out = {}
    for key, value in weights.items():
        module, param = key.rsplit(".", 1)
        block = _BLOCK_MODULE.fullmatch(module)
        if block is not None and block.group(2) in _BLOCK_PARTS:
            name = f"blocks.{block.group(1)}.{_BLOCK_PARTS[block.group(2)]}"
        elif module in _TOP_RENAMES:
            name = _TOP_RENAMES[module]
        else:
            raise KeyError(f"no original Cosmos-Predict2 name for {key!r}")
        out[f"{prefix}{name}.{param}"] = value
    return out


def from_original(state: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """NVIDIA-named weights (with or without `net.`) -> `model`'s diffusers names, by diffusers'
    converter (which also drops the training buffers). A state dict already in diffusers' names is
    returned as is (the converter would rename `transformer_blocks` again)."""
    from diffusers.loaders.single_file_utils import (
        convert_cosmos_transformer_checkpoint_to_diffusers)

    if set(state) <= set(model.state_dict()):
        return state
    return convert_cosmos_transformer_checkpoint_to_diffusers(dict(state))


def file_state_dict(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`original_state_dict` without a prefix: the names a full fine-tune's single file takes
    (`export_like_source` puts back the source file's own prefix)."""
    return original_state_dict(weights, prefix="")
