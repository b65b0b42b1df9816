"""Cosmos-Predict2's transformer (CosmosTransformer3DModel) as pipeline layers: embed -> blocks ->
head. Cosmos 1.0 adds its position embedding to them, and Anima its text adapter in front.

Every layer passes the tuple (hidden, text, temb, embedded_timestep, grid):
  hidden             (B, tokens, D) video tokens, tokens = F' * h' * w' after the (1, 2, 2) patches
  text               (B, L, D_text) T5 states (projected first where the config says so)
  temb               (B, 3D) adaLN-LoRA shifts, or (B, F', 3D) with one timestep per latent frame
  embedded_timestep  (B, D), or (B, F', D)
  grid               F', h', w', fps (0: an image, no temporal rope scaling) carried in its
                     shape (`dpipe.models.sync_free`); the rotary embeddings are recomputed from
                     it in every block (it has no weights)

Per-frame timesteps are how Video2World conditions: the given latent frames get t ~ 0. diffusers
takes them as (B, 1, F, 1, 1) and expands them to every token; the layers send one per latent
frame and expand inside each block, so stages never exchange a per-token copy. The first layer's
input tuple is `CosmosPredict2Spec.make_inputs`': (latents (B, C, F, h, w) with the condition mask
channel for Video2World, t in [0, 1] of shape (B,) or (B, F), text (B, L, D_text), grid).

The padding-mask channel that `concat_padding_mask` adds is all zeros here, as the pipelines pass
it (a zero mask resized to the latents: no torchvision needed).
"""

from __future__ import annotations

import torch
from torch import nn

from dpipe.models.common.shapes import per_token
from dpipe.models.common.stage_io import keep_in_graph, needs_grad
from dpipe.models.spec import PipelineLayer, block_layers
from dpipe.models.sync_free import sizes


def _rotary(rope: nn.Module, grid: torch.Tensor, patch, device: torch.device):
    frames, height, width, fps = sizes(grid)
    # CosmosRotaryPosEmbed reads nothing but the shape of the latents it is given.
    shape = (0, 0, frames * patch[0], height * patch[1], width * patch[2])
    return rope(torch.empty(shape, device=device), fps=fps or None)


class CosmosEmbed(PipelineLayer):
    parts = ("patch_embed", "time_embed")

    def __init__(self, transformer: nn.Module):
        super().__init__(transformer)
        self.projects_text = bool(transformer.config.use_crossattn_projection)
        if self.projects_text:
            self.adopt("crossattn_proj", transformer.crossattn_proj, "crossattn_proj")
        self.padding_channel = bool(transformer.config.concat_padding_mask)

    def forward(self, inputs):
        latents, t, text, grid = inputs
        if self.padding_channel:
            latents = torch.cat([latents, latents.new_zeros(latents[:, :1].shape)], dim=1)
        hidden = self.patch_embed(latents).flatten(1, 3)  # (B, T', H', W', D) -> (B, THW, D)
        if t.ndim == 2:  # per latent frame
            temb, embedded = self.time_embed(hidden, t.flatten())
            temb, embedded = (x.unflatten(0, t.shape) for x in (temb, embedded))
        else:
            temb, embedded = self.time_embed(hidden, t)
        if self.projects_text:
            text = self.crossattn_proj(text)
        return (needs_grad(hidden), needs_grad(text), needs_grad(temb), needs_grad(embedded),
                grid)


class CosmosBlock(PipelineLayer):
    # CosmosRotaryPosEmbed has neither weights nor buffers: safe to share across stages.
    parts = ("rope",)

    def __init__(self, transformer: nn.Module, block: nn.Module, source_name: str):
        super().__init__(transformer, block, source_name)
        self.patch_size = tuple(transformer.config.patch_size)

    def forward(self, inputs):
        hidden, text, temb, embedded, grid = inputs
        rotary = _rotary(self.rope, grid, self.patch_size, hidden.device)
        block_temb, block_embedded = temb, embedded
        if temb.ndim == 3:  # one timestep per latent frame: the block wants one per token
            per_frame = hidden.shape[1] // temb.shape[1]
            block_temb = per_token(temb, per_frame)
            block_embedded = per_token(embedded, per_frame)
        hidden = self.block(hidden, text, block_embedded, block_temb, rotary)
        return hidden, text, temb, embedded, grid


class CosmosHead(PipelineLayer):
    parts = ("norm_out", "proj_out")

    def __init__(self, transformer: nn.Module):
        super().__init__(transformer)
        self.patch_size = tuple(transformer.config.patch_size)

    def forward(self, inputs):
        hidden, text, temb, embedded, grid = inputs
        frames, height, width, _ = sizes(grid)
        if temb.ndim == 3:
            per_frame = hidden.shape[1] // temb.shape[1]
            temb, embedded = per_token(temb, per_frame), per_token(embedded, per_frame)
        out = self.proj_out(self.norm_out(hidden, embedded, temb))
        p_t, p_h, p_w = self.patch_size
        out = out.unflatten(2, (p_h, p_w, p_t, -1)).unflatten(1, (frames, height, width))
        out = out.permute(0, 7, 1, 6, 2, 4, 3, 5).flatten(6, 7).flatten(4, 5).flatten(2, 3)
        # The text ends unused here; when the head is alone on the last stage, the tensor it
        # received still needs a gradient for the pipeline's backward pass.
        return keep_in_graph(out, text)


def cosmos_layers(transformer: nn.Module) -> list[PipelineLayer]:
    if transformer.config.extra_pos_embed_type:
        raise ValueError("CosmosTransformer3DModel with a learnable position embedding "
                         "(Cosmos 1.0) is not supported: Cosmos-Predict2 has none")
    if transformer.config.img_context_dim_in or transformer.config.controlnet_block_every_n:
        raise ValueError("CosmosTransformer3DModel with image context or control blocks "
                         "(Cosmos 2.5) is not supported")
    return [CosmosEmbed(transformer), *block_layers(CosmosBlock, transformer, "transformer_blocks"),
            CosmosHead(transformer)]
