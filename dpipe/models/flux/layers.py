"""FLUX.1's transformer as pipeline layers: embed -> double blocks -> single blocks -> head.

Every layer passes the tuple (hidden, text_hidden, temb, ids). Rotary embeddings are recomputed
per block from the integer position ids: floats crossing a stage boundary must receive gradients,
integers travel free (see docs on stage I/O).
"""

from __future__ import annotations

import torch
from torch import nn

from dpipe.models.common.stage_io import keep_in_graph, needs_grad
from dpipe.models.spec import PipelineLayer, block_layers


class FluxEmbed(PipelineLayer):
    parts = ("x_embedder", "time_text_embed", "context_embedder")

    def __init__(self, transformer: nn.Module):
        super().__init__(transformer)
        self.has_guidance = bool(transformer.config.guidance_embeds)

    def forward(self, inputs):
        packed, t, text, pooled, guidance, txt_ids, img_ids = inputs
        hidden = self.x_embedder(packed)
        timestep = t.to(hidden.dtype) * 1000
        if self.has_guidance:
            temb = self.time_text_embed(timestep, guidance.to(hidden.dtype) * 1000, pooled)
        else:
            temb = self.time_text_embed(timestep, pooled)
        text_hidden = self.context_embedder(text)
        ids = torch.cat([txt_ids, img_ids], dim=0).long()
        return needs_grad(hidden), needs_grad(text_hidden), needs_grad(temb), ids


class FluxBlock(PipelineLayer):
    """A double-stream or single-stream block; both take and return (text, image) streams."""

    parts = ("pos_embed",)

    def forward(self, inputs):
        hidden, text_hidden, temb, ids = inputs
        rotary = self.pos_embed(ids)
        text_hidden, hidden = self.block(
            hidden_states=hidden,
            encoder_hidden_states=text_hidden,
            temb=temb,
            image_rotary_emb=rotary,
        )
        return hidden, text_hidden, temb, ids


class FluxHead(PipelineLayer):
    parts = ("norm_out", "proj_out")

    def forward(self, inputs):
        hidden, text_hidden, temb, _ids = inputs
        out = self.proj_out(self.norm_out(hidden, temb))
        # The text stream ends unused here; when the head is alone on the last stage, the text
        # tensor it received still needs a gradient for the pipeline's backward pass.
        return keep_in_graph(out, text_hidden)


def flux_layers(transformer: nn.Module) -> list[PipelineLayer]:
    return [FluxEmbed(transformer),
            *block_layers(FluxBlock, transformer, "transformer_blocks", "single_transformer_blocks"),
            FluxHead(transformer)]
