"""Chroma transformer weights under the original (lodestones, FLUX-style) names, as the single files
users hold them: Chroma1-HD.safetensors, chroma-unlocked-v48.safetensors, ... with keys
`double_blocks.N.img_attn.qkv.weight`, `single_blocks.N.linear1.weight`,
`distilled_guidance_layer.layers.N.in_layer.weight` (ComfyUI's saves put `model.diffusion_model.`
in front, which the loader strips).

Reading uses diffusers' `convert_chroma_transformer_checkpoint_to_diffusers`, except for one thing
it cannot do for any model but Chroma's 8.9B one: it splits each single block's fused `linear1`
(q, k, v, MLP in) at a fixed width of 3072. That split is done here at the model's own sizes;
every other name goes through diffusers' converter. `original_state_dict` is the inverse (for
tests and for writing a full fine-tune back in the file's layout), checked against diffusers'
converter.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from dpipe.models.single_file import (LINEAR1_PARTS, SINGLE_LINEAR1, FusedWeights,
                                      block_original_module, split_linear1)

# A key every original Chroma transformer has (diffusers detects the family by it).
MARKER = "distilled_guidance_layer.in_proj.bias"

# The width diffusers' converter splits linear1 at (Chroma's 3072), and its MLP ratio.
_CONVERTER_WIDTH, _MLP_RATIO = 3072, 4


def from_original(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Original-named weights -> `model`'s diffusers names. A file without the original names is
    returned as is (a transformer saved by diffusers as one file loads; anything else is then
    reported by the loader as missing / unexpected weights)."""
    from diffusers.loaders.single_file_utils import (
        convert_chroma_transformer_checkpoint_to_diffusers)

    if MARKER not in state:
        return state
    state, ours = dict(state), {}
    rows = _CONVERTER_WIDTH * (3 + _MLP_RATIO)
    for key in [k for k in state if SINGLE_LINEAR1.fullmatch(k)]:
        ours.update(split_linear1(key, state[key], model))
        # diffusers' converter pops every linear1 and splits it at its fixed width: give it a
        # placeholder of that size that costs no memory (meta), and replace what it makes of it.
        state[key] = torch.empty((rows, *state[key].shape[1:]), device="meta")
    converted = convert_chroma_transformer_checkpoint_to_diffusers(state)
    converted.update(ours)
    return converted


# diffusers -> original, for the weights renamed one to one.
_TOP = {
    "distilled_guidance_layer.in_proj": "distilled_guidance_layer.in_proj",
    "distilled_guidance_layer.out_proj": "distilled_guidance_layer.out_proj",
    "context_embedder": "txt_in", "x_embedder": "img_in", "proj_out": "final_layer.linear",
}
_APPROXIMATOR = {"linear_1": "in_layer", "linear_2": "out_layer"}
_DOUBLE = {
    "attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
    "attn.norm_added_q": "txt_attn.norm.query_norm", "attn.norm_added_k": "txt_attn.norm.key_norm",
    "attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj",
    "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2",
    "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2",
}
_SINGLE = {"attn.norm_q": "norm.query_norm", "attn.norm_k": "norm.key_norm", "proj_out": "linear2"}
# (diffusers block prefix, original block prefix, renames, {original fused module: its parts})
_BLOCKS = [
    ("transformer_blocks", "double_blocks", _DOUBLE,
     {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
      "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}),
    ("single_transformer_blocks", "single_blocks", _SINGLE, {"linear1": LINEAR1_PARTS}),
]


def original_state_dict(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers ChromaTransformer2DModel state dict under the original names (fused q/k/v(/mlp)
    concatenated along the output dimension; RMSNorm weights named `scale`). Raises KeyError for a
    weight it has no name for, so nothing is dropped silently."""
    out: dict[str, torch.Tensor] = {}
    fused = FusedWeights()
    for key, value in weights.items():
        module, _, param = key.rpartition(".")
        original, parts, part = _original_module(key, module)
        if original.endswith("_norm") or original.startswith("distilled_guidance_layer.norms."):
            param = "scale"  # the original RMSNorms call their weight `scale`
        if parts is None:
            out[f"{original}.{param}"] = value
        else:
            fused.add(f"{original}.{param}", parts, part, value)
    return out | fused.stacked()


def _original_module(key: str, module: str):
    """(original module, the diffusers parts it fuses or None, which part this one is)."""
    if module in _TOP:
        return _TOP[module], None, None
    match = re.fullmatch(r"distilled_guidance_layer\.(layers|norms)\.(\d+)(?:\.(\w+))?", module)
    if match is not None:
        kind, index, linear = match.groups()
        if kind == "norms":
            return f"distilled_guidance_layer.norms.{index}", None, None
        if linear in _APPROXIMATOR:
            return f"distilled_guidance_layer.layers.{index}.{_APPROXIMATOR[linear]}", None, None
    found = block_original_module(module, _BLOCKS)
    if found is not None:
        return found
    raise KeyError(f"no original Chroma name for {key!r}")
