"""SD3's transformer (MMDiT) as pipeline layers: embed -> joint blocks -> head.

Between layers travels (hidden, text_hidden, temb, size): `size` carries the latent (height,
width) in its shape (`sync_free.carrier`: no values, so reading it on the next stage's GPU makes no
host sync), which the head needs to unpatchify. SD3 has no rotary embeddings: positions are added once, by the patch embedding. The last
joint block is `context_pre_only` (it reads the text stream but returns none), so from there on
the tuple is (hidden, temb, size).
"""

from __future__ import annotations

import torch
from torch import nn

from dpipe.models.common.shapes import unpatchify
from dpipe.models.common.stage_io import needs_grad
from dpipe.models.spec import PipelineLayer, block_layers
from dpipe.models.sync_free import carrier, sizes


class SD3Embed(PipelineLayer):
    parts = ("pos_embed", "time_text_embed", "context_embedder")

    def forward(self, inputs):
        latents, t, text, pooled = inputs
        size = carrier(*latents.shape[-2:], device=latents.device)
        # PatchEmbed's output is a non-contiguous view (as in SD3Transformer2DModel.forward).
        hidden = self.pos_embed(latents).contiguous()
        # StableDiffusion3Pipeline passes the scheduler's timesteps, t * 1000, unscaled.
        temb = self.time_text_embed(t.to(hidden.dtype) * 1000, pooled)
        text_hidden = self.context_embedder(text)
        return needs_grad(hidden), needs_grad(text_hidden), needs_grad(temb), size

    def denoiser_state_dict(self, trainable_only: bool) -> dict[str, torch.Tensor]:
        out = super().denoiser_state_dict(trainable_only)
        if not trainable_only:
            # The cropped sin-cos table is a persistent buffer of the real checkpoints: a full
            # export keeps it, so the folder holds every key `from_pretrained` expects.
            out["pos_embed.pos_embed"] = self.pos_embed.pos_embed.detach()
        return out


class SD3Block(PipelineLayer):
    def __init__(self, transformer: nn.Module, block: nn.Module, source_name: str):
        super().__init__(transformer, block, source_name)
        self.last = bool(block.context_pre_only)

    def forward(self, inputs):
        hidden, text_hidden, temb, size = inputs
        text_hidden, hidden = self.block(
            hidden_states=hidden, encoder_hidden_states=text_hidden, temb=temb)
        if self.last:
            return hidden, temb, size
        return hidden, text_hidden, temb, size


class SD3Head(PipelineLayer):
    parts = ("norm_out", "proj_out")

    def __init__(self, transformer: nn.Module):
        super().__init__(transformer)
        self.patch = int(transformer.config.patch_size)
        self.channels = int(transformer.out_channels)

    def forward(self, inputs):
        hidden, temb, size = inputs
        out = self.proj_out(self.norm_out(hidden, temb))
        h, w = (n // self.patch for n in sizes(size))
        return unpatchify(out, h, w, self.patch, self.channels)


def sd3_layers(transformer: nn.Module) -> list[PipelineLayer]:
    return [SD3Embed(transformer), *block_layers(SD3Block, transformer, "transformer_blocks"),
            SD3Head(transformer)]
