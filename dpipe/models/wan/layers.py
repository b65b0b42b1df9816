"""Wan's transformer (WanTransformer3DModel, 2.1 and 2.2) as pipeline layers: embed -> blocks ->
head.

Every layer passes the tuple (hidden, context, timestep_proj, temb, grid):
  hidden         (B, tokens, dim) video tokens, tokens = F' * h' * w' after the (1, 2, 2) patches
  context        (B, L, dim) embedded text tokens, preceded by the CLIP image tokens for 2.1 i2v
  timestep_proj  (B, 6, dim), or (B, F', 6, dim) with one timestep per latent frame
  temb           (B, dim), or (B, F', dim)
  grid           F', h', w' carried in its shape (`dpipe.models.sync_free`); rotary embeddings
                 are recomputed from it in every block (floats crossing a stage boundary must
                 receive gradients, integers travel free)

Per-frame timesteps are how Wan 2.2 TI2V conditions on a first frame: its tokens get t = 0.
diffusers takes one timestep per token there; the layers send one per latent frame instead (all
tokens of a frame share it) and expand it inside each block, so stages never exchange a
(B, tokens, 6, dim) tensor. The input tuple of the first layer is `WanSpec.make_inputs`':
(latents (B, C, F, h, w), t in [0, 1] of shape (B,) or (B, F), text (B, L, D)[, clip (B, N, D')]);
FLF2V's clip holds the tokens of the first frame, then those of the last.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from dpipe.models.common.shapes import per_token
from dpipe.models.common.stage_io import keep_in_graph, needs_grad
from dpipe.models.spec import PipelineLayer, block_layers
from dpipe.models.sync_free import carrier, sizes
from dpipe.models.wan.frames import image_embedder_input


class WanEmbed(PipelineLayer):
    parts = ("patch_embedding", "condition_embedder")

    def __init__(self, transformer: nn.Module):
        super().__init__(transformer)
        self.patch_size = tuple(transformer.config.patch_size)

    def forward(self, inputs):
        latents, t, text, *image = inputs
        _, _, frames, height, width = latents.shape
        p_t, p_h, p_w = self.patch_size
        grid = carrier(frames // p_t, height // p_h, width // p_w, device=latents.device)
        hidden = self.patch_embedding(latents).flatten(2).transpose(1, 2).contiguous()
        # diffusers' pipelines pass the scheduler's timesteps: t * 1000.
        timestep = t * 1000
        per_frame = timestep.ndim == 2
        temb, proj, context, image_context = self.condition_embedder(
            timestep.flatten(), text,
            image_embedder_input(self.condition_embedder, image[0] if image else None),
            timestep_seq_len=timestep.shape[1] if per_frame else None)
        proj = proj.unflatten(-1, (6, -1))
        if image_context is not None:
            context = torch.cat([image_context, context], dim=1)
        return (needs_grad(hidden), needs_grad(context), needs_grad(proj), needs_grad(temb),
                grid)


class RotaryTables:
    """The transformer's rotary tables (WanRotaryPosEmbed, buffers only), one copy per device,
    shared by every block of a process. Not a submodule of the layers: the pipeline frees the
    layers of other stages (moves them to "meta"), which would take a shared module with them."""

    def __init__(self, rope: nn.Module):
        # Kept on the CPU, or on the meta device for a transformer made there (its FLOPs are
        # counted there: dpipe.train.flops), whose tables hold no values to copy elsewhere.
        on_meta = any(b.is_meta for b in rope.buffers())
        self._home = torch.device("meta" if on_meta else "cpu")
        self._copies = {self._home: copy.deepcopy(rope).to(self._home)}

    def __call__(self, frames: int, height: int, width: int, device: torch.device):
        if device not in self._copies:
            self._copies[device] = copy.deepcopy(self._copies[self._home]).to(device)
        # WanRotaryPosEmbed reads nothing but the shape of the latents it is given.
        return self._copies[device](torch.empty(0, 0, frames, height, width, device=device))


class WanBlock(PipelineLayer):
    def __init__(self, transformer: nn.Module, block: nn.Module, source_name: str,
                 rope: RotaryTables):
        super().__init__(transformer, block, source_name)
        self.rope = rope
        self.patch_size = tuple(transformer.config.patch_size)

    def forward(self, inputs):
        hidden, context, proj, temb, grid = inputs
        frames, height, width = (g * p for g, p in zip(sizes(grid), self.patch_size))
        rotary = self.rope(frames, height, width, hidden.device)
        block_proj = proj
        if proj.ndim == 4:  # one timestep per latent frame: the block wants one per token
            block_proj = per_token(proj, hidden.shape[1] // proj.shape[1])
        hidden = self.block(hidden, context, block_proj, rotary)
        return hidden, context, proj, temb, grid


class _Table(nn.Module):
    """Holds the transformer's top-level `scale_shift_table` parameter, so a layer can adopt it."""

    def __init__(self, table: nn.Parameter):
        super().__init__()
        self.scale_shift_table = table


class WanHead(PipelineLayer):
    parts = ("norm_out", "proj_out")

    def __init__(self, transformer: nn.Module):
        super().__init__(transformer)
        # At the transformer's top level: "" gives it its public name with no prefix. (Kept in
        # a module, not adopted as a parameter, so checkpoints keep their key names.)
        self.adopt("table", _Table(transformer.scale_shift_table), "")
        self.patch_size = tuple(transformer.config.patch_size)

    def forward(self, inputs):
        hidden, context, proj, temb, grid = inputs
        frames, height, width = sizes(grid)
        table = self.table.scale_shift_table
        if temb.ndim == 3:  # per latent frame
            temb = per_token(temb, hidden.shape[1] // temb.shape[1])
            shift, scale = (table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2)
            shift, scale = shift.squeeze(2), scale.squeeze(2)
        else:
            shift, scale = (table + temb.unsqueeze(1)).chunk(2, dim=1)
        out = (self.norm_out(hidden.float()) * (1 + scale) + shift).type_as(hidden)
        out = self.proj_out(out)
        p_t, p_h, p_w = self.patch_size
        out = out.reshape(out.shape[0], frames, height, width, p_t, p_h, p_w, -1)
        out = out.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3)
        # The context and the block modulation end unused here; when the head is alone on the
        # last stage, the tensors it received still need gradients for the pipeline's backward.
        return keep_in_graph(out, context, proj)


def wan_layers(transformer: nn.Module) -> list[PipelineLayer]:
    return [WanEmbed(transformer),
            *block_layers(WanBlock, transformer, "blocks", rope=RotaryTables(transformer.rope)),
            WanHead(transformer)]
