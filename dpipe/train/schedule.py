"""Learning-rate schedules as multipliers of `optim.lr` per optimizer step."""

from __future__ import annotations

import math
from typing import Callable

from dpipe.config.schema import LrSchedule, OptimConfig


def lr_lambda(cfg: OptimConfig, max_steps: int) -> Callable[[int], float]:
    warmup = cfg.warmup_steps

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if cfg.schedule == LrSchedule.constant:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
        if cfg.schedule == LrSchedule.linear:
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor
