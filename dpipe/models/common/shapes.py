"""Shape rules several families share: padded lengths, valid frame counts, images as videos,
image patches as tokens and back, per-frame values per token."""

from __future__ import annotations

import torch

from dpipe.errors import DataError


def round_up(n: int, multiple: int) -> int:
    """`n` padded up to a multiple: sequence lengths the kernels want (Z-Image's 32), and the
    embedding tables of real checkpoints, padded past the tokenizer (T5: 32100 -> 32128)."""
    return -(-n // multiple) * multiple


def frames_ok(frames: int, temporal_ratio: int) -> bool:
    """Causal video VAEs encode the first frame alone, then groups of `temporal_ratio`."""
    return frames >= 1 and (frames - 1) % temporal_ratio == 0


def causal_clips(pixels: torch.Tensor, temporal_ratio: int, title: str) -> torch.Tensor:
    """(B, 3, H, W) images or (B, 3, F, H, W) clips -> clips, refused naming the family
    (`title`) where the frame count is not one a causal video VAE takes (`frames_ok`)."""
    video = as_video(pixels)
    if not frames_ok(video.shape[2], temporal_ratio):
        r = temporal_ratio
        raise DataError(f"{title}'s VAE takes {r}k+1 frames (1, {r + 1}, {2 * r + 1}, ...); "
                        f"got {video.shape[2]}")
    return video


def as_video(pixels: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) images -> (B, 3, 1, H, W) one-frame videos; (B, 3, F, H, W) as is."""
    if pixels.ndim == 4:
        return pixels.unsqueeze(2)
    if pixels.ndim == 5:
        return pixels
    raise ValueError(f"expected pixels of shape (B, 3, H, W) or (B, 3, F, H, W), got {tuple(pixels.shape)}")


def patchify(latents: torch.Tensor, p: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/p * W/p, p*p*C), features ordered (row in patch, column, channel)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1)
    return x.reshape(b, (h // p) * (w // p), p * p * c)


def unpatchify(tokens: torch.Tensor, h: int, w: int, p: int, channels: int = -1) -> torch.Tensor:
    """The inverse of `patchify` for h x w patches: (B, h*w, p*p*C) -> (B, C, h*p, w*p), as the
    diffusers image transformers end (SD3, AuraFlow, HiDream, ERNIE-Image, Lumina 2)."""
    b = tokens.shape[0]
    x = tokens.reshape(b, h, w, p, p, channels).permute(0, 5, 1, 3, 2, 4)
    return x.reshape(b, -1, h * p, w * p).contiguous()  # a view when p = 1


def per_token(x: torch.Tensor, tokens_per_frame: int) -> torch.Tensor:
    """(B, F', ...) per latent frame -> (B, F' * tokens_per_frame, ...) per token (frame-major,
    as the patch tokens of a video are ordered)."""
    b, f = x.shape[:2]
    return x.unsqueeze(2).expand(b, f, tokens_per_frame, *x.shape[2:]).reshape(
        b, f * tokens_per_frame, *x.shape[2:])
