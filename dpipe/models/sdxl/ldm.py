"""SDXL's original (SGM / "LDM") names, the ones of single-file checkpoints and kohya LoRAs.

SDXL is shared as one `.safetensors` file laid out as Stability's `sgm` code names its modules
(`model.diffusion_model.input_blocks.4.1...`, `first_stage_model...`, `conditioner.embedders...`);
kohya's sd-scripts, ComfyUI and A1111/Forge name SDXL LoRA weights after the same UNet modules
(`lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q`). diffusers reads both (its
`from_single_file` and `load_lora_weights` convert them); this module writes them, from diffusers
names, for any UNet2DConditionModel config in SDXL's layout (so the tiny model's too).
"""

from __future__ import annotations

import re
from typing import Any

import torch

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
CLIP_L_PREFIX = "conditioner.embedders.0.transformer."
CLIP_G_PREFIX = "conditioner.embedders.1.model."

_UNET_TOP = {
    "time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
    "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2",
    "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2",
}
_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "norm2": "out_layers.0",
           "conv2": "out_layers.3", "time_emb_proj": "emb_layers.1",
           "conv_shortcut": "skip_connection"}


def unet_module_to_sgm(name: str, config: dict[str, Any]) -> str:
    """A diffusers UNet2DConditionModel module path -> the SGM UNet's path for the same module
    (`down_blocks.1.attentions.0.proj_in` -> `input_blocks.4.1.proj_in`)."""
    per_down = int(config["layers_per_block"]) + 1  # resnets (+attentions) and the downsampler
    for ours, theirs in _UNET_TOP.items():
        if name == ours or name.startswith(ours + "."):
            return theirs + name[len(ours):]
    m = re.fullmatch(r"down_blocks\.(\d+)\.(resnets|attentions|downsamplers)\.(\d+)(\..+)?", name)
    if m:
        block, kind, index, rest = int(m[1]), m[2], int(m[3]), m[4] or ""
        if kind == "downsamplers":
            return f"input_blocks.{(block + 1) * per_down}.0" + rest.replace(".conv", ".op", 1)
        prefix = f"input_blocks.{block * per_down + index + 1}"
        return f"{prefix}.0{_resnet_rest(rest)}" if kind == "resnets" else f"{prefix}.1{rest}"
    m = re.fullmatch(r"mid_block\.(resnets|attentions)\.(\d+)(\..+)?", name)
    if m:
        kind, index, rest = m[1], int(m[2]), m[3] or ""
        if kind == "resnets":
            return f"middle_block.{2 * index}{_resnet_rest(rest)}"
        return f"middle_block.{2 * index + 1}{rest}"
    m = re.fullmatch(r"up_blocks\.(\d+)\.(resnets|attentions|upsamplers)\.(\d+)(\..+)?", name)
    if m:
        block, kind, index, rest = int(m[1]), m[2], int(m[3]), m[4] or ""
        if kind == "upsamplers":
            has_attention = "CrossAttn" in config["up_block_types"][block]
            last = block * per_down + per_down - 1
            return f"output_blocks.{last}.{2 if has_attention else 1}{rest}"
        prefix = f"output_blocks.{block * per_down + index}"
        return f"{prefix}.0{_resnet_rest(rest)}" if kind == "resnets" else f"{prefix}.1{rest}"
    raise ValueError(f"no SGM name for the UNet module {name!r}")


def _resnet_rest(rest: str) -> str:
    head, _, tail = rest.lstrip(".").partition(".")
    return f".{_RESNET.get(head, head)}" + (f".{tail}" if tail else "") if rest else ""


