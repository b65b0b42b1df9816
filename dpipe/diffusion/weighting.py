"""Per-sample loss weights from the noise level (`train.timesteps.weighting`).

The schemes of diffusers' `compute_loss_weighting_for_sd3`, on the sigma (= t) each sample is
noised at. The trainer multiplies them into the dataset's per-pixel weights (masks), which every
family's loss already averages with, so they reach every family's loss through one path.
"""

from __future__ import annotations

import math

import torch

from dpipe.config.schema import TimestepWeighting

# sigma_sqrt's 1/sigma^2 is infinite at sigma = 0, which uniform sampling can draw; the
# smallest sigma of a 1000-step schedule bounds it (diffusers draws sigma from those steps).
MIN_SIGMA = 1e-3


def timestep_weights(weighting: TimestepWeighting, sigma: torch.Tensor) -> torch.Tensor | None:
    """(B,) float32 weights, or None for `none` (no weights: the loss stays bit for bit)."""
    if weighting == TimestepWeighting.none:
        return None
    s = sigma.float()
    if weighting == TimestepWeighting.sigma_sqrt:
        return s.clamp(min=MIN_SIGMA) ** -2.0
    if weighting == TimestepWeighting.cosmap:
        return 2 / (math.pi * (1 - 2 * s + 2 * s ** 2))
    raise ValueError(weighting)  # pragma: no cover - the schema's enum makes this unreachable
