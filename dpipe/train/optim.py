"""The optimizer of `optim.name`, built here and handed to DeepSpeed as its client optimizer
(DeepSpeed's own would JIT-compile ops).

Each pipeline stage builds one over its own parameters, so its state is sharded per stage like
the weights. Every optimizer here updates each tensor on its own; Prodigy's step-size estimate
`d` sums over the optimizer's tensors, so each stage keeps its own estimate.

The parameters split into groups by role, saved in each group (`dpipe_role`), so that
`apply_optim_config` can give every group its current hyperparameters after a resume: "decay"
(matrices; all parameters with `optim.weight_decay_1d`), "no_decay" (1-D: norm scales, biases),
and for Muon "muon" (matrices) and "adamw" (the rest, as Muon's authors train them). The
parameters of `optim.param_groups[i]` have their own groups, the role suffixed "@i".
"""

from __future__ import annotations

import contextlib
import re
from typing import Callable

import torch

from dpipe.config.schema import OptimConfig, OptimizerName
from dpipe.train.schedule import lr_lambda

ROLE = "dpipe_role"


def _roles(named: list[tuple[str, torch.nn.Parameter]], cfg: OptimConfig
           ) -> list[tuple[str, list]]:
    """(role, parameters) of each group: the user's groups (`optim.param_groups`, "@<index>"
    on the role) and the rest, each split by shape."""
    parts: dict[int | None, list] = {}
    for name, param in named:
        parts.setdefault(user_group(name, cfg), []).append(param)
    roles = []
    for index in [None, *range(len(cfg.param_groups))]:
        params = parts.get(index, [])
        suffix = "" if index is None else f"@{index}"
        matrices = [p for p in params if p.ndim >= 2]
        vectors = [p for p in params if p.ndim < 2]
        if cfg.name == OptimizerName.muon:
            split = [("muon", matrices), ("adamw", vectors)]
        elif cfg.weight_decay_1d:
            split = [("decay", params)]
        else:
            split = [("decay", matrices), ("no_decay", vectors)]
        roles += [(role + suffix, group) for role, group in split]
    return roles


def user_group(name: str, cfg: OptimConfig) -> int | None:
    """The index of the first `optim.param_groups` entry whose pattern is found in `name`."""
    return next((i for i, group in enumerate(cfg.param_groups) if re.search(group.match, name)),
                None)


def _user(cfg: OptimConfig, role: str):
    """(the role without its group, that group's ParamGroupConfig or None)."""
    base, _, index = role.partition("@")
    return base, (cfg.param_groups[int(index)] if index else None)


def base_lr(cfg: OptimConfig, role: str) -> float:
    base, group = _user(cfg, role)
    if group is not None and group.lr is not None:
        return group.lr
    return cfg.muon_adamw_lr if base == "adamw" else cfg.lr


def group_hyperparameters(cfg: OptimConfig, role: str) -> dict:
    """The `optim.*` values of one param group, except its learning rate (the schedule's). Keys
    an optimizer keeps as its own running state in the group (Prodigy's d, schedulefree's k and
    weight sums) are not among them."""
    role, group = _user(cfg, role)
    weight_decay = cfg.weight_decay if group is None or group.weight_decay is None \
        else group.weight_decay
    decay = weight_decay if role in ("decay", "muon") or cfg.weight_decay_1d else 0.0
    name = cfg.name
    if name == OptimizerName.muon:
        if role == "muon":
            return dict(use_muon=True, momentum=cfg.momentum, nesterov=cfg.nesterov,
                        ns_steps=cfg.ns_steps, weight_decay=decay)
        return dict(use_muon=False, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=decay)
    if name == OptimizerName.adafactor:
        return dict(beta2_decay=cfg.beta2_decay, d=cfg.clip_threshold, weight_decay=decay)
    if name == OptimizerName.came:
        return dict(betas=tuple(cfg.betas), weight_decay=decay)  # its clip_threshold: global
    common = dict(betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=decay)
    if name == OptimizerName.prodigy:
        return dict(common, d_coef=cfg.d_coef, safeguard_warmup=cfg.safeguard_warmup,
                    use_bias_correction=cfg.use_bias_correction)
    if name == OptimizerName.schedulefree_adamw:
        return dict(common, warmup_steps=cfg.warmup_steps, r=cfg.r,
                    weight_lr_power=cfg.weight_lr_power)
    return common  # adamw, adamw8bit


