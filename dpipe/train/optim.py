"""The optimizer, built here and handed to DeepSpeed (DeepSpeed's own would JIT-compile ops)."""

from __future__ import annotations

import torch

from dpipe.config.schema import OptimConfig


def build_optimizer(params: list[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    on_gpu = bool(params) and params[0].is_cuda
    return torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=on_gpu,  # one kernel for all parameters on GPU; not available on CPU
    )
