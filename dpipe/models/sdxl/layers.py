"""SDXL's UNet as pipeline layers, fine-grained so stages balance.

A UNet is not a chain: each down-path output is used again by the up path (skip connections).
The layers pass one tuple, `(emb, text, *stack)`, where `stack` holds every skip tensor not yet
used, and its last entry is the current hidden state:

- embed: time + size/crop + pooled-text embedding; `conv_in`; stack = [conv_in output]
- down units, one per (resnet [+ transformer]) pair and one per downsampler, as in diffusers'
  down blocks: each takes the top of the stack and pushes its output (every output is a skip);
- mid: the middle block on the top of the stack, pushed (not a skip: the first up unit pops it);
- up units, one per (resnet [+ transformer]) pair and one per upsampler: pop the hidden state
  (and, for a pair, the newest unused skip, concatenated as diffusers does), push the result;
- head: norm, SiLU, conv_out on the last entry.

Every float crossing a stage boundary reaches a later use (each skip is concatenated by exactly
one up unit), so each gets a gradient. The head alone does not use `emb` or `text`; it adds them
times zero so they have a gradient path when they cross a boundary just before it.
"""

from __future__ import annotations

import torch
from torch import nn

from dpipe.models.common.stage_io import keep_in_graph, needs_grad
from dpipe.models.spec import PipelineLayer


class SDXLEmbed(PipelineLayer):
    parts = ("time_proj", "time_embedding", "add_time_proj", "add_embedding", "conv_in",
             "time_embed_act")

    def __init__(self, unet: nn.Module):
        c = unet.config
        if c.addition_embed_type != "text_time" or unet.class_embedding is not None \
                or unet.encoder_hid_proj is not None or c.center_input_sample:
            raise ValueError("this UNet is not in SDXL's layout (text_time conditioning, no class "
                             "embedding or encoder projection); dpipe's sdxl family cannot split it")
        super().__init__(unet)

    def forward(self, inputs):
        sample, timesteps, text, pooled, time_ids = inputs
        # As UNet2DConditionModel.get_time_embed / get_aug_embed ("text_time", SDXL's).
        t_emb = self.time_proj(timesteps.expand(sample.shape[0])).to(sample.dtype)
        emb = self.time_embedding(t_emb)
        time_embeds = self.add_time_proj(time_ids.flatten()).reshape(pooled.shape[0], -1)
        emb = emb + self.add_embedding(torch.cat([pooled, time_embeds], -1).to(emb.dtype))
        if self.time_embed_act is not None:
            emb = self.time_embed_act(emb)
        hidden = self.conv_in(sample)
        return needs_grad(emb), needs_grad(text), needs_grad(hidden)


class SDXLDown(PipelineLayer):
    """A down block's resnet (+ transformer), or its downsampler; pushes its output."""

    def __init__(self, resnet=None, attention=None, downsampler=None, names=()):
        super().__init__()
        for attr, module, name in zip(("resnet", "attention", "downsampler"),
                                      (resnet, attention, downsampler), (*names, None, None)):
            self.adopt(attr, module, name)

    def forward(self, inputs):
        emb, text, *stack = inputs
        hidden = stack[-1]
        if self.downsampler is not None:
            hidden = self.downsampler(hidden)
        else:
            hidden = self.resnet(hidden, emb)
            if self.attention is not None:
                hidden = self.attention(hidden, encoder_hidden_states=text, return_dict=False)[0]
        return (emb, text, *stack, hidden.contiguous())


class SDXLMid(PipelineLayer):
    def __init__(self, mid: nn.Module):
        super().__init__()
        self.adopt("mid", mid, "mid_block")

    def forward(self, inputs):
        emb, text, *stack = inputs
        hidden = self.mid(stack[-1], emb, encoder_hidden_states=text)
        return (emb, text, *stack, hidden.contiguous())


class SDXLUp(PipelineLayer):
    """An up block's resnet (+ transformer) on [hidden, newest skip], or its upsampler."""

    def __init__(self, resnet=None, attention=None, upsampler=None, names=(), upsamplers=0):
        super().__init__()
        for attr, module, name in zip(("resnet", "attention", "upsampler"),
                                      (resnet, attention, upsampler), (*names, None, None)):
            self.adopt(attr, module, name)
        self.overall_up_factor = 2 ** upsamplers

    def forward(self, inputs):
        emb, text, *stack = inputs
        # Sliced, not popped: torch.compile makes the starred target a tuple.
        hidden, stack = stack[-1], stack[:-1]
        if self.upsampler is not None:
            # diffusers passes the next skip's size only when the latent size is not a multiple
            # of the total upsampling factor; stack[0] (conv_in's output) has the latent's size.
            odd = any(d % self.overall_up_factor for d in stack[0].shape[-2:])
            hidden = self.upsampler(hidden, stack[-1].shape[2:] if odd else None)
        else:
            skip, stack = stack[-1], stack[:-1]
            hidden = self.resnet(torch.cat([hidden, skip], dim=1), emb)
            if self.attention is not None:
                hidden = self.attention(hidden, encoder_hidden_states=text, return_dict=False)[0]
        return (emb, text, *stack, hidden.contiguous())


class SDXLHead(PipelineLayer):
    parts = ("conv_norm_out", "conv_out")

    def __init__(self, unet: nn.Module):
        super().__init__(unet)
        self.act = unet.conv_act  # parameter-free

    def forward(self, inputs):
        emb, text, hidden = inputs
        out = self.conv_out(self.act(self.conv_norm_out(hidden)))
        return keep_in_graph(out, emb, text)


def sdxl_layers(unet: nn.Module) -> list[PipelineLayer]:
    layers: list[PipelineLayer] = [SDXLEmbed(unet)]
    for b, block in enumerate(unet.down_blocks):
        attentions = getattr(block, "attentions", None) or [None] * len(block.resnets)
        for i, (resnet, attention) in enumerate(zip(block.resnets, attentions)):
            layers.append(SDXLDown(resnet, attention, names=(
                f"down_blocks.{b}.resnets.{i}", f"down_blocks.{b}.attentions.{i}")))
        for i, down in enumerate(block.downsamplers or []):
            layers.append(SDXLDown(downsampler=down,
                                   names=(None, None, f"down_blocks.{b}.downsamplers.{i}")))
    layers.append(SDXLMid(unet.mid_block))
    upsamplers = sum(1 for block in unet.up_blocks if block.upsamplers)
    for b, block in enumerate(unet.up_blocks):
        attentions = getattr(block, "attentions", None) or [None] * len(block.resnets)
        for i, (resnet, attention) in enumerate(zip(block.resnets, attentions)):
            layers.append(SDXLUp(resnet, attention, names=(
                f"up_blocks.{b}.resnets.{i}", f"up_blocks.{b}.attentions.{i}"),
                upsamplers=upsamplers))
        for i, up in enumerate(block.upsamplers or []):
            layers.append(SDXLUp(upsampler=up, names=(None, None, f"up_blocks.{b}.upsamplers.{i}"),
                                 upsamplers=upsamplers))
    layers.append(SDXLHead(unet))
    return layers
