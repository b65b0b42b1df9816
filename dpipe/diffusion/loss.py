"""The training loss: the per-element error (`train.loss`), the labels and the weighted mean,
one of each for every family.

Each family's `ModelSpec.loss` takes its prediction and target apart (packed tokens, reference
tokens, video frames) and averages with its own weights (masks, min-SNR); the error per element
between them is `ElementError`, chosen by the run. Huber and smooth L1 grow linearly beyond
their threshold, so a few badly predicted elements (outlier timesteps, sharp mask edges) pull
less on the update than under MSE.

It lives with the diffusion math (timesteps, noise, flow-matching targets, min-SNR weights) and
not with the models: it is a pure function of the noised batch's target, the prediction and the
dataset's mask weights, the same for every family; a family only unpacks its tokens first.
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


def per_sample_weight(weight: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """A loss weight map (B, ...) as one weight per sample, its mean, shaped to broadcast over
    `like` (B, ...): for a stream without pixels (a clip's sound), so that a directory's
    loss_weight and timestep weighting count for it exactly, and masks as their average."""
    if weight is None:
        return None
    return weight.float().flatten(1).mean(1).view(-1, *([1] * (like.dim() - 1)))


def weighted_labels(batch) -> tuple[torch.Tensor, ...]:
    """(target,) or, when the dataset gives per-pixel loss weights (masks, (B, 1, h, w) at latent
    resolution), (target, weight) for `weighted_mean`."""
    weight = getattr(batch, "loss_weight", None)
    return (batch.target,) if weight is None else (batch.target, weight)


def image_loss(error: torch.Tensor, labels: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The mean of the per-element `error` against the target; mask weights (labels[1], where
    given) broadcast over the channels."""
    return weighted_mean(error, *labels[1:])


def video_loss(error: torch.Tensor, labels: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The mean of the per-element `error` against the target of (B, C, F, h, w) latents; mask
    weights (labels[1], (B, 1, h, w)) broadcast over C and F."""
    if len(labels) == 1:
        return weighted_mean(error)
    weight = labels[1]
    return weighted_mean(error, weight.view(weight.shape[0], 1, 1, *weight.shape[-2:]))
