"""Cosmos 1.0's latent conventions, shared by its spec (training) and its sampler: the frame rate
its rotary embedding assumes, and the VAE's latent statistics per channel and latent frame."""

from __future__ import annotations

import torch

FPS = 30  # CosmosTextToWorldPipeline's default; it scales the temporal rope


def latent_statistics(vae_config, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(mean, std) of the Cosmos VAE's latents, shaped (1, C, F', 1, 1) for `latents`' F' latent
    frames (the config holds C x 16 values, one per channel and latent frame), or None where the
    config has none."""
    if vae_config.latents_mean is None:
        return None
    c = vae_config.latent_channels
    frames = latents.shape[2]
    view = lambda v: torch.tensor(v).view(1, c, -1, 1, 1)[:, :, :frames].to(latents)
    return view(vae_config.latents_mean), view(vae_config.latents_std)
