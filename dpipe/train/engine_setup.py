"""The trainer's pipeline engine: the engine of dpipe.pipeline.engine with the optimizer, lr
schedule and gradient clipping that the run's `optim.*` asks for, and those settings made current
again after a resume."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dpipe.config.schema import RunConfig
from dpipe.errors import ConfigError
from dpipe.models.spec import ModelSpec
from dpipe.pipeline.engine import BuiltEngine, build_engine, deepspeed_wraps_optimizer
from dpipe.train.grad_clip import install_clipping
from dpipe.train.optim import (ROLE, base_lr, build_optimizer, group_hyperparameters, lr_factor,
                               user_group)


def build_training_engine(layers: list[nn.Module], spec: ModelSpec, run: RunConfig,
                          data_parallel: int) -> BuiltEngine:
    """This rank's stage of `layers`, with its optimizer and schedule, and dpipe's clipping
    where DeepSpeed does not clip (it does when it wraps the optimizer: bf16 master weights,
    ZeRO)."""
    built_optimizer = []

    def optimizer_for(named):
        _check_param_groups(named, run)
        optimizer = build_optimizer(named, run.optim)
        built_optimizer.append(optimizer)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_factor(run.optim, run.train.max_steps))

    built = build_engine(layers, spec.layer_costs(layers), spec.loss, run, data_parallel,
                         optimizer_for)
    if not deepspeed_wraps_optimizer(run):
        install_clipping(built_optimizer[0], run.optim.grad_clip,
                         built.engine.grid.get_pipe_parallel_group())
    return built


def _check_param_groups(named: list, run: RunConfig) -> None:
    """Every `optim.param_groups` pattern must take some parameter on some stage (a collective):
    one that takes none is a misspelt name, which would train at the default rate unnoticed."""
    groups = run.optim.param_groups
    if not groups:
        return
    mine = [0] * len(groups)
    for name, _ in named:
        index = user_group(name, run.optim)
        if index is not None:
            mine[index] += 1
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    for i, group in enumerate(groups):
        if not any(counts[i] for counts in every):
            examples = ", ".join(name for name, _ in named[:3])
            raise ConfigError(
                f"optim.param_groups[{i}].match={group.match!r} is found in no trainable "
                f"parameter's name (they look like: {examples}); fix the pattern (a Python "
                "regular expression, searched in each name)")


def apply_optim_config(engine, run: RunConfig) -> None:
    """Makes a loaded checkpoint's optimizer follow the current `optim.*` from the next step on.

    Loading restores each param group's lr and hyperparameters (betas, eps, weight decay and
    each optimizer's own), the schedule's base lrs and (in DeepSpeed's bf16 and ZeRO optimizers)
    the clipping norm as they were saved, so a resume with a changed `optim.lr` would log the
    change and train on the old value. The schedule's position (`last_epoch`), the optimizer's
    moments and its running estimates (Prodigy's d) stay the checkpoint's. The schedule
    function itself is not saved (torch stores functions as None): it is already the current one.
    """
    scheduler = engine.lr_scheduler
    # Ours: DeepSpeed's wrappers forward their param_groups to it.
    groups = scheduler.optimizer.param_groups
    factor = lr_factor(run.optim, run.train.max_steps)
    # Each group's role (dpipe.train.optim) was saved with it; "decay" in older checkpoints.
    roles = [group.get(ROLE, "decay") for group in groups]
    scheduler.base_lrs = [base_lr(run.optim, role) for role in roles]
    scheduler.lr_lambdas = [factor] * len(groups)
    for group, role, lr in zip(groups, roles, scheduler.base_lrs):
        group.update(initial_lr=lr, lr=lr * factor(scheduler.last_epoch),
                     **group_hyperparameters(run.optim, role))
    scheduler._last_lr = [group["lr"] for group in groups]
    if deepspeed_wraps_optimizer(run):
        engine.optimizer.clip_grad = run.optim.grad_clip
    # Otherwise dpipe's own clipping (install_clipping) was installed with the current norm.
