"""SD3 LoRA in the original (Stability AI MMDiT) key names that ComfyUI loads natively.

diffusers splits the original fused projections: `joint_blocks.N.x_block.attn.qkv` becomes
`attn.to_q/to_k/to_v`, the context stream's becomes `attn.add_q_proj/...` (see diffusers'
`convert_sd3_transformer_checkpoint_to_diffusers`). A LoRA on the three split Linears is exactly a
LoRA on the fused one: down = the three downs stacked (rank 3r), up = the three ups placed block-
diagonally. The scale alpha / rank is folded into `up`, so the file needs no alpha entries.
Outside the blocks the names are those of the same converter: `t_embedder.mlp.0/2`,
`y_embedder.mlp.0/2`, `context_embedder`, `final_layer.linear` and `final_layer.adaLN_modulation.1`
(whose output halves are (shift, scale), diffusers' (scale, shift): the up-projection's halves are
exchanged). Keys: `diffusion_model.<original module>.lora_A.weight` / `.lora_B.weight`.
"""

from __future__ import annotations

import re

import torch

from dpipe.models.comfyui import COMFY_PREFIX
from dpipe.models.common.key_tables import swap_halves
from dpipe.models.lora_files import NotInFormat

# diffusers module (inside transformer_blocks.N) -> (original module inside joint_blocks.N,
# index of the chunk in a fused q/k/v projection, or None for a plain Linear)
_BLOCK_MAP = {
    "attn.to_q": ("x_block.attn.qkv", 0), "attn.to_k": ("x_block.attn.qkv", 1),
    "attn.to_v": ("x_block.attn.qkv", 2), "attn.to_out.0": ("x_block.attn.proj", None),
    "attn.add_q_proj": ("context_block.attn.qkv", 0),
    "attn.add_k_proj": ("context_block.attn.qkv", 1),
    "attn.add_v_proj": ("context_block.attn.qkv", 2),
    "attn.to_add_out": ("context_block.attn.proj", None),
    "attn2.to_q": ("x_block.attn2.qkv", 0), "attn2.to_k": ("x_block.attn2.qkv", 1),
    "attn2.to_v": ("x_block.attn2.qkv", 2), "attn2.to_out.0": ("x_block.attn2.proj", None),
    "norm1.linear": ("x_block.adaLN_modulation.1", None),
    "norm1_context.linear": ("context_block.adaLN_modulation.1", None),
    "ff.net.0.proj": ("x_block.mlp.fc1", None), "ff.net.2": ("x_block.mlp.fc2", None),
    "ff_context.net.0.proj": ("context_block.mlp.fc1", None),
    "ff_context.net.2": ("context_block.mlp.fc2", None),
}
# diffusers module outside the blocks -> original module (a Linear each)
TOP_LINEARS = {
    "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
    "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
    "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
    "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2",
    "context_embedder": "context_embedder",
    "proj_out": "final_layer.linear",
    "norm_out.linear": "final_layer.adaLN_modulation.1",  # (scale, shift) -> (shift, scale)
}
_KEY = re.compile(r"transformer_blocks\.(\d+)\.(.+)\.lora_([AB])\.weight")


def comfyui_lora(weights: dict[str, torch.Tensor], scale: float,
                 num_layers: int) -> dict[str, torch.Tensor]:
    """diffusers-named LoRA weights (`transformer_blocks.N.<module>.lora_A/B.weight`, no prefix)
    -> ComfyUI/original-named ones, with `scale` (alpha / rank) folded in. A module without an
    original name raises NotInFormat, with the tensors of the others."""
    parts: dict[str, dict[int | None, dict[str, torch.Tensor]]] = {}
    unnamed: set[str] = set()
    for key, tensor in weights.items():
        module, _, which = key.rpartition(".lora_")
        if module in TOP_LINEARS:
            which = which.removesuffix(".weight")
            if module == "norm_out.linear" and which == "B":
                tensor = swap_halves(tensor)
            name = f"{COMFY_PREFIX}{TOP_LINEARS[module]}"
            parts.setdefault(name, {}).setdefault(None, {})[which] = tensor
            continue
        m = _KEY.fullmatch(key)
        if m is None or m.group(2) not in _BLOCK_MAP:
            unnamed.add(module)
            continue
        block, module, which = int(m.group(1)), m.group(2), m.group(3)
        target, chunk = _BLOCK_MAP[module]
        if block == num_layers - 1 and module == "norm1_context.linear" and which == "B":
            # The last block's context modulation is stored (shift, scale) in the original and
            # (scale, shift) in diffusers: swap the up-projection's halves back.
            tensor = swap_halves(tensor)
        name = f"{COMFY_PREFIX}joint_blocks.{block}.{target}"
        parts.setdefault(name, {}).setdefault(chunk, {})[which] = tensor
    out = {}
    for name, chunks in parts.items():
        if None in chunks:
            out[f"{name}.lora_A.weight"] = chunks[None]["A"].contiguous()
            out[f"{name}.lora_B.weight"] = (chunks[None]["B"] * scale).contiguous()
            continue
        if sorted(chunks) != [0, 1, 2]:
            raise ValueError(f"{name}: a LoRA on a fused q/k/v projection needs all of q, k and v "
                             f"(got chunks {sorted(chunks)}); add the missing ones to the targets")
        downs = [chunks[i]["A"] for i in range(3)]
        ups = [chunks[i]["B"] * scale for i in range(3)]
        out[f"{name}.lora_A.weight"] = torch.cat(downs, dim=0).contiguous()
        out[f"{name}.lora_B.weight"] = torch.block_diag(*ups).contiguous()
    if unnamed:
        raise NotInFormat("ComfyUI (original SD3)", sorted(unnamed), out)
    return out
