"""A LoRA in diffusers' format, which every family writes.

A trained LoRA leaves the pipeline as peft's state dict of the denoiser. Each family writes it
through its pipeline's `save_lora_weights`, so that `pipeline.load_lora_weights` reads it, and then
in its ComfyUI (or kohya) form, whose names are the family's own (`dpipe.models.comfyui`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

DIFFUSERS_LORA = "pytorch_lora_weights.safetensors"  # the name save_lora_weights gives its file


def save_diffusers_lora(loader, weights: dict[str, torch.Tensor], metadata: dict[str, Any],
                        out_dir: Path, component: str = "transformer") -> Path:
    """Writes diffusers-named `weights` with their adapter `metadata` through `loader` (a pipeline
    class or its LoRA loader mixin) as the LoRA of `component`; returns the file."""
    loader.save_lora_weights(out_dir, **{f"{component}_lora_layers": weights,
                                         f"{component}_lora_adapter_metadata": metadata})
    return out_dir / DIFFUSERS_LORA


def lora_metadata(cfg, default_targets) -> dict[str, Any]:
    """peft's adapter config as diffusers stores it: rank, alpha (the rank when unset), targets."""
    rank = cfg.lora.rank
    return {
        "r": rank,
        "lora_alpha": cfg.lora.alpha if cfg.lora.alpha is not None else rank,
        "target_modules": cfg.lora.targets or default_targets,
    }


def lora_scale(metadata: dict[str, Any]) -> float:
    """alpha / rank: the factor peft applies to B @ A, which formats without an alpha fold into B."""
    return metadata["lora_alpha"] / metadata["r"]


def peft_to_diffusers(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """peft names carry the adapter name ("lora_A.default.weight"); diffusers' format does not."""
    return {k.replace(".default.", "."): v.contiguous() for k, v in state_dict.items()}
