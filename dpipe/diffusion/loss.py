"""The training loss's per-element error (`train.loss`), one function for every family.

Each family's `ModelSpec.loss` takes its prediction and target apart (packed tokens, reference
tokens, video frames) and averages with its own weights (masks, min-SNR); the error per element
between them is `ElementError`, chosen by the run. Huber and smooth L1 grow linearly beyond
their threshold, so a few badly predicted elements (outlier timesteps, sharp mask edges) pull
less on the update than under MSE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dpipe.config.schema import LossKind, TrainConfig


@dataclass(frozen=True)
class ElementError:
    kind: LossKind = LossKind.mse
    huber_delta: float = 1.0
    smooth_l1_beta: float = 1.0

    @classmethod
    def of(cls, train: TrainConfig) -> "ElementError":
        return cls(train.loss, train.huber_delta, train.smooth_l1_beta)

    def __call__(self, prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The error of each element, in float32 (bf16 would round small errors away)."""
        x, y = prediction.float(), target.float()
        if self.kind == LossKind.huber:
            return F.huber_loss(x, y, reduction="none", delta=self.huber_delta)
        if self.kind == LossKind.smooth_l1:
            return F.smooth_l1_loss(x, y, reduction="none", beta=self.smooth_l1_beta)
        return (x - y).square()


def weighted_mean(error: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """The mean over all elements, each times its weight (masks, broadcast over channels) where
    the dataset gives weights: a masked loss stays on the scale of the unmasked one."""
    if weight is None:
        return error.mean()
    return (weight.float() * error).mean()
