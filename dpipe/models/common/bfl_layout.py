"""FLUX.1 and FLUX.2 in Black Forest Labs' original layout: single files and ComfyUI LoRAs.

Shared by the flux, flux_kontext and flux2 families (one layout, two table versions).

Users hold FLUX transformers as one safetensors file in BFL's layout (`flux1-dev.safetensors`,
`flux2-dev.safetensors`: `double_blocks.N.img_attn.qkv.weight`, ...), often with ComfyUI's
`model.diffusion_model.` prefix. That layout fuses what diffusers keeps apart: q, k, v into one
`qkv` Linear per stream, and in FLUX.1's single blocks q, k, v and the MLP input into `linear1`.

One table per version lists every Linear of the BFL layout with the diffusers modules stacked
(along the output dimension) in it; it drives all three directions:
- BFL file -> diffusers weights (FLUX.1 loading: diffusers' `convert_flux_transformer_checkpoint_
  to_diffusers` hard-codes FLUX.1-dev's widths, 3072 and 12288, to split `linear1`, so the split
  here takes the model's own sizes; a test checks both agree key for key at the real sizes.
  FLUX.2 loads through diffusers' own converter, which has no such sizes);
- diffusers weights -> BFL file (tiny single-file models for tests; the inverse of diffusers');
- diffusers LoRA -> ComfyUI LoRA on the fused Linears (see `comfyui_lora`);
- a full fine-tune of a model that came as a single file -> a file in that layout again
  (`save_bfl_file`, named, typed and prefixed as the source).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dpipe.models.common.key_tables import FINAL_MODULATION, FusedLinear, from_original, to_original

# (BFL module, the diffusers modules stacked in it, their output sizes; None where one module
# maps to one, so nothing is split)
Linear = FusedLinear

def _one(bfl: str, diffusers: str) -> Linear:
    return bfl, [diffusers], [None]


def flux1_layout(config: dict[str, Any]) -> tuple[list[Linear], dict[str, str]]:
    """(Linears, {BFL parameter: diffusers parameter} of the q/k norms) of a FluxTransformer2DModel
    with this config (FLUX.1 dev / schnell / Kontext)."""
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    mlp = 4 * inner  # FluxSingleTransformerBlock's mlp_ratio, fixed in diffusers
    t = "time_text_embed"
    linears = [_one("img_in", "x_embedder"), _one("txt_in", "context_embedder"),
               _one("time_in.in_layer", f"{t}.timestep_embedder.linear_1"),
               _one("time_in.out_layer", f"{t}.timestep_embedder.linear_2"),
               _one("vector_in.in_layer", f"{t}.text_embedder.linear_1"),
               _one("vector_in.out_layer", f"{t}.text_embedder.linear_2"),
               _one("final_layer.linear", "proj_out"),
               _one("final_layer.adaLN_modulation.1", "norm_out.linear")]
    if config.get("guidance_embeds"):
        linears += _guidance(t)
    norms = {}
    for i in range(config["num_layers"]):
        o, d = f"double_blocks.{i}", f"transformer_blocks.{i}"
        linears += [
            *_double_attention(o, d, inner),
            _one(f"{o}.img_mlp.0", f"{d}.ff.net.0.proj"), _one(f"{o}.img_mlp.2", f"{d}.ff.net.2"),
            _one(f"{o}.txt_mlp.0", f"{d}.ff_context.net.0.proj"),
            _one(f"{o}.txt_mlp.2", f"{d}.ff_context.net.2"),
            _one(f"{o}.img_mod.lin", f"{d}.norm1.linear"),
            _one(f"{o}.txt_mod.lin", f"{d}.norm1_context.linear")]
        norms.update(_double_norms(o, d))
    for i in range(config["num_single_layers"]):
        o, d = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
        linears += [
            (f"{o}.linear1", [f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v", f"{d}.proj_mlp"],
             [inner, inner, inner, mlp]),
            _one(f"{o}.linear2", f"{d}.proj_out"), _one(f"{o}.modulation.lin", f"{d}.norm.linear")]
        norms.update(_single_norms(o, d))
    return linears, norms


def flux2_layout(config: dict[str, Any]) -> tuple[list[Linear], dict[str, str]]:
    """As `flux1_layout`, for a Flux2Transformer2DModel (FLUX.2 dev / klein). Its single blocks
    are fused in diffusers too (`attn.to_qkv_mlp_proj` is BFL's `linear1`), and the modulations
    sit outside the blocks, one shared Linear per kind."""
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    t = "time_guidance_embed"
    linears = [_one("img_in", "x_embedder"), _one("txt_in", "context_embedder"),
               _one("time_in.in_layer", f"{t}.timestep_embedder.linear_1"),
               _one("time_in.out_layer", f"{t}.timestep_embedder.linear_2"),
               _one("double_stream_modulation_img.lin", "double_stream_modulation_img.linear"),
               _one("double_stream_modulation_txt.lin", "double_stream_modulation_txt.linear"),
               _one("single_stream_modulation.lin", "single_stream_modulation.linear"),
               _one("final_layer.linear", "proj_out"),
               _one("final_layer.adaLN_modulation.1", "norm_out.linear")]
    if config.get("guidance_embeds"):
        linears += _guidance(t)
    norms = {}
    for i in range(config["num_layers"]):
        o, d = f"double_blocks.{i}", f"transformer_blocks.{i}"
        linears += [
            *_double_attention(o, d, inner),
            _one(f"{o}.img_mlp.0", f"{d}.ff.linear_in"), _one(f"{o}.img_mlp.2", f"{d}.ff.linear_out"),
            _one(f"{o}.txt_mlp.0", f"{d}.ff_context.linear_in"),
            _one(f"{o}.txt_mlp.2", f"{d}.ff_context.linear_out")]
        norms.update(_double_norms(o, d))
    for i in range(config["num_single_layers"]):
        o, d = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
        linears += [_one(f"{o}.linear1", f"{d}.attn.to_qkv_mlp_proj"),
                    _one(f"{o}.linear2", f"{d}.attn.to_out")]
        norms.update(_single_norms(o, d))
    return linears, norms


def _guidance(t: str) -> list[Linear]:
    """The guidance embedder of FLUX.1-dev and FLUX.2 under their time embedding `t`."""
    return [_one("guidance_in.in_layer", f"{t}.guidance_embedder.linear_1"),
            _one("guidance_in.out_layer", f"{t}.guidance_embedder.linear_2")]


def _double_attention(o: str, d: str, inner: int) -> list[Linear]:
    """A double block's attention (BFL `o`, diffusers `d`): fused q/k/v per stream and the two
    output projections, alike in FLUX.1 and FLUX.2."""
    return [
        (f"{o}.img_attn.qkv", [f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v"], [inner] * 3),
        (f"{o}.txt_attn.qkv", [f"{d}.attn.add_q_proj", f"{d}.attn.add_k_proj",
                               f"{d}.attn.add_v_proj"], [inner] * 3),
        _one(f"{o}.img_attn.proj", f"{d}.attn.to_out.0"),
        _one(f"{o}.txt_attn.proj", f"{d}.attn.to_add_out")]


def _double_norms(o: str, d: str) -> dict[str, str]:
    return {f"{o}.img_attn.norm.query_norm.scale": f"{d}.attn.norm_q.weight",
            f"{o}.img_attn.norm.key_norm.scale": f"{d}.attn.norm_k.weight",
            f"{o}.txt_attn.norm.query_norm.scale": f"{d}.attn.norm_added_q.weight",
            f"{o}.txt_attn.norm.key_norm.scale": f"{d}.attn.norm_added_k.weight"}


def _single_norms(o: str, d: str) -> dict[str, str]:
    return {f"{o}.norm.query_norm.scale": f"{d}.attn.norm_q.weight",
            f"{o}.norm.key_norm.scale": f"{d}.attn.norm_k.weight"}


def to_bfl(state_dict: dict[str, torch.Tensor], layout) -> dict[str, torch.Tensor]:
    """A diffusers transformer state dict in BFL's layout (fused Linears concatenated in order)."""
    linears, norms = layout
    return to_original(state_dict, linears, "BFL", norms)


def from_bfl(native: dict[str, torch.Tensor], layout) -> dict[str, torch.Tensor]:
    """BFL-named weights -> diffusers names, fused Linears split at the layout's sizes. Names the
    layout does not know pass through unchanged (a file already in diffusers names loads as it
    is; anything else is reported by the caller as unexpected)."""
    linears, norms = layout
    return from_original(native, linears, norms)


def comfyui_lora(weights: dict[str, torch.Tensor], scale: float, layout) -> dict[str, torch.Tensor]:
    """diffusers-named LoRA weights -> a ComfyUI LoRA on the BFL layout.

    ComfyUI runs FLUX in BFL's layout, and its LoRA loader maps `diffusion_model.<module>` onto
    the model's `diffusion_model.<module>.weight` for any model (keys `.lora_A.weight` /
    `.lora_B.weight`, optional `.alpha`). A LoRA on the separate diffusers projections of a fused
    Linear is exactly one LoRA on the fused weight: with W_i += B_i A_i stacked along the output,
    W_fused += B A where A = the A_i stacked (rank k*r) and B = the B_i block-diagonal (a part
    without a LoRA contributes zero rows). alpha / rank is folded into B, so no alpha is written
    and ComfyUI applies scale 1 (what it does without an alpha)."""
    from dpipe.models.comfyui import to_comfyui

    return to_comfyui(weights, scale, layout[0], swapped=FINAL_MODULATION)


COMFYUI_PREFIX = "model.diffusion_model."


def layout_for(config: dict[str, Any]):
    """The layout table of a diffusers transformer config (FLUX.1 / Kontext or FLUX.2)."""
    return (flux2_layout if config.get("_class_name") == "Flux2Transformer2DModel"
            else flux1_layout)(config)


def save_bfl_file(transformer_dir: Path, file: Path, prefix: str = "",
                  dtype: torch.dtype | None = None) -> Path:
    """A diffusers transformer folder (sharded or not) as one BFL-layout safetensors file, each
    key after `prefix`, in `dtype` (None: as stored)."""
    import json

    from safetensors.torch import load_file, save_file

    config = json.loads((Path(transformer_dir) / "config.json").read_text())
    state = {}
    for shard in sorted(Path(transformer_dir).glob("*.safetensors")):
        state.update(load_file(shard))
    native = to_bfl(state, layout_for(config))
    save_file({prefix + k: (v if dtype is None else v.to(dtype)).contiguous()
               for k, v in native.items()}, file, metadata={"format": "pt"})
    return file


def source_format(file: Path) -> tuple[str, torch.dtype]:
    """(key prefix, dtype) of a single-file transformer: ComfyUI's prefix or none, and the dtype
    of its first weight; bf16 for a quantized file (its scales were fitted to the base weights,
    not the trained ones: the export is a plain bf16 file that loads where the source did)."""
    from safetensors import safe_open

    from dpipe.models.common.quantized_files import file_is_quantized

    with safe_open(file, "pt") as source:
        key = next(iter(source.keys()))
        dtype = source.get_slice(key)[:1].dtype
    if file_is_quantized(file):
        dtype = torch.bfloat16
    return (COMFYUI_PREFIX if key.startswith(COMFYUI_PREFIX) else ""), dtype


def save_like_source(transformer_dir: Path, source: Path, out_dir: Path) -> Path:
    """A trained FLUX transformer folder as `out_dir / source.name`, in BFL's layout with the
    source file's prefix and dtype (`source_format`), so the tools that loaded the source load
    the fine-tune the same way."""
    prefix, dtype = source_format(source)
    return save_bfl_file(transformer_dir, out_dir / source.name, prefix, dtype)
