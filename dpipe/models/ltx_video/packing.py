"""LTX's token layout: latents (B, C, F, H, W) <-> patch tokens, as LTXPipeline packs them. Below
the spec and the samplers, which both read it (LTX-2's too)."""

from __future__ import annotations

import torch


def pack(latents: torch.Tensor, p: int, pt: int) -> torch.Tensor:
    """(B, C, F, H, W) -> (B, F/pt * H/p * W/p, C*pt*p*p), as LTXPipeline._pack_latents."""
    b, c, f, h, w = latents.shape
    x = latents.reshape(b, c, f // pt, pt, h // p, p, w // p, p)
    return x.permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4, 7).flatten(1, 3)


def unpack(tokens: torch.Tensor, grid: tuple[int, int, int], p: int, pt: int) -> torch.Tensor:
    """The inverse of `pack`, as LTXPipeline._unpack_latents."""
    f, h, w = grid
    x = tokens.reshape(tokens.shape[0], f, h, w, -1, pt, p, p)
    return x.permute(0, 4, 1, 5, 2, 6, 3, 7).flatten(6, 7).flatten(4, 5).flatten(2, 3)
