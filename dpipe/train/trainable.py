"""The denoiser made trainable and split into pipeline layers: the same on every rank."""

from __future__ import annotations

import torch

from dpipe.config.schema import BaseDtype, Precision, RunConfig, TrainMode
from dpipe.train.lora import frozen_dtype, make_trainable


def trainable_layers(spec, run: RunConfig, denoiser=None) -> list:
    """The denoiser, made trainable (LoRA or full), as pipeline layers; the same on every rank."""
    torch.manual_seed(run.train.seed)  # LoRA init: identical on every rank and every stage count
    if denoiser is None:
        denoiser = spec.load_denoiser(torch.float32)
    make_trainable(denoiser, run.model, spec.lora_targets())
    bf16 = run.train.precision == Precision.bf16
    if bf16 and run.model.mode == TrainMode.lora:
        frozen_dtype(denoiser, torch.bfloat16)
    elif bf16 and not run.optim.master_weights:
        denoiser.to(torch.bfloat16)  # trained as is: no fp32 copy anywhere
    if run.model.base_dtype == BaseDtype.fp8 and run.model.mode == TrainMode.lora:
        from dpipe.train.fp8 import frozen_linears_to_fp8

        frozen_linears_to_fp8(denoiser)  # after LoRA wrapping: peft's base layers become fp8
    return spec.pipeline_layers(denoiser)
