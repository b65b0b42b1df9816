"""AuraFlow in its original (fal) layout, which ComfyUI runs: module names and a ComfyUI LoRA.

ComfyUI's AuraFlow model (comfy/ldm/aura/mmdit.py) keeps the original checkpoint's names
(`aura_flow_0.3.safetensors`): `double_layers.N.attn.w2q` for the image stream's query
(diffusers `joint_transformer_blocks.N.attn.to_q`), `w1*` for the text stream, `mlpX.c_fc1`,
`modX.1`, `single_layers.N...`. Nothing is fused, so a LoRA maps one module to one module; the
names are those of diffusers' `convert_auraflow_transformer_checkpoint_to_diffusers` (read the
other way) and of ComfyUI's own `auraflow_to_diffusers` table. ComfyUI's loader takes
`diffusion_model.<module>.lora_A.weight` / `.lora_B.weight` for any model; alpha / rank is folded
into B (no alpha written: ComfyUI then applies scale 1).
"""

from __future__ import annotations

import torch

from dpipe.models.common.key_tables import swap_halves

_DOUBLE = {
    "attn.to_q": "attn.w2q", "attn.to_k": "attn.w2k", "attn.to_v": "attn.w2v",
    "attn.to_out.0": "attn.w2o",
    "attn.add_q_proj": "attn.w1q", "attn.add_k_proj": "attn.w1k", "attn.add_v_proj": "attn.w1v",
    "attn.to_add_out": "attn.w1o",
    "ff.linear_1": "mlpX.c_fc1", "ff.linear_2": "mlpX.c_fc2", "ff.out_projection": "mlpX.c_proj",
    "ff_context.linear_1": "mlpC.c_fc1", "ff_context.linear_2": "mlpC.c_fc2",
    "ff_context.out_projection": "mlpC.c_proj",
    "norm1.linear": "modX.1", "norm1_context.linear": "modC.1",
}
_SINGLE = {
    "attn.to_q": "attn.w1q", "attn.to_k": "attn.w1k", "attn.to_v": "attn.w1v",
    "attn.to_out.0": "attn.w1o", "norm1.linear": "modCX.1",
    "ff.linear_1": "mlp.c_fc1", "ff.linear_2": "mlp.c_fc2", "ff.out_projection": "mlp.c_proj",
}
_GLOBAL = {
    "time_step_proj.linear_1": "t_embedder.mlp.0", "time_step_proj.linear_2": "t_embedder.mlp.2",
    "context_embedder": "cond_seq_linear", "pos_embed.proj": "init_x_linear",
    "proj_out": "final_linear", "norm_out.linear": "modF.1",
    # parameters, not modules
    "pos_embed.pos_embed": "positional_encoding", "register_tokens": "register_tokens",
}
# The original final modulation emits (shift, scale); diffusers' AdaLayerNormContinuous
# (scale, shift): its output rows are swapped between the layouts.
SWAPPED = "norm_out.linear"


def native_module_name(name: str) -> str:
    """A diffusers AuraFlowTransformer2DModel module (or parameter) name -> the original's."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    kind, index, rest = name.split(".", 2)
    table, native = {"joint_transformer_blocks": (_DOUBLE, "double_layers"),
                     "single_transformer_blocks": (_SINGLE, "single_layers")}.get(kind, (None, None))
    if table is None or rest not in table:
        raise ValueError(f"no original AuraFlow name for {name}")
    return f"{native}.{index}.{table[rest]}"


def native_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers AuraFlow transformer state dict under the original names (the inverse of
    diffusers' single-file converter)."""
    out = {}
    for key, value in state_dict.items():
        module, _, param = key.rpartition(".")
        if key in _GLOBAL:
            out[_GLOBAL[key]] = value
            continue
        out[f"{native_module_name(module)}.{param}"] = swap_halves(value) if module == SWAPPED else value
    return out


def comfyui_lora(weights: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """diffusers-named LoRA weights (no adapter name) -> ComfyUI keys in the original names."""
    from dpipe.models.comfyui import COMFY_PREFIX, peft_pairs

    out = {}
    for module, (a, b) in peft_pairs(weights).items():
        b = b * scale
        if module == SWAPPED:  # W' = swap(W + B A) = swap(W) + swap(B) A
            b = swap_halves(b)
        name = f"{COMFY_PREFIX}{native_module_name(module)}"
        out[f"{name}.lora_A.weight"] = a.contiguous()
        out[f"{name}.lora_B.weight"] = b.contiguous()
    return out


# A key every original AuraFlow transformer has (one of those diffusers detects the family by).
MARKER = "cond_seq_linear.weight"


def from_original(state: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """Original-named weights (a single-file checkpoint) -> diffusers names, through diffusers'
    own `convert_auraflow_transformer_checkpoint_to_diffusers` (it takes every size from the
    checkpoint). That converter fills a name it does not find with None; those are dropped, so the
    loader reports them as missing weights. A file without the original names is returned as is."""
    from diffusers.loaders.single_file_utils import (
        convert_auraflow_transformer_checkpoint_to_diffusers)

    if MARKER not in state:
        return state
    converted = convert_auraflow_transformer_checkpoint_to_diffusers(dict(state))
    return {k: v for k, v in converted.items() if v is not None}
