"""HunyuanVideo 1.5 transformer weights under Tencent's original names: single files and ComfyUI
LoRAs.

Users hold the transformer as one file in Tencent's layout, in one of two forms:
- split, as Tencent releases it (tencent/HunyuanVideo-1.5
  `transformer/720p_t2v/diffusion_pytorch_model.safetensors`): q, k and v of the double blocks
  apart, `double_blocks.N.img_attn_q/_k/_v.weight`. diffusers 0.42.1 has no single-file converter
  for it; its conversion script (scripts/convert_hunyuan_video1_5_to_diffusers.py,
  `convert_hyvideo15_transformer_to_diffusers`) pops these names, and the table here follows it
  name for name.
- fused, as Comfy-Org repackages it (`hunyuanvideo1.5_720p_t2v_fp16.safetensors`, sometimes behind
  ComfyUI's `model.diffusion_model.`): q, k, v stacked in `double_blocks.N.img_attn_qkv` /
  `txt_attn_qkv`, HunyuanVideo 1.0's names; every other name is Tencent's.
ComfyUI runs the model on its HunyuanVideo (Flux-style) modules: its loader renames keys
(`_attn_qkv.` -> `_attn.qkv.`, `_attn_proj.` -> `_attn.proj.`, `mlp.fc1.` -> `mlp.0.`,
`_mod.linear.` -> `_mod.lin.`) but fuses nothing, so a split file leaves its `img_attn.qkv`
uninitialised there. dpipe therefore writes the fused form (tiny single files) and reads both;
a full fine-tune is written back in the form of the file it was trained from (`file_form`), so
each tool loads the result as it loaded the source. Two things the conversion script hard-codes
are taken from the model's config here instead: the number of blocks (54 double, 2 refiner) and
the split of the fused q, k, v (three equal parts of the hidden width).

ComfyUI's LoRA loader takes its runtime names (`img_attn.qkv`, `img_attn.proj`, `img_mlp.0`,
`img_mod.lin`), so each row of the table carries both names; it drives every direction:
- file -> diffusers (`from_original`: fused Linears split at the model's own sizes);
- diffusers -> file (`original_state_dict`: tiny single files for tests, a full fine-tune written
  back in its source's layout);
- diffusers LoRA -> ComfyUI LoRA (`comfyui_mapping`: rows grouped by the ComfyUI name).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from dpipe.models.common.comfyui_hunyuan import comfyui_module
from dpipe.models.common.key_tables import FusedLinear, from_original as _split_original, to_original

# (diffusers module, Tencent module, ComfyUI runtime module (None: no LoRA name), output rows).
# Rows sharing a Tencent (or ComfyUI) module are stacked in it along the output dimension in
# table order; the rows are needed only to split such a module.
Row = tuple[str, str, str | None, int | None]

# The two forms of the file (see above): q, k, v of the double blocks fused or apart.
FUSED, SPLIT = "fused", "split"


def layout(config: dict[str, Any], form: str = FUSED) -> list[Row]:
    """Every weight-holding module of a HunyuanVideo15Transformer3DModel with this config, under
    the names of the file's `form` (FUSED or SPLIT)."""
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    mlp = int(hidden * config.get("mlp_ratio", 4.0))
    c = comfyui_module  # ComfyUI's name of a Linear outside the double blocks
    rows: list[Row] = [
        ("x_embedder.proj", "img_in.proj", None, None),
        ("time_embed.timestep_embedder.linear_1", "time_in.mlp.0", c("time_in.mlp.0"), None),
        ("time_embed.timestep_embedder.linear_2", "time_in.mlp.2", c("time_in.mlp.2"), None),
        ("context_embedder.proj_in", "txt_in.input_embedder", c("txt_in.input_embedder"), None),
    ]
    for d, o in [("timestep_embedder.linear_1", "t_embedder.mlp.0"),
                 ("timestep_embedder.linear_2", "t_embedder.mlp.2"),
                 ("text_embedder.linear_1", "c_embedder.linear_1"),
                 ("text_embedder.linear_2", "c_embedder.linear_2")]:
        rows.append((f"context_embedder.time_text_embed.{d}", f"txt_in.{o}", c(f"txt_in.{o}"), None))
    rows += [
        ("context_embedder_2.norm", "byt5_in.layernorm", None, None),
        ("context_embedder_2.linear_1", "byt5_in.fc1", c("byt5_in.fc1"), None),
        ("context_embedder_2.linear_2", "byt5_in.fc2", c("byt5_in.fc2"), None),
        ("context_embedder_2.linear_3", "byt5_in.fc3", c("byt5_in.fc3"), None),
        # vision_in.proj is Sequential(LayerNorm, Linear, GELU, Linear, LayerNorm).
        ("image_embedder.norm_in", "vision_in.proj.0", None, None),
        ("image_embedder.linear_1", "vision_in.proj.1", c("vision_in.proj.1"), None),
        ("image_embedder.linear_2", "vision_in.proj.3", c("vision_in.proj.3"), None),
        ("image_embedder.norm_out", "vision_in.proj.4", None, None),
        ("cond_type_embed", "cond_type_embedding", None, None),
        ("norm_out.linear", "final_layer.adaLN_modulation.1", c("final_layer.adaLN_modulation.1"),
         None),
        ("proj_out", "final_layer.linear", c("final_layer.linear"), None),
    ]
    if config.get("use_meanflow"):  # the step-distilled checkpoints' second timestep
        rows += [("time_embed.timestep_embedder_r.linear_1", "time_r_in.mlp.0",
                  c("time_r_in.mlp.0"), None),
                 ("time_embed.timestep_embedder_r.linear_2", "time_r_in.mlp.2",
                  c("time_r_in.mlp.2"), None)]
    for i in range(config["num_refiner_layers"]):
        d = f"context_embedder.token_refiner.refiner_blocks.{i}"
        o = f"txt_in.individual_token_refiner.blocks.{i}"
        qkv = c(f"{o}.self_attn_qkv")
        rows += [(f"{d}.norm1", f"{o}.norm1", None, None),
                 (f"{d}.attn.to_q", f"{o}.self_attn_qkv", qkv, hidden),
                 (f"{d}.attn.to_k", f"{o}.self_attn_qkv", qkv, hidden),
                 (f"{d}.attn.to_v", f"{o}.self_attn_qkv", qkv, hidden),
                 (f"{d}.attn.to_out.0", f"{o}.self_attn_proj", c(f"{o}.self_attn_proj"), None),
                 (f"{d}.norm2", f"{o}.norm2", None, None),
                 (f"{d}.ff.net.0.proj", f"{o}.mlp.fc1", c(f"{o}.mlp.fc1"), None),
                 (f"{d}.ff.net.2", f"{o}.mlp.fc2", c(f"{o}.mlp.fc2"), None),
                 (f"{d}.norm_out.linear", f"{o}.adaLN_modulation.1", c(f"{o}.adaLN_modulation.1"),
                  None)]
    for i in range(config["num_layers"]):
        d, o = f"transformer_blocks.{i}", f"double_blocks.{i}"
        # q, k, v: one module fused (rows stacked in table order), or three apart.
        img = [f"{o}.img_attn_qkv"] * 3 if form == FUSED else [f"{o}.img_attn_{x}" for x in "qkv"]
        txt = [f"{o}.txt_attn_qkv"] * 3 if form == FUSED else [f"{o}.txt_attn_{x}" for x in "qkv"]
        rows += [
            (f"{d}.norm1.linear", f"{o}.img_mod.linear", f"{o}.img_mod.lin", 6 * hidden),
            (f"{d}.norm1_context.linear", f"{o}.txt_mod.linear", f"{o}.txt_mod.lin", 6 * hidden),
            (f"{d}.attn.to_q", img[0], f"{o}.img_attn.qkv", hidden),
            (f"{d}.attn.to_k", img[1], f"{o}.img_attn.qkv", hidden),
            (f"{d}.attn.to_v", img[2], f"{o}.img_attn.qkv", hidden),
            (f"{d}.attn.norm_q", f"{o}.img_attn_q_norm", None, None),
            (f"{d}.attn.norm_k", f"{o}.img_attn_k_norm", None, None),
            (f"{d}.attn.to_out.0", f"{o}.img_attn_proj", f"{o}.img_attn.proj", hidden),
            (f"{d}.attn.add_q_proj", txt[0], f"{o}.txt_attn.qkv", hidden),
            (f"{d}.attn.add_k_proj", txt[1], f"{o}.txt_attn.qkv", hidden),
            (f"{d}.attn.add_v_proj", txt[2], f"{o}.txt_attn.qkv", hidden),
            (f"{d}.attn.norm_added_q", f"{o}.txt_attn_q_norm", None, None),
            (f"{d}.attn.norm_added_k", f"{o}.txt_attn_k_norm", None, None),
            (f"{d}.attn.to_add_out", f"{o}.txt_attn_proj", f"{o}.txt_attn.proj", hidden),
            (f"{d}.ff.net.0.proj", f"{o}.img_mlp.fc1", f"{o}.img_mlp.0", mlp),
            (f"{d}.ff.net.2", f"{o}.img_mlp.fc2", f"{o}.img_mlp.2", hidden),
            (f"{d}.ff_context.net.0.proj", f"{o}.txt_mlp.fc1", f"{o}.txt_mlp.0", mlp),
            (f"{d}.ff_context.net.2", f"{o}.txt_mlp.fc2", f"{o}.txt_mlp.2", hidden)]
    return rows


