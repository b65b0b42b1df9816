"""Makes a denoiser trainable: LoRA adapters via peft, or every weight for a full fine-tune."""

from __future__ import annotations

import torch
from torch import nn

from dpipe.config.schema import ModelConfig, TrainMode
from dpipe.errors import ConfigError


def make_trainable(denoiser: nn.Module, cfg: ModelConfig, default_targets) -> None:
    """A full fine-tune trains every weight; model.mode=lora freezes them and adds the adapter
    of `model.adapter` (peft) on the targets, in fp32."""
    if cfg.mode == TrainMode.full:
        denoiser.requires_grad_(True)
        return
    from peft import inject_adapter_in_model

    from dpipe.models.adapters import adapter_metadata, is_adapter_param, peft_config

    denoiser.requires_grad_(False)
    config = peft_config(cfg.adapter, adapter_metadata(cfg, default_targets), cfg.lora.dropout)
    try:
        inject_adapter_in_model(config, denoiser, adapter_name="default")
    except ValueError as err:  # peft: "Target modules ... not found in the base model"
        raise ConfigError(f"model.lora.targets: {err}") from None
    for name, param in denoiser.named_parameters():
        if is_adapter_param(name):
            # Adapters train in fp32 even over bf16 base weights: their updates are tiny.
            param.data = param.data.float()
            param.requires_grad_(True)


def count_parameters(module: nn.Module) -> tuple[int, int]:
    params = list(module.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    return trainable, sum(p.numel() for p in params)


def frozen_dtype(module: nn.Module, dtype: torch.dtype) -> None:
    """Casts frozen weights (the base model under LoRA) to `dtype` to halve their memory. Integer
    ones are a quantized file's bytes (a GGUF base's blocks): a cast would turn them into
    numbers they do not mean."""
    for param in module.parameters():
        if not param.requires_grad and param.is_floating_point():
            param.data = param.data.to(dtype)
