"""Cosmos 1.0 weights under NVIDIA's original module names, as its checkpoints and ComfyUI hold them.

NVIDIA's Cosmos 1.0 Diffusion checkpoints (`model.pt` of nvidia/Cosmos-1.0-Diffusion-*) name the
transformer ("GeneralDIT") `net.blocks.block{i}.blocks.{0,1,2}...`: in each block, sub-block 0
is self-attention, 1 cross-attention, 2 the MLP, each with its own adaLN-LoRA modulation; the
attention's q/k norms sit inside `to_q`/`to_k` as their second module. ComfyUI's `cosmos` model
keeps these names without `net.`; its LoRA loader takes `diffusion_model.<module>.lora_A.weight`
/ `.lora_B.weight` (`diffusion_model.blocks.block0.blocks.0.block.attn.to_q.0.lora_A.weight`).

The table below is diffusers' `convert_cosmos_transformer_checkpoint_to_diffusers` (Cosmos 1.0
branch) inverted, one to one for every weight; `from_original` reads files with that converter,
`original_state_dict` writes them.
"""

from __future__ import annotations

import re

import torch

from dpipe.models.comfyui import in_original_names

NVIDIA_PREFIX = "net."
# A key only Cosmos 1.0's layout has, and one only Cosmos-Predict2's (diffusers' own detection).
COSMOS1_KEY = "blocks.block0.blocks.0.block.attn.to_q.0.weight"
PREDICT2_KEY = "blocks.0.self_attn.q_proj.weight"

# diffusers module in a block -> NVIDIA module in `blocks.block{i}.`
_BLOCK = {
    **{f"attn{n + 1}.{ours}": f"blocks.{n}.block.attn.{theirs}"
       for n in (0, 1)
       for ours, theirs in (("to_q", "to_q.0"), ("norm_q", "to_q.1"), ("to_k", "to_k.0"),
                            ("norm_k", "to_k.1"), ("to_v", "to_v.0"), ("to_out.0", "to_out.0"))},
    "ff.net.0.proj": "blocks.2.block.layer1", "ff.net.2": "blocks.2.block.layer2",
    **{f"norm{n + 1}.linear_{k}": f"blocks.{n}.adaLN_modulation.{k}"
       for n in (0, 1, 2) for k in (1, 2)},
}
# Outside the blocks (the final modulation's halves keep their order: diffusers' converter
# renames it without a swap).
_TOP = {
    "patch_embed.proj": "x_embedder.proj.1",
    "time_embed.t_embedder.linear_1": "t_embedder.1.linear_1",
    "time_embed.t_embedder.linear_2": "t_embedder.1.linear_2",
    "time_embed.norm": "affline_norm",
    "learnable_pos_embed": "extra_pos_embedder",
    "norm_out.linear_1": "final_layer.adaLN_modulation.1",
    "norm_out.linear_2": "final_layer.adaLN_modulation.2",
    "proj_out": "final_layer.linear",
}
_NOT_LINEAR = {"time_embed.norm", "learnable_pos_embed"}
_BLOCK_NOT_LINEAR = {k for k in _BLOCK if ".norm_" in k}
_BLOCK_MODULE = re.compile(r"transformer_blocks\.(\d+)\.(.+)")


def _original_module(module: str, linear_only: bool) -> str:
    if module in _TOP and not (linear_only and module in _NOT_LINEAR):
        return _TOP[module]
    match = _BLOCK_MODULE.fullmatch(module)
    if match and match.group(2) in _BLOCK and not (linear_only and match.group(2) in _BLOCK_NOT_LINEAR):
        return f"blocks.block{match.group(1)}.{_BLOCK[match.group(2)]}"
    raise KeyError(f"no original Cosmos 1.0 name for {module!r}")


def original_module_name(diffusers_name: str) -> str:
    """NVIDIA's name (without `net.`) of a Linear; KeyError for anything else, so a trained
    weight is never dropped or misnamed silently."""
    return _original_module(diffusers_name, linear_only=True)


def lora_to_comfyui(weights: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """ComfyUI LoRA weights from diffusers-format ones, under NVIDIA's Cosmos 1.0 names."""
    return in_original_names(weights, scale, lambda module: original_module_name(module.removeprefix("transformer.")), "ComfyUI (original Cosmos 1.0)")


def original_key(key: str) -> str:
    """NVIDIA's name (without `net.`) of a diffusers weight; KeyError for one it lacks."""
    if key.startswith("learnable_pos_embed."):
        module, param = key.split(".", 1)
    else:
        module, param = key.rsplit(".", 1)
    return f"{_original_module(module, linear_only=False)}.{param}"


def original_state_dict(weights: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """A diffusers CosmosTransformer3DModel (Cosmos 1.0) state dict under NVIDIA's names, with
    `prefix` in front ("net." as NVIDIA's model.pt has it). KeyError for a weight it has no name
    for."""
    return {prefix + original_key(key): value for key, value in weights.items()}


def from_original(state: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """NVIDIA-named Cosmos 1.0 weights (with or without `net.`) -> `model`'s diffusers names, by
    the table above, the training buffers and the log-variance head of NVIDIA's loss left out.
    A state dict already in diffusers' names is returned as is; a Cosmos-Predict2 file raises
    ValueError saying so; names the table lacks stay, for the loader to name as unexpected.

    (diffusers 0.42.1's `convert_cosmos_transformer_checkpoint_to_diffusers` empties the state
    dict before it looks for the Cosmos 1.0 key, so it renames 1.0 files with the Predict2 table:
    not usable here.)"""
    if set(state) <= set(model.state_dict()):
        return state
    state = {k.removeprefix(NVIDIA_PREFIX): v for k, v in state.items()}
    if PREDICT2_KEY in state:
        raise ValueError(f"it holds {PREDICT2_KEY!r}: a Cosmos-Predict2 transformer (use "
                         "model=cosmos_predict2), not Cosmos 1.0")
    if COSMOS1_KEY not in state:
        raise ValueError(f"it has no {COSMOS1_KEY!r}: not a Cosmos 1.0 transformer")
    ours = {original_key(key): key for key in model.state_dict()}
    return {ours.get(k, k): v for k, v in state.items()
            if not (k.startswith(_TRAINING_ONLY) or k.endswith(_EXTRA_STATE))}


# NVIDIA's training state in its checkpoints, which no diffusers weight corresponds to: buffers
# of the training code, and Transformer Engine's per-module metadata (`...attn_op._extra_state`).
_TRAINING_ONLY = ("pos_embedder.", "logvar.", "accum_")
_EXTRA_STATE = "._extra_state"