def _groups(rows: list[Row], column: int) -> dict[str, list[Row]]:
    """Rows grouped by their Tencent (column 1) or ComfyUI (column 2) module, in table order."""
    out: dict[str, list[Row]] = {}
    for row in rows:
        if row[column] is not None:
            out.setdefault(row[column], []).append(row)
    return out


def _fused(rows: list[Row]) -> list[FusedLinear]:
    """The table as (Tencent module, the diffusers modules it stacks, their sizes)."""
    return [(original, [row[0] for row in group], [row[3] for row in group])
            for original, group in _groups(rows, 1).items()]


def file_form(keys: Iterable[str]) -> str:
    """SPLIT if these (unprefixed) keys hold a double block's q apart, else FUSED."""
    return SPLIT if any(k.startswith("double_blocks.") and
                        k.endswith(("img_attn_q.weight", "txt_attn_q.weight")) for k in keys) \
        else FUSED


def original_state_dict(weights: dict[str, torch.Tensor], config: dict[str, Any] | None = None,
                        form: str = FUSED) -> dict[str, torch.Tensor]:
    """A diffusers HunyuanVideo15Transformer3DModel state dict under Tencent's names in `form`
    (fused modules concatenated in table order). Without `config` the block counts are read off
    the weights (the sizes are not needed this way). A weight without a name raises ValueError,
    so nothing is dropped silently."""
    return to_original(weights, _fused(layout(config or _config_of(weights), form)),
                       "original HunyuanVideo 1.5")


