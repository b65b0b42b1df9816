"""The BatchNorm statistics of VAEs that normalise their 2x2-patched latents with a `bn` layer
(AutoencoderKLFlux2 and its kin: FLUX.2, Ideogram 4, ERNIE-Image). Encoding divides by them and
decoding undoes them, as each family's pipeline does."""

from __future__ import annotations

from typing import Callable

import torch


def batch_norm_stats(vae, eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) of the patched latents, each (1, 4C, 1, 1). `eps`: the one the family's
    pipeline adds to the variance; None takes the VAE config's `batch_norm_eps`."""
    eps = vae.config.batch_norm_eps if eps is None else eps
    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    return mean, torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + eps)


@torch.no_grad()
def normalised_patches(vae, pixels: torch.Tensor, patchify: Callable[[torch.Tensor], torch.Tensor],
                       eps: float | None = None) -> torch.Tensor:
    """Pixels (B, 3, H, W) in [-1, 1] -> the VAE's mode in 2x2 patches (`patchify`: the family's
    channel order), normalised with `batch_norm_stats(vae, eps)`."""
    latents = patchify(vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mode())
    mean, std = batch_norm_stats(vae, eps)
    return (latents - mean.to(latents.dtype)) / std.to(latents.dtype)


@torch.no_grad()
def decoded_patches(vae, latents: torch.Tensor, unpatchify: Callable[[torch.Tensor], torch.Tensor],
                    eps: float | None = None) -> torch.Tensor:
    """The way back, as the pipelines decode: normalised patched latents (1, 4C, h, w) -> the
    image (3, H, W), the statistics undone, the patches unfolded by `unpatchify`."""
    x = latents.to(vae.device, vae.dtype)
    mean, std = batch_norm_stats(vae, eps)
    x = unpatchify(x * std.to(x.dtype) + mean.to(x.dtype))
    return vae.decode(x, return_dict=False)[0][0].float()
