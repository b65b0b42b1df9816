"""The conditioning that Wan's image-to-video checkpoints take (36 input channels), built as
`WanImageToVideoPipeline.prepare_latents` builds it: the latents of a condition video holding the
given frames with black between them, and 4 mask channels per latent frame saying which pixel
frames are given (a latent frame packs 4 pixel frames, the first latent frame the first one 4
times)."""

from __future__ import annotations

import torch


def condition_video(pixels: torch.Tensor, mode: str) -> torch.Tensor:
    """(B, 3, F, H, W) clip -> its condition video: the first frame then black (zeros in
    [-1, 1]) for "first"; the first frame, black, the last frame for "both" (`last_image`)."""
    black = pixels.new_zeros(pixels.shape[0], 3, pixels.shape[2] - 1, *pixels.shape[3:])
    if mode == "first":
        return torch.cat([pixels[:, :, :1], black], dim=2)
    if mode == "both":
        return torch.cat([pixels[:, :, :1], black[:, :, 1:], pixels[:, :, -1:]], dim=2)
    raise ValueError(f"Wan's condition video has no mode {mode!r}")


def condition_mask(like: torch.Tensor, modes: list[str]) -> torch.Tensor:
    """(B, 4, F', h, w) mask (dtype and shape of `like`): 1 on the first latent frame and, for
    samples given their last frame, on the last pixel frame (the 4th slot of the last latent
    frame); a one-frame sample's only frame is both."""
    mask = torch.zeros_like(like)
    mask[:, :, 0] = 1
    for row, mode in enumerate(modes):
        if mode == "both":
            mask[row, 3, -1] = 1
    return mask


def image_embedder_input(embedder, tokens: torch.Tensor | None) -> torch.Tensor | None:
    """The cached (B, 2N, D) CLIP tokens of FLF2V's two frames as diffusers' image embedding
    takes them: (2B, N, D), each sample's first frame then its last (the pipeline encodes
    [image, last_image] as a batch, and the embedding views it back as (B, 2N, D)); other
    checkpoints' tokens as they are."""
    if tokens is None or getattr(embedder.image_embedder, "pos_embed", None) is None:
        return tokens
    return tokens.reshape(-1, tokens.shape[1] // 2, tokens.shape[2])
