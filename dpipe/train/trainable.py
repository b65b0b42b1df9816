"""The denoiser made trainable and split into pipeline layers: the same on every rank."""

from __future__ import annotations

import torch

from dpipe.config.schema import BaseCompute, Precision, RunConfig, TrainMode
from dpipe.pipeline.attention import require_gpu_kernel, use_attention_kernel
from dpipe.train.lora import frozen_dtype, make_trainable


def load_denoiser(spec, run: RunConfig):
    """The denoiser in fp32, loaded under the run's seed: whatever its loading draws (some
    families' loading does) is the same on every rank."""
    torch.manual_seed(run.train.seed)
    return spec.load_denoiser(torch.float32)


def trainable_layers(spec, run: RunConfig, denoiser=None) -> list:
    """The denoiser (`load_denoiser` unless given), made trainable (LoRA or full), as pipeline
    layers; the same on every rank."""
    require_gpu_kernel(run.model.attention)
    if denoiser is None:
        denoiser = load_denoiser(spec, run)
    if run.model.merge_adapters:  # into the fp32 base, before bf16 or fp8 round it
        from dpipe.train.adapter_init import merge_adapters

        merge_adapters(denoiser, run.model.merge_adapters, spec)
    # LoRA init: identical on every rank and every stage count, however the denoiser was made.
    torch.manual_seed(run.train.seed)
    make_trainable(denoiser, run.model, spec.lora_targets())
    if run.model.lora.init_from and run.model.mode == TrainMode.lora:
        from dpipe.train.adapter_init import init_adapter

        init_adapter(denoiser, run.model, spec)
    use_attention_kernel(denoiser, run.model)
    bf16 = run.train.precision == Precision.bf16
    if bf16 and run.model.mode == TrainMode.lora:
        frozen_dtype(denoiser, torch.bfloat16)
    elif bf16 and not run.optim.master_weights:
        denoiser.to(torch.bfloat16)  # trained as is: no fp32 copy anywhere
    if run.model.base_compute == BaseCompute.fp8 and run.model.mode == TrainMode.lora:
        from dpipe.train.fp8_compute import use_fp8_compute

        use_fp8_compute(denoiser)  # after LoRA wrapping, as below
    elif run.model.base_compute == BaseCompute.int8 and run.model.mode == TrainMode.lora:
        from dpipe.train.int8_compute import use_int8_compute

        use_int8_compute(denoiser)
    elif run.model.base_dtype.quantized and run.model.mode == TrainMode.lora:
        from dpipe.train.bnb_base import MAKE
        from dpipe.train.fp8 import STORAGE, quantize_frozen_linears

        # After LoRA wrapping: peft's base layers become quantized.
        storage = run.model.base_dtype.value
        if storage in MAKE:
            quantize_frozen_linears(denoiser, make=MAKE[storage])
        else:
            quantize_frozen_linears(denoiser, STORAGE[storage])
    elif run.model.mode == TrainMode.lora:
        from dpipe.train.stored_base import keep_stored_forms

        keep_stored_forms(denoiser)  # a quantized file's 8-bit Linears, where it has them
    return spec.pipeline_layers(denoiser)
