"""Timestep sampling for flow matching: t in (0, 1), t=1 is pure noise.

Each scheme draws from one random stream per sample (`dpipe.diffusion.noise.sample_generator`),
so a resumed run draws the same t. The resolution-dependent shift (`shift=auto`) follows the
flow-matching schedulers of diffusers: a mu linear in the image's token count, turned into the
shift exp(mu) (time_shift_type "exponential") or mu ("linear").
"""

from __future__ import annotations

import math

import torch

from dpipe.config.schema import TimestepConfig, TimestepSampling


def shift_timesteps(t: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3/Flux resolution shift: spends more steps at high noise when shift > 1."""
    if shift == 1.0:
        return t
    return shift * t / (1 + (shift - 1) * t)


def calculate_shift(image_tokens: int, base_tokens: int, max_tokens: int, base_shift: float,
                    max_shift: float) -> float:
    """mu, linear in the token count: base_shift at base_tokens, max_shift at max_tokens (the
    line FLUX's pipeline draws through its scheduler's config values, extrapolated beyond)."""
    slope = (max_shift - base_shift) / (max_tokens - base_tokens)
    return image_tokens * slope + base_shift - slope * base_tokens


def shift_of_mu(mu: float, time_shift_type: str = "exponential") -> float:
    """The shift whose `shift_timesteps` equals a dynamic-shifting scheduler's time shift at mu:
    exp(mu) / (exp(mu) + 1/t - 1) is shift_timesteps(t, exp(mu)); linear: mu / (mu + 1/t - 1)."""
    return math.exp(mu) if time_shift_type == "exponential" else float(mu)


def uniform_to_timesteps(cfg: TimestepConfig, u: torch.Tensor) -> torch.Tensor:
    """The unshifted t of each scheme that maps a uniform u (all but logit_normal); increasing in u
    (mode's map decreases, so it reads 1 - u: the same distribution), hence also its quantiles."""
    if cfg.sampling == TimestepSampling.mode:
        v = 1 - u  # diffusers: t = 1 - v - s (cos^2(pi v / 2) - 1 + v) for uniform v
        return 1 - v - cfg.mode_scale * (torch.cos(math.pi * v / 2) ** 2 - 1 + v)
    if cfg.sampling == TimestepSampling.cosmap:
        return 1 - 1 / (torch.tan(math.pi / 2 * u) + 1)
    return u


def sample_timesteps(cfg: TimestepConfig, n: int, generator: torch.Generator,
                     shift: float | None = None) -> torch.Tensor:
    """n timesteps from `generator`, shifted by `shift` (None: `cfg.shift`, a number)."""
    if cfg.sampling == TimestepSampling.logit_normal:
        t = torch.sigmoid(cfg.logit_mean + cfg.logit_std * torch.randn(n, generator=generator))
    elif cfg.sampling == TimestepSampling.mode:
        u = torch.rand(n, generator=generator)  # as diffusers draws it, u itself (not 1 - u)
        t = 1 - u - cfg.mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    else:  # uniform, cosmap
        t = uniform_to_timesteps(cfg, torch.rand(n, generator=generator))
    return shift_timesteps(t, cfg.fixed_shift if shift is None else shift)


def timestep_quantile(cfg: TimestepConfig, q: float) -> torch.Tensor:
    """The q-quantile of the unshifted training t (float64; the shift keeps quantiles, it is
    increasing)."""
    if cfg.sampling == TimestepSampling.logit_normal:  # sigmoid of a normal quantile
        z = math.sqrt(2.0) * torch.special.erfinv(torch.tensor(2 * q - 1, dtype=torch.float64))
        return torch.sigmoid(cfg.logit_mean + cfg.logit_std * z)
    return uniform_to_timesteps(cfg, torch.tensor(q, dtype=torch.float64))
