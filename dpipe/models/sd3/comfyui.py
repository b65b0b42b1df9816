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

import torch

from dpipe.models.comfyui import to_comfyui
from dpipe.models.sd3.original import layout


def comfyui_lora(weights: dict[str, torch.Tensor], scale: float,
                 num_layers: int) -> dict[str, torch.Tensor]:
    """diffusers-named LoRA weights (`transformer_blocks.N.<module>.lora_A/B.weight`, no prefix)
    -> ComfyUI/original-named ones (`original.layout`), with `scale` (alpha / rank) folded in. A
    module without an original name raises NotInFormat, with the tensors of the others; a LoRA
    on some of a fused q/k/v projection's parts, ValueError."""
    rows, swapped = layout(num_layers)
    return to_comfyui(weights, scale, rows, swapped, "ComfyUI (original SD3)")
