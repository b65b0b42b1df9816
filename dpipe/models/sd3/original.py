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

from dpipe.models.sd3.comfyui import _BLOCK_MAP, TOP_LINEARS

# A key every original SD3 transformer has (diffusers detects the family by it).
MARKER = "joint_blocks.0.context_block.adaLN_modulation.1.bias"

# diffusers -> original, for weights outside the joint blocks.
_TOP = {
    "pos_embed.pos_embed": "pos_embed",
    "pos_embed.proj": "x_embedder.proj",
    **TOP_LINEARS,  # the embedders' and final layer's Linears; norm_out.linear's halves swapped
}
# The q/k norms (SD3.5), not in the LoRA table.
_NORMS = {
    "attn.norm_q": "x_block.attn.ln_q", "attn.norm_k": "x_block.attn.ln_k",
    "attn.norm_added_q": "context_block.attn.ln_q", "attn.norm_added_k": "context_block.attn.ln_k",
    "attn2.norm_q": "x_block.attn2.ln_q", "attn2.norm_k": "x_block.attn2.ln_k",
}
_BLOCK = re.compile(r"transformer_blocks\.(\d+)\.(.+)")


def from_original(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Original-named weights -> diffusers names. A file without the original names is returned
    as is (a transformer saved by diffusers as one file loads; anything else is then reported by
    the loader as missing / unexpected weights)."""
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    if MARKER not in state:
        return state
    return convert_sd3_transformer_checkpoint_to_diffusers(dict(state))


def _swap(t: torch.Tensor) -> torch.Tensor:
    first, second = t.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def original_state_dict(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers SD3Transformer2DModel state dict under the original names (q/k/v concatenated
    along the output dimension). Raises KeyError for a weight it has no name for."""
    last = max(int(m.group(1)) for k in weights if (m := _BLOCK.match(k)))
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[int, torch.Tensor]] = {}
    for key, value in weights.items():
        module, _, param = key.rpartition(".")
        if key == "pos_embed.pos_embed":
            out["pos_embed"] = value
            continue
        if module in _TOP:
            out[f"{_TOP[module]}.{param}"] = _swap(value) if module == "norm_out.linear" else value
            continue
        match = _BLOCK.fullmatch(module)
        if match is None:
            raise KeyError(f"no original SD3 name for {key!r}")
        index, part = match.groups()
        block = f"joint_blocks.{index}"
        if part in _NORMS:
            out[f"{block}.{_NORMS[part]}.{param}"] = value
            continue
        if part not in _BLOCK_MAP:
            raise KeyError(f"no original SD3 name for {key!r}")
        original, chunk = _BLOCK_MAP[part]
        if chunk is None:
            # The last block's context modulation is (shift, scale) in the original only.
            swapped = int(index) == last and part == "norm1_context.linear"
            out[f"{block}.{original}.{param}"] = _swap(value) if swapped else value
        else:
            fused.setdefault(f"{block}.{original}.{param}", {})[chunk] = value
    for key, chunks in fused.items():
        if sorted(chunks) != [0, 1, 2]:
            raise KeyError(f"{key} needs all of q, k and v")
        out[key] = torch.cat([chunks[i] for i in range(3)], dim=0)
    return out