def unet_to_sgm(state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state_dict.items():
        module, _, param = key.rpartition(".")
        out[f"{UNET_PREFIX}{unet_module_to_sgm(module, config)}.{param}"] = value
    return out


def vae_to_ldm(state_dict: dict[str, torch.Tensor], num_blocks: int) -> dict[str, torch.Tensor]:
    """diffusers AutoencoderKL -> the LDM autoencoder's names (attention projections as 1x1 convs)."""
    out = {}
    attn = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
    for key, value in state_dict.items():
        k = key.replace("conv_shortcut", "nin_shortcut").replace("conv_norm_out", "norm_out")
        k = re.sub(r"encoder\.down_blocks\.(\d+)\.resnets\.", r"encoder.down.\1.block.", k)
        k = re.sub(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample.", k)
        k = re.sub(r"decoder\.up_blocks\.(\d+)\.resnets\.",
                   lambda m: f"decoder.up.{num_blocks - 1 - int(m[1])}.block.", k)
        k = re.sub(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.",
                   lambda m: f"decoder.up.{num_blocks - 1 - int(m[1])}.upsample.", k)
        k = re.sub(r"mid_block\.resnets\.(\d+)\.", lambda m: f"mid.block_{int(m[1]) + 1}.", k)
        m = re.fullmatch(r"(encoder|decoder)\.mid_block\.attentions\.0\.(.+)\.(weight|bias)", k)
        if m:
            k = f"{m[1]}.mid.attn_1.{attn[m[2]]}.{m[3]}"
            if m[2] != "group_norm" and m[3] == "weight":
                value = value[:, :, None, None]  # LDM's attention projections are 1x1 convs
        out[VAE_PREFIX + k] = value
    return out


def with_text_model_prefix(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's CLIP text models drop the `text_model.` level that every published CLIP
    checkpoint (and transformers 4) has; put it back."""
    return {k if k.startswith(("text_model.", "text_projection")) else f"text_model.{k}": v
            for k, v in state_dict.items() if "position_ids" not in k}


def clip_l_to_sgm(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CLIP-L keeps transformers' names in SGM checkpoints, under the first embedder."""
    return {CLIP_L_PREFIX + k: v for k, v in with_text_model_prefix(state_dict).items()}


def clip_g_to_open_clip(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' CLIPTextModelWithProjection -> OpenCLIP's text tower (fused qkv, transposed
    projection), as SDXL checkpoints hold OpenCLIP ViT-bigG under the second embedder."""
    out = {}
    state_dict = with_text_model_prefix(state_dict)
    top = {"text_model.embeddings.token_embedding.weight": "token_embedding.weight",
           "text_model.embeddings.position_embedding.weight": "positional_embedding",
           "text_model.final_layer_norm.weight": "ln_final.weight",
           "text_model.final_layer_norm.bias": "ln_final.bias"}
    layer = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp.fc1": "mlp.c_fc",
             "mlp.fc2": "mlp.c_proj", "self_attn.out_proj": "attn.out_proj"}
    for key, value in state_dict.items():
        if key in top:
            out[top[key]] = value
        elif key == "text_projection.weight":
            out["text_projection"] = value.T.contiguous()
        m = re.fullmatch(r"text_model\.encoder\.layers\.(\d+)\.(.+)\.(weight|bias)", key)
        if not m:
            continue
        i, module, param = m[1], m[2], m[3]
        if module in layer:
            out[f"transformer.resblocks.{i}.{layer[module]}.{param}"] = value
        elif module == "self_attn.q_proj":
            qkv = [state_dict[f"text_model.encoder.layers.{i}.self_attn.{p}_proj.{param}"]
                   for p in "qkv"]
            out[f"transformer.resblocks.{i}.attn.in_proj_{param}"] = torch.cat(qkv, 0)
    return {CLIP_G_PREFIX + k: v for k, v in out.items()}


def unet_from_single_file(state: dict[str, torch.Tensor], unet) -> dict[str, torch.Tensor]:
    """The UNet's weights under diffusers' names from a checkpoint's tensors `state`, by the
    converter diffusers' `from_single_file` runs (`convert_ldm_unet_checkpoint`), for `unet`'s
    config. `state` comes without the UNet's prefix (`single_file.converter_name` strips it):
    every key gets it back, as that converter picks the UNet's tensors by it and reads them by
    name (the VAE's and text encoders' keys, prefixed so too, are never read)."""
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    return convert_ldm_unet_checkpoint({UNET_PREFIX + k: v for k, v in state.items()},
                                       dict(unet.config))


def single_file_state_dict(unet, vae, text_encoder, text_encoder_2) -> dict[str, torch.Tensor]:
    """The four models in the layout of `sd_xl_base_1.0.safetensors`."""
    sd = unet_to_sgm(unet.state_dict(), dict(unet.config))
    sd.update(vae_to_ldm(vae.state_dict(), len(vae.config.block_out_channels)))
    sd.update(clip_l_to_sgm(text_encoder.state_dict()))
    sd.update(clip_g_to_open_clip(text_encoder_2.state_dict()))
    return {k: v.contiguous() for k, v in sd.items()}


def kohya_lora(weights: dict[str, torch.Tensor], config: dict[str, Any],
               alpha: float) -> dict[str, torch.Tensor]:
    """LoRA weights under diffusers UNet names (`<module>.lora_A.weight`) -> kohya's SDXL keys
    (`lora_unet_<SGM module with _>.lora_down.weight`, `.lora_up.weight`, `.alpha`), the format
    sd-scripts writes and ComfyUI, A1111/Forge and diffusers load."""
    out = {}
    for key, value in weights.items():
        module, kind = re.fullmatch(r"(.+)\.lora_([AB])\.weight", key).groups()
        name = "lora_unet_" + unet_module_to_sgm(module, config).replace(".", "_")
        out[f"{name}.lora_{'down' if kind == 'A' else 'up'}.weight"] = value.contiguous()
        out[f"{name}.alpha"] = torch.tensor(float(alpha))
    return out
