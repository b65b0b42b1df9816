"""A joint audio-video sample's two streams as one tensor, the form dpipe's sampler carries
(`Denoising.latents`: one tensor per request, broadcast between the pipeline stages, gathered,
saved): the video latents (1, C, F, h, w) with the sound's values in k more columns,
(1, C, F, h, w + k), zero-padded. The video's shape and the sound's value count (which each
family derives from the video's frames) are all `split` needs. The Euler steps are elementwise,
so a family may step the joined tensor as it is; guidance that takes a whole-sample statistic
(a std) splits first. MiniMax H3 and LTX-2 (model.audio=true) sample so."""

from __future__ import annotations

import torch


def join(video: torch.Tensor, sound: torch.Tensor) -> torch.Tensor:
    """Video latents (1, C, F, h, w) and any tensor of the sound -> (1, C, F, h, w + k)."""
    c, f, h, _ = video.shape[1:]
    k = -(-sound.numel() // (c * f * h))
    extra = torch.zeros(c * f * h * k, dtype=video.dtype, device=video.device)
    extra[:sound.numel()] = sound.flatten().to(video.dtype)
    return torch.cat([video, extra.reshape(1, f, h, c, k).permute(0, 3, 1, 2, 4)], dim=-1)


def split(joined: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `join` for a sound of `count` values: (video latents, the sound's values
    flat, in the order `join` took them)."""
    c, f, h, width = joined.shape[1:]
    k = -(-count // (c * f * h))
    extra = joined[..., width - k:].permute(0, 2, 3, 1, 4).reshape(-1)
    return joined[..., :width - k], extra[:count]
