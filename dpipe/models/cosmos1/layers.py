"""Cosmos 1.0's transformer (CosmosTransformer3DModel with the learnable absolute position
embedding) as pipeline layers: Cosmos-Predict2's embed, blocks and head (the same diffusers
class), plus that embedding.

Every layer passes Cosmos-Predict2's tuple (`dpipe.models.common.cosmos_layers`) with one more
tensor at its end:
  pos  (1, tokens, D) the learnable position embedding of the latents' grid, made once by the
       embedding layer from its weights and added to the hidden states at the start of every
       block, as diffusers' `CosmosTransformerBlock` adds `extra_pos_emb` first thing. It is sent
       without the batch dimension; in a full fine-tune its gradient flows back through the
       stages to the embedding's weights.
The first layer's input is `Cosmos1Spec.make_inputs`': (scaled latents c_in x (B, 16, F, h, w),
c_noise (B,), T5 states (B, L, 1024), grid).
"""

from __future__ import annotations

from torch import nn

from dpipe.models.common.cosmos_layers import CosmosBlock, CosmosEmbed, CosmosHead
from dpipe.models.common.stage_io import keep_in_graph, needs_grad
from dpipe.models.spec import PipelineLayer, block_layers
from dpipe.models.sync_free import sizes


class Cosmos1Embed(CosmosEmbed):
    parts = (*CosmosEmbed.parts, "learnable_pos_embed")

    def forward(self, inputs):
        latents, _, _, grid = inputs
        frames, height, width, _ = sizes(grid)
        p_t, p_h, p_w = self.learnable_pos_embed.patch_size
        # The embedding reads the latents' shape (batch 1: it is the same for every sample) and
        # dtype alone.
        shape = (1, 0, frames * p_t, height * p_h, width * p_w)
        pos = self.learnable_pos_embed(latents.new_empty(shape))
        return (*super().forward(inputs), needs_grad(pos))


class Cosmos1Block(CosmosBlock):
    def forward(self, inputs):
        hidden, text, temb, embedded, grid, pos = inputs
        # diffusers' block: hidden_states = hidden_states + extra_pos_emb, then attention.
        return (*super().forward((hidden + pos, text, temb, embedded, grid)), pos)


class Cosmos1Head(CosmosHead):
    def forward(self, inputs):
        out = super().forward(inputs[:5])
        # The position embedding ends here: when the head is alone on the last stage, the tensor
        # it received still needs a gradient for the pipeline's backward pass.
        return keep_in_graph(out, inputs[5])


def cosmos1_layers(transformer: nn.Module) -> list[PipelineLayer]:
    c = transformer.config
    if c.extra_pos_embed_type != "learnable":
        raise ValueError("a CosmosTransformer3DModel without the learnable position embedding is "
                         "not Cosmos 1.0 (Cosmos-Predict2 has none: model=cosmos_predict2)")
    if c.img_context_dim_in or c.controlnet_block_every_n or c.use_crossattn_projection:
        raise ValueError("CosmosTransformer3DModel with image context, control blocks or a text "
                         "projection (Cosmos 2.5) is not Cosmos 1.0")
    return [Cosmos1Embed(transformer), *block_layers(Cosmos1Block, transformer, "transformer_blocks"),
            Cosmos1Head(transformer)]


