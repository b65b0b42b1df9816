"""Anima's weights under the original names, as its single files and ComfyUI hold them.

Anima's single file (circlestone-labs/Anima, `split_files/diffusion_models/`) is a
Cosmos-Predict2 transformer under NVIDIA's names (`blocks.0.self_attn.q_proj.weight`, ...) plus
the text adapter under `llm_adapter.` with diffusers' own names inside it
(`llm_adapter.blocks.0.cross_attn.k_proj.weight`), with `net.` in front (ComfyUI also takes them
without). The transformer's names are Cosmos-Predict2's (`dpipe.models.common.cosmos_names`);
the adapter's only take the prefix.

ComfyUI's LoRA for Anima: `diffusion_model.<original module>.lora_A.weight` / `.lora_B.weight`,
the adapter's modules as `diffusion_model.llm_adapter.<module>`; diffusers'
`AnimaLoraLoaderMixin` reads the same names (`_convert_non_diffusers_anima_lora_to_diffusers`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dpipe.errors import ModelLoadError
from dpipe.models.anima.model import ADAPTER_PREFIX
from dpipe.models.comfyui import in_original_names
from dpipe.models.common.cosmos_names import file_state_dict, original_module_name

_FILE_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "net.")
COSMOS_KEY = "blocks.0.self_attn.q_proj.weight"  # NVIDIA's first block, in every Cosmos file


def _unprefixed(key: str) -> str:
    for prefix in _FILE_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def from_original(state: dict[str, torch.Tensor], file: Path) -> dict[str, torch.Tensor]:
    """An Anima single file's tensors -> AnimaDenoiser's names (`transformer.`,
    `text_conditioner.`), by diffusers' Cosmos converter for the transformer (which drops
    NVIDIA's training buffers). A file without the adapter (a plain Cosmos-Predict2 transformer)
    or of another model is refused, naming what it holds."""
    from diffusers.loaders.single_file_utils import (
        convert_cosmos_transformer_checkpoint_to_diffusers)

    state = {_unprefixed(k): v for k, v in state.items()}
    adapter = {k.removeprefix(ADAPTER_PREFIX): v for k, v in state.items()
               if k.startswith(ADAPTER_PREFIX)}
    rest = {k: v for k, v in state.items() if not k.startswith(ADAPTER_PREFIX)}
    if COSMOS_KEY not in rest:
        raise ModelLoadError(
            f"{file} is not an Anima single file: it has no Cosmos transformer blocks "
            f"({COSMOS_KEY}); its keys look like {sorted(state)[:3]}. Give the file of "
            "circlestone-labs/Anima's split_files/diffusion_models/")
    if not adapter:
        raise ModelLoadError(
            f"{file} holds a Cosmos-Predict2 transformer without Anima's text adapter "
            f"({ADAPTER_PREFIX}*): it looks like a plain Cosmos-Predict2 checkpoint. Train it "
            "with model=cosmos_predict2, or give Anima's file (which holds llm_adapter.*)")
    try:
        transformer = convert_cosmos_transformer_checkpoint_to_diffusers(rest)
    except (KeyError, RuntimeError, ValueError) as err:
        raise ModelLoadError(f"{file}: its Cosmos transformer names do not convert ({err!r})") \
            from None
    return {**{f"transformer.{k}": v for k, v in transformer.items()},
            **{f"text_conditioner.{k}": v for k, v in adapter.items()}}


def original_state_dict(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """AnimaDenoiser's (or its export's) diffusers-named weights -> the single file's names,
    without prefix. Raises KeyError for a weight it has no name for."""
    transformer, out = {}, {}
    for key, value in weights.items():
        component, _, name = key.partition(".")
        if component == "transformer":
            transformer[name] = value
        elif component == "text_conditioner":
            out[ADAPTER_PREFIX + name] = value
        else:
            raise KeyError(f"no Anima single-file name for {key!r}")
    return {**file_state_dict(transformer), **out}


def module_name(diffusers_module: str) -> str:
    """The original name of a Linear of AnimaDenoiser (KeyError outside the map)."""
    component, _, name = diffusers_module.partition(".")
    if component == "text_conditioner":
        return ADAPTER_PREFIX + name
    if component == "transformer":
        return original_module_name(name)
    raise KeyError(f"no Anima name for module {diffusers_module!r}")


def lora_to_comfyui(weights: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """ComfyUI LoRA weights from AnimaDenoiser's diffusers-named ones, under Anima's names."""
    return in_original_names(weights, scale, module_name, "ComfyUI (Anima)")
