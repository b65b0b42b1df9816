"""OmniGen2's transformer (`dpipe.models.omnigen2.transformer`) as pipeline layers, text-to-image
(`dpipe.models.common.lumina_layers`).

As the transformer's forward: caption tokens at RoPE positions (i, i, i), image tokens at
(caption length, row, column), rotations computed from the positions (`OmniGen2Positions`). When no
caption is padded no block gets a mask (the reference passes an all-true one: the same numbers).
The reference-image weights (editing) are in no layer: `OmniGen2Spec.export_full` copies them
from the base model.
"""

from __future__ import annotations

from torch import nn

from dpipe.models.common.lumina_layers import LuminaEmbed, lumina_layers
from dpipe.models.omnigen2.transformer import OmniGen2Positions
from dpipe.models.spec import PipelineLayer


class OmniGen2Embed(LuminaEmbed):
    def time_and_caption(self, latents, t, cap):
        return self.time_caption_embed(t, cap, latents.dtype)


def omnigen2_layers(transformer: nn.Module) -> list[PipelineLayer]:
    positions = OmniGen2Positions(tuple(transformer.config.axes_dim_rope))
    return lumina_layers(transformer, OmniGen2Embed(transformer), positions)
