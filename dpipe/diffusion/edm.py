"""EDM (Karras et al. 2022) noising, preconditioning and loss weighting, as Cosmos 1.0 trains.

dpipe samples t in [0, 1) for every family (`dpipe.diffusion.timesteps`). An EDM model trains on a
noise level sigma; here sigma = t / (1 - t), so logit(t) = log(sigma): the default logit-normal t
(train.timesteps.logit_mean / logit_std) is EDM's log-normal sigma with P_mean = logit_mean and
P_std = logit_std, clamped to [SIGMA_MIN, SIGMA_MAX].

The denoiser D(x; sigma) = c_skip x + c_out F(c_in x; c_noise), with
  c_skip = sd^2 / (sigma^2 + sd^2), c_out = sigma sd / sqrt(sigma^2 + sd^2),
  c_in = 1 / sqrt(sigma^2 + sd^2), c_noise = log(sigma) / 4
(sd: sigma_data; diffusers' EDMEulerScheduler, prediction_type "epsilon"). EDM's loss
lambda(sigma) |D - x0|^2 with lambda = (sigma^2 + sd^2) / (sigma sd)^2 = 1 / c_out^2 is exactly
|F - (x0 - c_skip x) / c_out|^2: the network's output F against that target, unweighted. So an
EDM family hands the trainer `noisy_input_and_target` and averages plain errors; its loss is
EDM's weighted loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SIGMA_MIN, SIGMA_MAX = 0.002, 80.0  # EDM's range; sigma_of_t clamps into it


def sigma_of_t(t: torch.Tensor) -> torch.Tensor:
    """t in [0, 1] -> sigma = t / (1 - t) in float64, clamped to [SIGMA_MIN, SIGMA_MAX]."""
    t = t.double()
    return (t / (1 - t)).clamp(SIGMA_MIN, SIGMA_MAX)


def t_of_sigma(sigma: torch.Tensor) -> torch.Tensor:
    """The inverse of `sigma_of_t` (float64): sigma / (1 + sigma)."""
    sigma = torch.as_tensor(sigma).double()
    return sigma / (1 + sigma)


@dataclass(frozen=True)
class Preconditioning:
    """EDM's scalings at sigma (any shape), float64."""

    sigma: torch.Tensor
    sigma_data: float

    @property
    def c_skip(self) -> torch.Tensor:
        return self.sigma_data ** 2 / (self.sigma ** 2 + self.sigma_data ** 2)

    @property
    def c_out(self) -> torch.Tensor:
        return self.sigma * self.sigma_data / (self.sigma ** 2 + self.sigma_data ** 2).sqrt()

    @property
    def c_in(self) -> torch.Tensor:
        return 1 / (self.sigma ** 2 + self.sigma_data ** 2).sqrt()

    @property
    def c_noise(self) -> torch.Tensor:
        return 0.25 * self.sigma.log()

    def loss_weight(self) -> torch.Tensor:
        """EDM's lambda(sigma) = (sigma^2 + sd^2) / (sigma sd)^2 on the denoised error."""
        return (self.sigma ** 2 + self.sigma_data ** 2) / (self.sigma * self.sigma_data) ** 2

    def denoised(self, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """D = c_skip x + c_out F."""
        return _b(self.c_skip, x) * x + _b(self.c_out, x) * output


def _b(c: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-sample scale (B,) broadcast over `like`'s other dimensions, in its dtype."""
    c = torch.as_tensor(c)
    return c.reshape(-1, *([1] * (like.ndim - 1))).to(like.dtype) if c.ndim else c.to(like.dtype)


def noisy_input_and_target(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor,
                           sigma_data: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(c_in x, (x0 - c_skip x) / c_out) at x = x0 + sigma noise, sigma of shape (B,): the
    network's input and the target of its output F (see the module docstring)."""
    p = Preconditioning(sigma.double(), sigma_data)
    x = x0.double() + _b(p.sigma, noise) * noise.double()
    target = (x0.double() - _b(p.c_skip, x) * x) / _b(p.c_out, x)
    return (_b(p.c_in, x) * x).to(x0.dtype), target.to(x0.dtype)
