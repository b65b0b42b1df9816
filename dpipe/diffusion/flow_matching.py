"""Rectified-flow (flow matching) noising and target, as FLUX.1, SD3 and Wan are trained."""

from __future__ import annotations

import torch


def noisy_latents(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - t) x0 + t noise, with t broadcast over all but the batch dimension."""
    t = t.view(-1, *([1] * (x0.ndim - 1))).to(x0.dtype)
    return (1 - t) * x0 + t * noise


def velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """d x_t / d t: what the model predicts."""
    return noise - x0


def data_velocity(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """-d x_t / d t = x0 - noise: what a model predicts whose step moves towards the data
    (x0 = x_t + t * prediction), as Lumina 2's, OmniGen2's and MiniMax H3's do."""
    return x0 - noise
