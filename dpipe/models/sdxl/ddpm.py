"""SDXL's training objective: discrete DDPM noising, epsilon or v targets, min-SNR and
debiased-estimation weights.

dpipe samples t in [0, 1] (1: pure noise) for every family; a DDPM model trains on integer
timesteps T in [0, N) of its noise schedule (N = 1000 for SDXL), T = floor(t * N). Uniform t gives
SDXL's uniform T. The schedule (alphas_cumprod) is the one diffusers' schedulers build from the
checkpoint's scheduler config, so training and sampling share it exactly.
"""

from __future__ import annotations

from typing import Any

import torch

PREDICTION_TYPES = ("epsilon", "v_prediction")


def alphas_cumprod(scheduler_config: dict[str, Any]) -> torch.Tensor:
    """The cumulative alpha products of the checkpoint's DDPM schedule (float32, length N)."""
    from diffusers import DDPMScheduler

    keys = ("num_train_timesteps", "beta_start", "beta_end", "beta_schedule", "trained_betas",
            "rescale_betas_zero_snr")
    cfg = {k: scheduler_config[k] for k in keys if scheduler_config.get(k) is not None}
    return DDPMScheduler(**cfg).alphas_cumprod.to(torch.float32)


def discrete_timesteps(t: torch.Tensor, num_train_timesteps: int) -> torch.Tensor:
    return (t * num_train_timesteps).long().clamp(0, num_train_timesteps - 1)


def _bcast(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return x.view(-1, *([1] * (like.ndim - 1))).to(like.dtype)


def noisy_and_target(x0: torch.Tensor, noise: torch.Tensor, abar: torch.Tensor,
                     prediction_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x_T = sqrt(abar) x0 + sqrt(1 - abar) noise, and what the model predicts at x_T."""
    a, s = _bcast(abar.sqrt(), x0), _bcast((1 - abar).sqrt(), x0)
    noisy = a * x0 + s * noise
    if prediction_type == "epsilon":
        return noisy, noise
    return noisy, a * noise - s * x0  # v = sqrt(abar) eps - sqrt(1 - abar) x0


def loss_weights(abar: torch.Tensor, prediction_type: str, min_snr_gamma: float,
                 debiased: bool = False) -> torch.Tensor:
    """Per-sample loss weights: 1, min-SNR-gamma (Hang et al. 2023) when gamma > 0, times
    debiased estimation's 1/sqrt(SNR) (Yu et al. 2023) with `debiased`.

    SNR = abar / (1 - abar). On the epsilon loss the weight is min(SNR, gamma) / SNR; on the v
    loss, min(SNR, gamma) / (SNR + 1), which is the same weight on the x0 error. Debiasing
    weighs the epsilon loss by 1/sqrt(SNR), so the v loss by sqrt(SNR) / (SNR + 1): the same
    objective whichever the model predicts (kohya's sd-scripts weigh the v loss by 1/(SNR + 1)
    instead, 1/SNR on the epsilon loss).
    """
    if min_snr_gamma <= 0 and not debiased:
        return torch.ones_like(abar)
    snr = abar / (1 - abar)
    clipped = torch.clamp(snr, max=min_snr_gamma) if min_snr_gamma > 0 else snr
    weight = clipped / snr if prediction_type == "epsilon" else clipped / (snr + 1)
    return weight * snr.rsqrt() if debiased else weight
