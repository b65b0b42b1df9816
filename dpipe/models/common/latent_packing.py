"""FLUX's 2x2 latent packing, its inverse, the labels packed alike and the image tokens' position
ids, as FluxPipeline makes them; FLUX.1, FLUX.1 Kontext, Chroma, Qwen-Image and Krea 2 share
them."""

from __future__ import annotations

import torch


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, 4C): FLUX's 2x2 patch packing (as FluxPipeline._pack_latents)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(packed: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B, h/2 * w/2, 4C) -> (B, C, h, w) shaped as `like`: the inverse of FLUX's packing."""
    b, c, h, w = like.shape
    x = packed.reshape(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)


def packed_labels(batch) -> tuple[torch.Tensor, ...]:
    """The loss labels of a micro-batch whose prediction is packed: (target,), or (target,
    weight) where the dataset gives mask weights (B, 1, h, w), packed as the target is
    (channel-major groups of the 2x2 patch, so repeated over the channels)."""
    b, c, h, w = batch.latents.shape
    weight = getattr(batch, "loss_weight", None)
    if weight is None:
        return (pack(batch.target),)
    return pack(batch.target), pack(weight.expand(b, 1, h, w)).repeat(1, 1, c)


def image_ids(h: int, w: int) -> torch.Tensor:
    ids = torch.zeros(h, w, 3, dtype=torch.long)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.reshape(h * w, 3)
