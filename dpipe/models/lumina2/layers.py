"""Lumina 2's transformer as pipeline layers (`dpipe.models.common.lumina_layers`).

This follows `Lumina2Transformer2DModel.forward`: caption tokens at RoPE positions (i, 0, 0), image
tokens at (caption length, row, column); the joint blocks get no mask when no caption is padded, as
in diffusers, whose caption refiner still masks the tokenizer's padding. RoPE rotations come from
the transformer's own `rope_embedder` tables, per block from int64 position ids.
"""

from __future__ import annotations

import torch
from torch import nn

from dpipe.models.common.lumina_layers import LuminaEmbed, lumina_layers
from dpipe.models.spec import PipelineLayer


class Lumina2Positions:
    """Captions on the first RoPE axis only; rotations from Lumina2RotaryPosEmbed's tables."""

    def __init__(self, rope: nn.Module):
        self.rope = rope  # parameter-free: not a submodule of the layers

    def caption(self, length: int, batch: int, device: torch.device) -> torch.Tensor:
        ids = torch.zeros(batch, length, 3, dtype=torch.long, device=device)
        ids[..., 0] = torch.arange(length, device=device)[None]
        return ids

    def rotations(self, ids: torch.Tensor) -> torch.Tensor:
        # Its tables are a plain list of CPU tensors, which it copies to the ids' device on
        # every call (a host sync each time on a GPU): they move once here.
        if self.rope.freqs_cis[0].device != ids.device:
            self.rope.freqs_cis = [table.to(ids.device) for table in self.rope.freqs_cis]
        return self.rope._get_freqs_cis(ids)


class Lumina2Embed(LuminaEmbed):
    def time_and_caption(self, latents, t, cap):
        return self.time_caption_embed(latents, t, cap)


def lumina2_layers(transformer: nn.Module) -> list[PipelineLayer]:
    return lumina_layers(transformer, Lumina2Embed(transformer),
                         Lumina2Positions(transformer.rope_embedder))
