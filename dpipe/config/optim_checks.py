"""Checks on `optim.*` for the chosen optimizer, before any worker starts (dpipe.train.optim
builds them)."""

from __future__ import annotations

import math
import re

from dpipe.config.schema import OptimizerName, Precision, RunConfig, TrainMode
from dpipe.errors import ConfigError

# These update a tensor by its shape (factored moments, orthogonalized matrices) or swap the
# model's weights: DeepSpeed's bf16 and ZeRO optimizers hand them flat fp32 copies instead.
_NEED_THE_MODEL_TENSORS = (OptimizerName.adafactor, OptimizerName.came, OptimizerName.muon,
                           OptimizerName.schedulefree_adamw)
_PACKAGE = {OptimizerName.adamw8bit: "bitsandbytes", OptimizerName.came: "pytorch-optimizer",
            OptimizerName.muon: "pytorch-optimizer", OptimizerName.prodigy: "prodigyopt",
            OptimizerName.schedulefree_adamw: "schedulefree"}


def check_optimizer(run: RunConfig) -> None:
    o, p, t, m = run.optim, run.pipeline, run.train, run.model
    name = o.name.value
    want = 3 if o.name == OptimizerName.came else 2
    if len(o.betas) != want or not all(0 <= b < 1 for b in o.betas):
        raise ConfigError(f"optim.betas must be {want} numbers in [0, 1) for optim={name}, "
                          f"got {o.betas}")
    positive = {"optim.muon_adamw_lr": o.muon_adamw_lr, "optim.clip_threshold": o.clip_threshold,
                "optim.d0": o.d0, "optim.d_coef": o.d_coef, "optim.ns_steps": o.ns_steps}
    for key, value in positive.items():
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{key} must be a number > 0, got {value}")
    if not 0 <= o.momentum < 1:
        raise ConfigError(f"optim.momentum must be in [0, 1), got {o.momentum}")
    if o.min_8bit_size < 1:
        raise ConfigError(f"optim.min_8bit_size must be >= 1, got {o.min_8bit_size}")
    if o.name == OptimizerName.schedulefree_adamw and o.schedule.value != "constant":
        raise ConfigError(f"optim=schedulefree_adamw replaces the learning-rate schedule: drop "
                          f"optim.schedule={o.schedule.value} (its warm-up is optim.warmup_steps)")
    # The same condition as dpipe.pipeline.engine._deepspeed_wraps_optimizer (imports torch).
    bf16_master = (t.precision == Precision.bf16 and m.mode == TrainMode.full
                   and o.master_weights)
    if o.name in _NEED_THE_MODEL_TENSORS and (bf16_master or p.zero_stage > 0):
        raise ConfigError(
            f"optim={name} needs the model's own tensors, but "
            + ("DeepSpeed's bf16 master-weights optimizer" if bf16_master else
               f"pipeline.zero_stage={p.zero_stage}")
            + " hands it flat fp32 copies: use optim.master_weights=false (bf16 weights and "
            "states) with pipeline.zero_stage=0, or optim=adamw / adamw8bit / prodigy")
    for i, group in enumerate(o.param_groups):
        key = f"optim.param_groups[{i}]"
        try:
            re.compile(group.match)
        except re.error as error:
            raise ConfigError(f"{key}.match={group.match!r} is not a regular expression "
                              f"({error})") from None
        if group.lr is not None and not (math.isfinite(group.lr) and group.lr > 0):
            raise ConfigError(f"{key}.lr must be a number > 0 (or null: optim.lr), got {group.lr}")
        if group.weight_decay is not None and not (math.isfinite(group.weight_decay)
                                                   and group.weight_decay >= 0):
            raise ConfigError(f"{key}.weight_decay must be a number >= 0 (or null), got "
                              f"{group.weight_decay}")
    package = _PACKAGE.get(o.name)
    if package is not None:
        import importlib.util

        module = package.replace("-", "_")
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"optim={name} needs the {package} package: "
                              f"pip install {package} (or run `make setup` again)")
