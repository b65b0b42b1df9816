"""AuraFlow's transformer as pipeline layers: embed -> joint blocks -> single blocks -> head.

Every layer passes (hidden, text_hidden, temb, size). The single (DiT) blocks run on the
concatenation [text; image] as in diffusers; each one concatenates and splits again, which is exact,
so every layer keeps one tuple layout. `size` carries the latent (height, width) in its shape
(`sync_free.carrier`), read on any stage without a host sync.
"""

from __future__ import annotations

import torch
from torch import nn

from dpipe.models.common.shapes import unpatchify
from dpipe.models.common.stage_io import keep_in_graph, needs_grad
from dpipe.models.spec import PipelineLayer, block_layers
from dpipe.models.sync_free import carrier, sizes


class AuraFlowEmbed(PipelineLayer):
    # `register_tokens`: a bare parameter of the transformer, held directly, exported under its
    # own name.
    parts = ("pos_embed", "time_step_embed", "time_step_proj", "context_embedder",
             "register_tokens")

    def forward(self, inputs):
        latents, t, text = inputs
        h, w = latents.shape[-2:]
        hidden = self.pos_embed(latents)
        # The pipeline passes sigma in [0, 1]; `time_step_embed` scales it by 1000 itself.
        temb = self.time_step_proj(self.time_step_embed(t).to(hidden.dtype))
        text_hidden = self.context_embedder(text)
        registers = self.register_tokens.to(text_hidden.dtype)
        text_hidden = torch.cat([registers.expand(text_hidden.shape[0], -1, -1), text_hidden], 1)
        size = carrier(h, w, device=latents.device)
        return needs_grad(hidden.contiguous()), needs_grad(text_hidden), needs_grad(temb), size


class AuraFlowJointBlock(PipelineLayer):
    def forward(self, inputs):
        hidden, text_hidden, temb, size = inputs
        text_hidden, hidden = self.block(hidden_states=hidden, encoder_hidden_states=text_hidden,
                                         temb=temb)
        return hidden, text_hidden, temb, size


class AuraFlowSingleBlock(PipelineLayer):
    def forward(self, inputs):
        hidden, text_hidden, temb, size = inputs
        n_text = text_hidden.shape[1]
        combined = self.block(hidden_states=torch.cat([text_hidden, hidden], 1), temb=temb)
        # Slices of the joint sequence; tensors sent between stages must be contiguous.
        return combined[:, n_text:].contiguous(), combined[:, :n_text].contiguous(), temb, size


class AuraFlowHead(PipelineLayer):
    parts = ("norm_out", "proj_out")

    def __init__(self, transformer: nn.Module):
        super().__init__(transformer)
        self.patch = int(transformer.config.patch_size)
        self.out_channels = int(transformer.config.out_channels)

    def forward(self, inputs):
        hidden, text_hidden, temb, size = inputs
        out = self.proj_out(self.norm_out(hidden, temb))
        h, w = (n // self.patch for n in sizes(size))
        out = unpatchify(out, h, w, self.patch, self.out_channels)
        # The text stream ends unused; it still needs a gradient when it crossed a stage boundary.
        return keep_in_graph(out, text_hidden)


def auraflow_layers(transformer: nn.Module) -> list[PipelineLayer]:
    return [AuraFlowEmbed(transformer),
            *block_layers(AuraFlowJointBlock, transformer, "joint_transformer_blocks"),
            *block_layers(AuraFlowSingleBlock, transformer, "single_transformer_blocks"),
            AuraFlowHead(transformer)]
