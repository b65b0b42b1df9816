"""Timestep sampling for flow matching: t in (0, 1), t=1 is pure noise."""

from __future__ import annotations

import torch

from dpipe.config.schema import TimestepConfig, TimestepSampling


def shift_timesteps(t: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3/Flux resolution shift: spends more steps at high noise when shift > 1."""
    if shift == 1.0:
        return t
    return shift * t / (1 + (shift - 1) * t)


def sample_timesteps(cfg: TimestepConfig, n: int, generator: torch.Generator) -> torch.Tensor:
    if cfg.sampling == TimestepSampling.uniform:
        t = torch.rand(n, generator=generator)
    elif cfg.sampling == TimestepSampling.logit_normal:
        t = torch.sigmoid(cfg.logit_mean + cfg.logit_std * torch.randn(n, generator=generator))
    else:  # pragma: no cover - the schema's enum makes this unreachable
        raise ValueError(cfg.sampling)
    return shift_timesteps(t, cfg.shift)