def param_groups(named: list[tuple[str, torch.nn.Parameter]], cfg: OptimConfig) -> list[dict]:
    return [{"params": group, ROLE: role, "lr": base_lr(cfg, role),
             **group_hyperparameters(cfg, role)}
            for role, group in _roles(named, cfg) if group]


def build_optimizer(named: list[tuple[str, torch.nn.Parameter]], cfg: OptimConfig
                    ) -> torch.optim.Optimizer:
    """The optimizer over this stage's trainable parameters, each named as the diffusers model
    names it (what `optim.param_groups` patterns match)."""
    params = [p for _, p in named]
    groups = param_groups(named, cfg)
    name = cfg.name
    if name == OptimizerName.adamw:
        on_gpu = bool(params) and params[0].is_cuda
        # fused: one kernel for all parameters on GPU; not available on CPU
        return torch.optim.AdamW(groups, fused=on_gpu)
    if name == OptimizerName.adamw8bit:
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(groups, min_8bit_size=cfg.min_8bit_size)
    if name == OptimizerName.adafactor:
        return torch.optim.Adafactor(groups)
    if name == OptimizerName.came:
        from pytorch_optimizer import CAME

        return CAME(groups, clip_threshold=cfg.clip_threshold)
    if name == OptimizerName.prodigy:
        from prodigyopt import Prodigy

        return Prodigy(groups, d0=cfg.d0)
    if name == OptimizerName.schedulefree_adamw:
        from schedulefree import AdamWScheduleFree

        optimizer = AdamWScheduleFree(groups)
        optimizer.train()  # it refuses to step in eval mode, which it starts in
        return optimizer
    if name == OptimizerName.muon:
        from pytorch_optimizer import Muon

        return Muon(groups)
    raise ValueError(f"unknown optimizer {name}")  # the schema's enum lists every name above


def lr_factor(cfg: OptimConfig, max_steps: int) -> Callable[[int], float]:
    """The schedule's factor on each group's learning rate. Schedule-free AdamW has none (the
    checks refuse another optim.schedule) and warms up inside the optimizer."""
    if cfg.name == OptimizerName.schedulefree_adamw:
        return _constant
    return lr_lambda(cfg, max_steps)


def _constant(step: int) -> float:
    return 1.0


def logged_scalars(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> dict[str, float]:
    """What an optimizer estimates itself, for TensorBoard and metrics.jsonl: Prodigy's step
    size d (of this rank's stage; the effective learning rate is d * lr)."""
    if cfg.name == OptimizerName.prodigy:
        return {"optim/prodigy_d": float(optimizer.param_groups[0]["d"])}
    return {}


@contextlib.contextmanager
def evaluation_weights(optimizer: torch.optim.Optimizer):
    """Puts schedule-free AdamW's averaged weights (x) into the model for evaluation, sampling
    and export, and its training weights (y) back afterwards, as schedulefree's docs ask.
    Checkpoints keep the training weights. y comes back from a copy (in host memory), not from
    schedulefree's inverse interpolation, whose rounding would make a run that sampled or
    exported at a checkpoint's step differ from its resume. Other optimizers train the weights
    they evaluate: nothing changes."""
    switches = "train_mode" in optimizer.param_groups[0] and hasattr(optimizer, "eval")
    if not switches or not optimizer.param_groups[0]["train_mode"]:
        yield
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    training = [p.detach().to("cpu", copy=True) for p in params]
    optimizer.eval()
    try:
        yield
    finally:
        optimizer.train()  # its mode flags; the weights are the copy's
        with torch.no_grad():
            for p, saved in zip(params, training):
                p.copy_(saved)
