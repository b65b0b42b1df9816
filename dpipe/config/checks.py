"""Checks on the composed run config that the schemas alone cannot express.

`validate(cfg)` turns a composed DictConfig into a typed `RunConfig` or raises `ConfigError` with a
message naming the key and what to change. It runs before any worker process starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import warnings
from typing import Any, get_args, get_origin, get_type_hints

from omegaconf import DictConfig, OmegaConf

from dpipe.config.schema import (
    AttentionKernel,
    BaseCompute,
    BaseDtype,
    OptimizerName,
    PartitionMethod,
    Precision,
    RunConfig,
    TrainMode,
)
from dpipe.config.adapter_checks import check_adapter
from dpipe.config.logger_checks import check_loggers
from dpipe.config.optim_checks import check_optimizer
from dpipe.errors import ConfigError


def validate(cfg: DictConfig, world_size: int | None = None) -> RunConfig:
    """Type-check, resolve and cross-check a composed config.

    `world_size` is the number of processes the run will have (known inside a distributed
    environment); None when dpipe will start the processes itself.
    """
    plain = {k: v for k, v in cfg.items() if k != "hydra"} if isinstance(cfg, DictConfig) else cfg
    container = OmegaConf.create(plain)
    unknown = list(_unknown_keys(container, RunConfig, prefix=""))
    if unknown:
        raise ConfigError(
            "unknown config key(s): "
            + ", ".join(unknown)
            + ". Check the spelling against `dpipe-train --cfg job`; keys cannot be added with `+`."
        )
    try:
        typed = OmegaConf.merge(OmegaConf.structured(RunConfig), container)
        OmegaConf.resolve(typed)
        run: RunConfig = OmegaConf.to_object(typed)  # type: ignore[assignment]
    except Exception as err:  # omegaconf's messages name the full key
        raise ConfigError(f"invalid config: {err}") from None
    _check_cross_fields(run, world_size)
    return run


def _unknown_keys(node: Any, schema: type, prefix: str):
    hints = get_type_hints(schema)
    names = {f.name for f in dataclasses.fields(schema)}
    for key in node.keys():
        full = f"{prefix}{key}"
        if key not in names:
            yield f"'{full}' (valid keys of '{prefix.rstrip('.') or 'the run'}': {', '.join(sorted(names))})"
            continue
        child_type = _dataclass_of(hints[key])
        value = node._get_node(key)
        if child_type is not None and isinstance(value, DictConfig) and not value._is_missing():
            yield from _unknown_keys(value, child_type, prefix=f"{full}.")


def _dataclass_of(hint: Any) -> type | None:
    if dataclasses.is_dataclass(hint):
        return hint
    if get_origin(hint) is not None:  # Optional[X]
        for arg in get_args(hint):
            if dataclasses.is_dataclass(arg):
                return arg
    return None


def _check_ranges(run: RunConfig) -> None:
    """The range of each numeric key that `positive` (whole numbers >= 1) does not cover. NaN
    and infinity fail every range: a NaN compares false, so a plain `lr <= 0` lets it through
    to the first step. (DataSettings, eval and sample.* keys are checked where they are read.)"""
    t, m, o, d = run.train, run.model, run.optim, run.dataset
    lora_alpha = {} if m.lora.alpha is None else {"model.lora.alpha": m.lora.alpha}
    shift = {} if t.timesteps.auto_shift else {"train.timesteps.shift": _shift_number(t.timesteps)}
    above_zero = {"optim.lr": o.lr, "optim.eps": o.eps, **shift,
                  "train.timesteps.logit_std": t.timesteps.logit_std,
                  "train.huber_delta": t.huber_delta, "train.smooth_l1_beta": t.smooth_l1_beta,
                  **lora_alpha}
    at_least_zero = {"optim.weight_decay": o.weight_decay, "optim.warmup_steps": o.warmup_steps,
                     "optim.grad_clip": o.grad_clip, "model.min_snr_gamma": m.min_snr_gamma,
                     "train.checkpoint_every_minutes": t.checkpoint_every_minutes,
                     "train.audit_step": t.audit_step}
    in_unit_interval = {"model.lora.dropout": m.lora.dropout,  # [0, 1)
                        "train.ema.decay": t.ema.decay}
    whole_at_least_one = {"model.max_text_tokens": m.max_text_tokens,
                          "dataset.num_images": d.num_images,
                          "train.ema.every_steps": t.ema.every_steps}
    for key, value in above_zero.items():
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{key} must be a number > 0, got {value}")
    for key, value in at_least_zero.items():
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"{key} must be a number >= 0, got {value}")
    for key, value in in_unit_interval.items():
        if not 0 <= value < 1:
            raise ConfigError(f"{key} must be in [0, 1), got {value}")
    for key, value in whole_at_least_one.items():
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")
    if not math.isfinite(t.timesteps.logit_mean) or not math.isfinite(m.guidance):
        raise ConfigError(f"train.timesteps.logit_mean and model.guidance must be finite numbers, "
                          f"got {t.timesteps.logit_mean} and {m.guidance}")
    scale = t.timesteps.mode_scale
    if not -1.0 <= scale <= MODE_SCALE_MAX:  # beyond, mode sampling's map leaves (0, 1)
        raise ConfigError(f"train.timesteps.mode_scale must be in [-1, {MODE_SCALE_MAX:.4f}] "
                          f"(2/(pi-2)), got {scale}")
    if d.cache_workers is not None and d.cache_workers < 0:
        raise ConfigError(f"dataset.cache_workers must be >= 0 (0: decode in this process) or "
                          f"null (auto), got {d.cache_workers}")


def _check_prior_preservation(run: RunConfig) -> None:
    d = run.dataset
    on = [f"dataset.directories[path={e.path}]" for e in d.directories if e.prior_preservation]
    if d.prior_preservation:
        on.insert(0, "dataset")
    if on and run.model.mode != TrainMode.lora:
        raise ConfigError(
            f"{on[0]}.prior_preservation=true trains towards the base model's prediction with "
            "the adapters switched off, which a full fine-tune has not: use model.mode=lora, or "
            "drop prior_preservation (a directory's loss_weight, e.g. 0.5, weighs it down "
            "instead)")


def _check_ema(run: RunConfig) -> None:
    if run.sample.ema and not run.train.ema.decay:
        raise ConfigError(
            "sample.ema=true samples with the EMA of the trained weights, but this run keeps "
            "none (train.ema.decay=0): set train.ema.decay (e.g. 0.999) or drop sample.ema")
    if run.train.ema.decay and run.optim.name == OptimizerName.schedulefree_adamw:
        raise ConfigError(
            "train.ema.decay with optim=schedulefree_adamw: schedule-free AdamW already "
            "evaluates, samples and exports an average of its weights; set train.ema.decay=0, "
            "or use another optimizer (e.g. optim=adamw) for the EMA")


MODE_SCALE_MAX = 2 / (math.pi - 2)


def _shift_number(timesteps) -> float:
    """train.timesteps.shift as a number; a word other than auto is refused."""
    try:
        return float(timesteps.shift)
    except ValueError:
        raise ConfigError(f"train.timesteps.shift={timesteps.shift!r}: give a number > 0 (1: no "
                          "shift) or auto (the shift the model's sampler uses at each "
                          "resolution)") from None


def _check_cross_fields(run: RunConfig, world_size: int | None) -> None:
    p, t, m, o = run.pipeline, run.train, run.model, run.optim

    positive = {
        "pipeline.stages": p.stages,
        "pipeline.micro_batch_size": p.micro_batch_size,
        "pipeline.micro_batches": p.micro_batches,
        "train.max_steps": t.max_steps,
        "train.log_every": t.log_every,
        "model.lora.rank": m.lora.rank,
        "dataset.resolution": run.dataset.resolution,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")
    _check_ranges(run)
    check_optimizer(run)  # betas and each optimizer's own keys
    check_loggers(run)
    _check_ema(run)
    check_adapter(run)
    _check_prior_preservation(run)

    if p.data_parallel is not None and p.data_parallel < 1:
        raise ConfigError(f"pipeline.data_parallel must be >= 1 or null (auto), got {p.data_parallel}")
    if world_size is not None:
        if world_size % p.stages:
            raise ConfigError(
                f"pipeline.stages={p.stages} must divide the number of processes ({world_size}); "
                f"use a stage count that divides {world_size}"
            )
        if p.data_parallel is not None and p.data_parallel * p.stages != world_size:
            raise ConfigError(
                f"pipeline.stages x pipeline.data_parallel = {p.stages} x {p.data_parallel} "
                f"= {p.stages * p.data_parallel} processes, but this environment has {world_size}; "
                "set pipeline.data_parallel=null to derive it"
            )

    if p.zero_stage not in (0, 1):
        raise ConfigError(
            f"pipeline.zero_stage={p.zero_stage}: DeepSpeed pipelines support ZeRO stage 0 or 1 only"
        )
    if (t.precision == Precision.bf16 and m.mode == TrainMode.full and o.master_weights
            and p.zero_stage == 0):
        raise ConfigError(
            "train.precision=bf16 with model.mode=full needs pipeline.zero_stage=1 (DeepSpeed's "
            "bf16 optimizer cannot reload its checkpoints at ZeRO stage 0), or "
            "optim.master_weights=false"
        )
    if p.partition == PartitionMethod.explicit:
        split = p.split or []
        if len(split) != p.stages - 1:
            raise ConfigError(
                f"pipeline.partition=explicit needs pipeline.split with {p.stages - 1} layer "
                f"indices (where stages 2..{p.stages} start), got {p.split}"
            )
        if any(b <= a for a, b in zip([0, *split], split)):
            raise ConfigError(f"pipeline.split must be strictly increasing and > 0, got {split}")
    elif p.split is not None:
        raise ConfigError("pipeline.split is only used with pipeline.partition=explicit")
    ac = p.activation_checkpointing
    if ac not in ("none", "all", "auto", "offload") and not (ac.isdigit()):
        raise ConfigError(
            f"pipeline.activation_checkpointing={ac!r}: use none, all, auto, offload, or a "
            "number of blocks"
        )
    _check_blocks_to_swap(p, m)
    if t.loader_workers is not None and t.loader_workers < 0:
        raise ConfigError(f"train.loader_workers must be >= 0 (0: no worker processes) or null "
                          f"(auto), got {t.loader_workers}")
    _check_gguf_base(m)
    if m.base_dtype.quantized and m.mode == TrainMode.full:
        raise ConfigError(
            f"model.base_dtype={m.base_dtype.value} stores the frozen base weights quantized, but "
            "model.mode=full trains every weight (their updates would be lost to the rounding); "
            f"use model.mode=lora with {m.base_dtype.value}, or model.base_dtype=auto for a full "
            "fine-tune")
    _check_base_compute(m)
    if m.attention == AttentionKernel.flex and p.compile is False:  # null compiles on a GPU
        raise ConfigError(
            "model.attention=flex needs compiled layers: uncompiled, FlexAttention runs a "
            "reference implementation that builds every attention score in memory; drop "
            "pipeline.compile=false (on a GPU the layers compile by default), or use "
            "model.attention=sdpa")
    if p.memory_budget_gb is not None and not (math.isfinite(p.memory_budget_gb)
                                               and p.memory_budget_gb > 0):
        raise ConfigError("pipeline.memory_budget_gb must be > 0, or null for the device's memory")

    # With pipeline=auto and a machine to plan for, the stages composed are not those that run.
    if p.stages > 1 and p.micro_batches < p.stages and not (p.auto and p.machine is not None):
        warnings.warn(
            f"pipeline.micro_batches={p.micro_batches} < pipeline.stages={p.stages}: most of each "
            f"step is pipeline bubble; use micro_batches >= {2 * p.stages} for throughput",
            stacklevel=2,
        )
    if t.checkpoint_every_steps < 0 or t.checkpoint_every_minutes < 0 or t.keep_checkpoints < 1:
        raise ConfigError(
            "train.checkpoint_every_steps/minutes must be >= 0 and train.keep_checkpoints >= 1"
        )
    if t.export_every_steps < 0:
        raise ConfigError(f"train.export_every_steps must be >= 0 (0: export only at the end), "
                          f"got {t.export_every_steps}")
    if t.keep_exports < 0:
        raise ConfigError(f"train.keep_exports must be >= 0 (0: keep every step export), "
                          f"got {t.keep_exports}")


def unknown_key_message(full_key: str) -> str | None:
    """The message for an override of a key the run config does not have (Hydra's own would
    suggest `+key=`, which `validate` refuses): the closest valid keys, then all the keys of the
    level where the spelling went wrong. None for hydra.* (Hydra's own keys, its own message)."""
    parts = full_key.split(".")
    if parts[0] == "hydra":
        return None
    schema: type | None = RunConfig
    names = {f.name for f in dataclasses.fields(RunConfig)}
    for depth, part in enumerate(parts):
        if part not in names:  # the first part that is misspelt: list this level's keys
            group = ".".join(parts[:depth])
            near = difflib.get_close_matches(part, sorted(names), n=3, cutoff=0.6)
            hint = (f"did you mean {' or '.join(repr('.'.join([*parts[:depth], n])) for n in near)}? "
                    if near else "")
            return (f"unknown config key(s): '{full_key}': {hint}valid keys of "
                    f"{repr(group) if group else 'the run config'}: {', '.join(sorted(names))}. "
                    "Check the spelling against `dpipe-train --cfg job`; keys cannot be added "
                    "with `+`.")
        child = _dataclass_of(get_type_hints(schema)[part])
        if child is None:  # past the schema's dataclasses (a list's items): no key list to give
            break
        schema, names = child, {f.name for f in dataclasses.fields(child)}
    return (f"unknown config key(s): '{full_key}'. Check the spelling against `dpipe-train "
            "--cfg job`; keys cannot be added with `+`.")


# model.base_compute -> the weights it multiplies (the storage of model.base_dtype of that name).
_COMPUTE_WEIGHTS = {BaseCompute.fp8: "float8_e4m3fn", BaseCompute.int8: "int8"}


def _check_base_compute(m) -> None:
    """8-bit matmuls multiply the frozen base of an adapter, stored as the model.base_dtype of
    the same name stores it (which model.base_dtype=auto implies)."""
    if m.base_compute == BaseCompute.auto:
        return
    compute = m.base_compute.value
    if m.mode == TrainMode.full:
        raise ConfigError(
            f"model.base_compute={compute} multiplies the frozen base weights of a LoRA in "
            f"{compute}, but model.mode=full trains every weight: use model.mode=lora with it, "
            "or drop model.base_compute for a full fine-tune")
    if m.base_dtype not in (BaseDtype.auto, BaseDtype(compute)):
        raise ConfigError(
            f"model.base_compute={compute} multiplies {_COMPUTE_WEIGHTS[m.base_compute]} weights,"
            f" but model.base_dtype={m.base_dtype.value} asks for another storage: drop "
            f"model.base_dtype ({compute} compute stores the weights as "
            f"model.base_dtype={compute} does), or drop model.base_compute")


def _check_gguf_base(m) -> None:
    """A GGUF transformer stays quantized as its file stores it (dpipe.models.common.gguf_files):
    only a LoRA trains on it, and nothing else may set or change its base weights."""
    if not str(m.path).endswith(".gguf"):
        return
    if m.mode == TrainMode.full:
        raise ConfigError(
            f"model.path={m.path} is a GGUF file, whose base weights stay in its quantized blocks,"
            " but model.mode=full trains every weight (their updates would be lost to the "
            "blocks' rounding): use model.mode=lora with it, or a bf16 single file or diffusers "
            "folder for a full fine-tune")
    if m.base_dtype.quantized or m.base_compute != BaseCompute.auto:
        raise ConfigError(
            f"model.path={m.path} is a GGUF file: its quantized blocks are the base's storage and "
            "each matmul dequantizes them; drop model.base_dtype and model.base_compute")
    if m.merge_adapters:
        raise ConfigError(
            f"model.merge_adapters merges adapters into the base weights, but model.path={m.path}"
            " is a GGUF file whose weights stay quantized: merge into a bf16 file first, or "
            "train without model.merge_adapters")


def _check_blocks_to_swap(p, m) -> None:
    """`pipeline.blocks_to_swap`: a count >= 0 or auto (with auto checkpointing), adapters only.
    Whether each stage has that many layers is checked once the model is built
    (dpipe.pipeline.engine)."""
    swap = str(p.blocks_to_swap)
    if swap != "auto" and not swap.isdigit():
        raise ConfigError(f"pipeline.blocks_to_swap={swap!r}: use a number of layers per stage "
                          "(0: none) or auto")
    if swap == "auto" and p.activation_checkpointing != "auto":
        raise ConfigError(
            "pipeline.blocks_to_swap=auto lets the memory plan choose between swapping and "
            "recomputing each layer: it needs pipeline.activation_checkpointing=auto "
            f"(got {p.activation_checkpointing!r}); or give blocks_to_swap a number")
    if swap != "0" and m.mode == TrainMode.full:
        raise ConfigError(
            f"pipeline.blocks_to_swap={swap} swaps frozen weights, but model.mode=full trains "
            "every weight: there is nothing frozen to swap (moving trained weights would move "
            "their gradients and optimizer state too, which dpipe does not do). Use "
            "pipeline.blocks_to_swap=0 with pipeline.activation_checkpointing=offload or auto, "
            "or more pipeline.stages")
