"""A given last frame on LTX-2, as `LTX2ConditionPipeline` feeds a condition at a latent index
past 0 (a "keyframe"): the frame's own latent (the image encoded alone) appended to the video's
tokens, clean, at t = 0, with rotary positions of its own. The cache keeps that latent as one
more latent frame after a clip's own (`LTX2Spec.encode_videos`); the layers tell the appended
tokens by the token count past the grid's."""

from __future__ import annotations

import torch
from torch import nn

from dpipe.models.sync_free import sizes


def clip_frames(stored_frames: int) -> int:
    """The latent frames of the clip itself in a cached entry of `stored_frames`: a clip's entry
    ends with its last frame's own latent; an image's (1 frame) has none."""
    return stored_frames - 1 if stored_frames > 1 else stored_frames


def cached_frames(clip_frames: int) -> int:
    """The latent frames a cached entry of a clip of `clip_frames` latent frames holds."""
    return clip_frames + 1 if clip_frames > 1 else clip_frames


def video_coords(rope: nn.Module, grid: torch.Tensor, tokens: int, batch: int, fps,
                 device) -> torch.Tensor:
    """(B, 3, tokens, 2) positions: the video's grid as `prepare_video_coords` makes them, then,
    where `tokens` exceeds the grid's, those of a one-frame keyframe on the last latent frame."""
    f, h, w = sizes(grid)
    coords = rope.prepare_video_coords(batch, f, h, w, device, fps=fps)
    if tokens == coords.shape[2]:
        return coords
    extra = keyframe_coords(rope, f, h, w, device, fps).expand(batch, -1, -1, -1)
    assert coords.shape[2] + extra.shape[2] == tokens, (tokens, coords.shape, extra.shape)
    return torch.cat([coords, extra], dim=2)


def keyframe_coords(rope: nn.Module, f: int, h: int, w: int, device, fps) -> torch.Tensor:
    """(1 or B, 3, h * w, 2) as `LTX2ConditionPipeline._prepare_keyframe_coords` places a
    one-pixel-frame condition at latent index f - 1: no causal shift, the time axis starting at
    its pixel frame ((f - 2) * temporal ratio + 1) and one frame long, divided by the fps."""
    pt, p = rope.patch_size_t, rope.patch_size
    grid = torch.stack(torch.meshgrid(
        torch.arange(0, 1, pt, dtype=torch.float32, device=device),
        torch.arange(0, h, p, dtype=torch.float32, device=device),
        torch.arange(0, w, p, dtype=torch.float32, device=device), indexing="ij"), dim=0)
    ends = grid + torch.tensor((pt, p, p), dtype=grid.dtype, device=device).view(3, 1, 1, 1)
    coords = torch.stack([grid, ends], dim=-1).flatten(1, 3).unsqueeze(0)
    scale = torch.tensor(rope.scale_factors, dtype=coords.dtype, device=device)
    coords = coords * scale.view(1, -1, 1, 1)
    start = (f - 2) * rope.scale_factors[0] + 1
    coords[:, 0, :, 0] = coords[:, 0, :, 0] + start
    coords[:, 0, :, 1] = coords[:, 0, :, 0] + 1
    if torch.is_tensor(fps):  # one rate per sample, (B, 1, 1)
        coords = coords.repeat(fps.shape[0], 1, 1, 1)
    coords[:, 0] = coords[:, 0] / fps
    return coords
