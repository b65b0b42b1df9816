"""Krea 2's single-stream transformer as pipeline layers: embed -> blocks -> head.

The first layer takes (image, t, text, text_mask, grid): the packed noisy latents (B, N, 4C),
t in [0, 1], the stack of tapped text-encoder states (B, L, K, D), the pipeline's text mask
(int64, (B, L): Krea 2 pads in the middle of its template, so it is no prefix) and the latent
grid in 2x2 patches, carried in a shape (`dpipe.models.sync_free`). It runs the text fusion, the
text and image projections and the timestep embedding, and every layer after it passes
(hidden, temb, temb_mod, text_mask, grid): the joint [text, image] sequence, the timestep
embedding (for the head), its 6-way block modulation, the mask and the grid. RoPE is recomputed
per block from the grid and the text length with the transformer's own `rotary_emb` and the
pipeline's own position ids; integers cross stage boundaries without gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpipe.models.common.stage_io import keep_in_graph, needs_grad
from dpipe.models.spec import PipelineLayer, block_layers
from dpipe.models.sync_free import sizes


def joint_mask(text_mask: torch.Tensor, image_tokens: int) -> torch.Tensor:
    """The transformer's key-padding mask (B, 1, 1, L + N): text as given, every image token."""
    mask = text_mask.bool()
    image = mask.new_ones((mask.shape[0], image_tokens))
    return torch.cat([mask, image], dim=1)[:, None, None, :]


def rotary(rotary_emb: nn.Module, text_tokens: int, grid: torch.Tensor, device) -> tuple:
    """(cos, sin) of the joint sequence from `Krea2Pipeline.prepare_position_ids`."""
    from diffusers import Krea2Pipeline

    h, w = sizes(grid)
    return rotary_emb(Krea2Pipeline.prepare_position_ids(text_tokens, h, w, device))


class Krea2Embed(PipelineLayer):
    parts = ("img_in", "time_embed", "time_mod_proj", "text_fusion", "txt_in")

    def forward(self, inputs):
        image, t, text, text_mask, grid = inputs
        # As Krea2Transformer2DModel.forward, up to its block loop.
        temb = self.time_embed(t, dtype=image.dtype)
        temb_mod = self.time_mod_proj(F.gelu(temb, approximate="tanh"))
        text_hidden = self.text_fusion(text.to(image.dtype),
                                       attention_mask=text_mask.bool()[:, None, None, :])
        hidden = torch.cat([self.txt_in(text_hidden), self.img_in(image)], dim=1)
        return (needs_grad(hidden), needs_grad(temb), needs_grad(temb_mod), text_mask.long(),
                grid)


class Krea2Block(PipelineLayer):
    parts = ("rotary_emb",)

    def forward(self, inputs):
        hidden, temb, temb_mod, text_mask, grid = inputs
        text_tokens = text_mask.shape[1]
        rope = rotary(self.rotary_emb, text_tokens, grid, hidden.device)
        mask = joint_mask(text_mask, hidden.shape[1] - text_tokens)
        hidden = self.block(hidden, temb_mod, rope, mask)
        return hidden, temb, temb_mod, text_mask, grid


class Krea2Head(PipelineLayer):
    parts = ("final_layer",)

    def forward(self, inputs):
        hidden, temb, temb_mod, text_mask, _grid = inputs
        out = self.final_layer(hidden[:, text_mask.shape[1]:], temb)
        # The block modulation ends unused here; alone on the last stage it still needs a
        # gradient.
        return keep_in_graph(out, temb_mod)


def krea2_layers(transformer: nn.Module) -> list[PipelineLayer]:
    return [Krea2Embed(transformer), *block_layers(Krea2Block, transformer, "transformer_blocks"),
            Krea2Head(transformer)]