def from_original(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Tencent-named weights (either form) -> `model`'s diffusers names, fused modules split at
    the model's own sizes. Names the table does not know pass through unchanged (a file already
    in diffusers names loads as it is; anything else is reported by the loader as unexpected)."""
    return _split_original(state, _fused(layout(dict(model.config), file_form(state))))


def comfyui_mapping(config: dict[str, Any], weights: dict[str, torch.Tensor] | None = None
                    ) -> Iterable[tuple[str, list[str], list[int | None]]]:
    """(ComfyUI module, diffusers modules it stacks, their output sizes, None for a module's own)
    for `dpipe.models.comfyui.to_comfyui`: every Linear; with `weights` (diffusers-named LoRA
    weights), only those holding a module with a LoRA."""
    trained = None if weights is None else {k.rsplit(".lora_", 1)[0] for k in weights}
    for comfy, group in _groups(layout(config), 2).items():
        parts = [row[0] for row in group]
        if trained is None or trained.intersection(parts):
            yield comfy, parts, [row[3] for row in group]


def _config_of(weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The config entries `layout` needs, from a state dict: block counts and meanflow."""
    def count(prefix: str) -> int:
        return len({k[len(prefix):].split(".")[0] for k in weights if k.startswith(prefix)})

    head = weights["transformer_blocks.0.attn.norm_q.weight"].shape[0] if count(
        "transformer_blocks.") else 1
    hidden = weights["x_embedder.proj.weight"].shape[0]
    return {"num_attention_heads": hidden // head, "attention_head_dim": head,
            "num_layers": count("transformer_blocks."),
            "num_refiner_layers": count("context_embedder.token_refiner.refiner_blocks."),
            "use_meanflow": any(k.startswith("time_embed.timestep_embedder_r.") for k in weights)}
