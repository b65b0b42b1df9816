"""SD3 / SD3.5 transformer weights under Stability AI's original (MMDiT) names, as the single files
users hold them: sd3.5_large.safetensors, sd3.5_medium.safetensors, sd3_medium.safetensors (keys
`model.diffusion_model.joint_blocks.N.x_block.attn.qkv.weight`, ...; the `_incl_clips` variants
add the text encoders and VAE under other prefixes, which are not the transformer's).

Reading goes through diffusers' own `convert_sd3_transformer_checkpoint_to_diffusers`, which takes
every size from the checkpoint (q/k/v are split in three equal chunks, the swapped modulations in
two halves), so it serves any SD3-shaped model; `original_state_dict` is its inverse (for tests
and for writing a full fine-tune back in the file's layout).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from dpipe.models.common.key_tables import FINAL_MODULATION, FusedLinear, to_original

# A key every original SD3 transformer has (diffusers detects the family by it).
MARKER = "joint_blocks.0.context_block.adaLN_modulation.1.bias"

# original module -> diffusers module (its .weight/.bias follow), outside the joint blocks: the
# embedders' and final layer's Linears (the LoRA's too) and the patch embedding.
TOP_LINEARS = {
    "t_embedder.mlp.0": "time_text_embed.timestep_embedder.linear_1",
    "t_embedder.mlp.2": "time_text_embed.timestep_embedder.linear_2",
    "y_embedder.mlp.0": "time_text_embed.text_embedder.linear_1",
    "y_embedder.mlp.2": "time_text_embed.text_embedder.linear_2",
    "context_embedder": "context_embedder",
    "final_layer.linear": "proj_out",
    "final_layer.adaLN_modulation.1": "norm_out.linear",  # (scale, shift) -> (shift, scale)
}
_PATCH_EMBED = ("x_embedder.proj", "pos_embed.proj")
# In a joint block: original module -> the diffusers modules stacked in it (q, k, v in one `qkv`).
# The q/k norms (`ln_*`, no LoRA target) are SD3.5's, `attn2` the dual-attention blocks' (SD3.5
# Medium); rows of modules a model lacks are passed over.
_BLOCK = {
    "x_block.attn.qkv": ["attn.to_q", "attn.to_k", "attn.to_v"],
    "x_block.attn.proj": ["attn.to_out.0"],
    "context_block.attn.qkv": ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
    "context_block.attn.proj": ["attn.to_add_out"],
    "x_block.attn2.qkv": ["attn2.to_q", "attn2.to_k", "attn2.to_v"],
    "x_block.attn2.proj": ["attn2.to_out.0"],
    "x_block.adaLN_modulation.1": ["norm1.linear"],
    "context_block.adaLN_modulation.1": ["norm1_context.linear"],
    "x_block.mlp.fc1": ["ff.net.0.proj"], "x_block.mlp.fc2": ["ff.net.2"],
    "context_block.mlp.fc1": ["ff_context.net.0.proj"],
    "context_block.mlp.fc2": ["ff_context.net.2"],
    "x_block.attn.ln_q": ["attn.norm_q"], "x_block.attn.ln_k": ["attn.norm_k"],
    "context_block.attn.ln_q": ["attn.norm_added_q"],
    "context_block.attn.ln_k": ["attn.norm_added_k"],
    "x_block.attn2.ln_q": ["attn2.norm_q"], "x_block.attn2.ln_k": ["attn2.norm_k"],
}
_BLOCK_KEY = re.compile(r"transformer_blocks\.(\d+)\.")


def layout(num_layers: int) -> tuple[list[FusedLinear], set[str]]:
    """(rows: original module, the diffusers modules stacked in it, their sizes (None: each
    part's own), original modules whose output halves are swapped) of an SD3 transformer with
    `num_layers` joint blocks. The last block's context modulation is (shift, scale) in the
    original only."""
    rows = [(o, [d], [None]) for o, d in TOP_LINEARS.items()]
    for i in range(num_layers):
        o, d = f"joint_blocks.{i}", f"transformer_blocks.{i}"
        rows += [(f"{o}.{name}", [f"{d}.{p}" for p in parts], [None] * len(parts))
                 for name, parts in _BLOCK.items()]
    last = f"joint_blocks.{num_layers - 1}.context_block.adaLN_modulation.1"
    return rows, {*FINAL_MODULATION, last}


def from_original(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Original-named weights -> diffusers names. A file without the original names is returned
    as is (a transformer saved by diffusers as one file loads; anything else is then reported by
    the loader as missing / unexpected weights)."""
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    if MARKER not in state:
        return state
    return convert_sd3_transformer_checkpoint_to_diffusers(dict(state))


def original_state_dict(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers SD3Transformer2DModel state dict under the original names (q/k/v concatenated
    along the output dimension). Raises ValueError for a weight it has no name for."""
    num_layers = 1 + max(int(m.group(1)) for k in weights if (m := _BLOCK_KEY.match(k)))
    rows, swapped = layout(num_layers)
    rows.append((_PATCH_EMBED[0], [_PATCH_EMBED[1]], [None]))
    renames = {"pos_embed": "pos_embed.pos_embed"} if "pos_embed.pos_embed" in weights else {}
    return to_original(weights, rows, "original SD3", renames, swapped)
