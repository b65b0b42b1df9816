"""The denoiser made trainable and split into pipeline layers: the same on every rank.

A rank reads only its own stage's weights where it can (`reads_stage_only`): the denoiser is built
from its config with no weights, made trainable, split into layers and balanced into stages as
the engine balances them, and then the stage's weights are read from the folder's files one
tensor at a time, each in the dtype training keeps it in (bf16 for the frozen base of a bf16
LoRA). The host then holds this stage's weights as trained, not the whole denoiser in fp32.
"""

from __future__ import annotations

import torch

from dpipe.config.schema import Adapter, BaseCompute, Precision, RunConfig, TrainMode
from dpipe.models.stage_weights import DenoiserSkeleton
from dpipe.pipeline.attention import require_gpu_kernel, use_attention_kernel
from dpipe.pipeline.partition import stage_bounds
from dpipe.train.lora import frozen_dtype, make_trainable


def load_denoiser(spec, run: RunConfig, stage: int | None = None):
    """The denoiser in fp32, loaded under the run's seed: whatever its loading draws (some
    families' loading does) is the same on every rank. Given this rank's `stage`, where the run
    and the family let it read only that stage's weights (`reads_stage_only`), its
    `DenoiserSkeleton` instead: `trainable_layers` reads the weights."""
    if stage is not None and reads_stage_only(run):
        skeleton = spec.denoiser_skeleton()
        if skeleton is not None:
            return skeleton
    torch.manual_seed(run.train.seed)
    return spec.load_denoiser(torch.float32)


def reads_stage_only(run: RunConfig) -> bool:
    """Whether the run lets a rank read only its stage's weights: not where the whole base is
    needed before the adapters exist (adapters merged into it). A DoRA adapter's magnitudes,
    which start from the base weights' norms, are made again once the stage is read
    (`_read_stage_weights`). The family must also build its denoiser from files it reads
    tensor by tensor (`ModelSpec.denoiser_skeleton`)."""
    return not run.model.merge_adapters


def trainable_layers(spec, run: RunConfig, denoiser=None, stage: int | None = None) -> list:
    """The denoiser (`load_denoiser(spec, run, stage)` unless given), made trainable (LoRA or
    full), as pipeline layers; the same on every rank. From a `DenoiserSkeleton`, only `stage`'s
    weights are read; the other layers' weights are on the meta device, as the engine leaves
    them."""
    require_gpu_kernel(run.model.attention)
    if denoiser is None:
        denoiser = load_denoiser(spec, run, stage)
    skeleton = denoiser if isinstance(denoiser, DenoiserSkeleton) else None
    if skeleton is not None:
        denoiser = skeleton.model
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
    if skeleton is not None:
        _read_stage_weights(skeleton, spec, run, stage)
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


def _read_stage_weights(skeleton, spec, run: RunConfig, stage: int) -> None:
    """Reads the weights of `stage`'s layers, balanced as the engine balances them, in the dtype
    training keeps each in: the casts that follow (bf16 for a bf16 LoRA's frozen base or a bf16
    full fine-tune without master weights) then change nothing, and round as they would."""
    layers = spec.pipeline_layers(skeleton.model)
    p = run.pipeline
    bounds = stage_bounds(spec.layer_costs(layers), p.stages, p.partition, p.split)
    keep = {id(q) for layer in layers[bounds[stage]:bounds[stage + 1]] for q in layer.parameters()}
    bf16 = run.train.precision == Precision.bf16
    lora = run.model.mode == TrainMode.lora
    whole_bf16 = bf16 and not lora and not run.optim.master_weights
    # DoRA's magnitudes are the norms of the base as loaded whole (fp32): read so, cast after.
    dora = lora and run.model.adapter == Adapter.dora

    def dtype_of(param) -> torch.dtype:
        if (bf16 and lora and not param.requires_grad and not dora) or whole_bf16:
            return torch.bfloat16
        return param.dtype

    skeleton.load(keep, dtype_of)
    if dora and not run.model.lora.init_from:  # a file's magnitudes are the file's
        _dora_magnitudes(layers[bounds[stage]:bounds[stage + 1]])


def _dora_magnitudes(layers: list) -> None:
    """Each DoRA module's magnitudes made again, as peft made them when it wrapped the
    module (over a placeholder here): the norms of its base weight plus its adapter's delta.
    A base weight read as a placeholder beside a quantized file's stored form is its form's
    values meanwhile (the file's, as the whole load read them)."""
    for layer in layers:
        for module in layer.modules():
            for name, magnitude in getattr(module, "lora_magnitude_vector", {}).items():
                base = module.get_base_layer()
                form = base.__dict__.get("stored_form")
                placeholder = base.weight.data
                if form is not None and form.weight_elided:
                    base.weight.data = form.dequantized()
                magnitude.update_layer(base_layer=base, lora_A=module.lora_A[name].weight,
                                       lora_B=module.lora_B[name].weight,
                                       scaling=module.scaling[name])
                base.weight.data = placeholder
