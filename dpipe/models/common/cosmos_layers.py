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

from dpipe.models.common.stage_io import keep_in_graph, needs_grad
from dpipe.models.spec import PipelineLayer
from dpipe.models.sync_free import sizes


def _per_token(x: torch.Tensor, tokens_per_frame: int) -> torch.Tensor:
    """(B, F', D) per latent frame -> (B, F' * tokens_per_frame, D) per token (frame-major)."""
    b, f, d = x.shape
    return x.unsqueeze(2).expand(b, f, tokens_per_frame, d).reshape(b, f * tokens_per_frame, d)


def _rotary(rope: nn.Module, grid: torch.Tensor, patch, device: torch.device):
    frames, height, width, fps = sizes(grid)
    # CosmosRotaryPosEmbed reads nothing but the shape of the latents it is given.
    shape = (0, 0, frames * patch[0], height * patch[1], width * patch[2])
    return rope(torch.empty(shape, device=device), fps=fps or None)


class CosmosEmbed(PipelineLayer):
    def __init__(self, transformer: nn.Module):
        super().__init__()
        self.adopt("patch_embed", transformer.patch_embed, "patch_embed")
        self.adopt("time_embed", transformer.time_embed, "time_embed")
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
    def __init__(self, block: nn.Module, rope: nn.Module, patch_size, source_name: str):
        super().__init__()
        self.adopt("block", block, source_name)
        # CosmosRotaryPosEmbed has neither weights nor buffers: safe to share across stages.
        self.rope = rope
        self.patch_size = tuple(patch_size)

    def forward(self, inputs):
        hidden, text, temb, embedded, grid = inputs
        rotary = _rotary(self.rope, grid, self.patch_size, hidden.device)
        block_temb, block_embedded = temb, embedded
        if temb.ndim == 3:  # one timestep per latent frame: the block wants one per token
            per_frame = hidden.shape[1] // temb.shape[1]
            block_temb = _per_token(temb, per_frame)
            block_embedded = _per_token(embedded, per_frame)
        hidden = self.block(hidden, text, block_embedded, block_temb, rotary)
        return hidden, text, temb, embedded, grid


class CosmosHead(PipelineLayer):
    def __init__(self, transformer: nn.Module):
        super().__init__()
        self.adopt("norm_out", transformer.norm_out, "norm_out")
        self.adopt("proj_out", transformer.proj_out, "proj_out")
        self.patch_size = tuple(transformer.config.patch_size)

    def forward(self, inputs):
        hidden, text, temb, embedded, grid = inputs
        frames, height, width, _ = sizes(grid)
        if temb.ndim == 3:
            per_frame = hidden.shape[1] // temb.shape[1]
            temb, embedded = _per_token(temb, per_frame), _per_token(embedded, per_frame)
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
    patch = transformer.config.patch_size
    layers: list[PipelineLayer] = [CosmosEmbed(transformer)]
    for i, block in enumerate(transformer.transformer_blocks):
        layers.append(CosmosBlock(block, transformer.rope, patch, f"transformer_blocks.{i}"))
    layers.append(CosmosHead(transformer))
    return layers
