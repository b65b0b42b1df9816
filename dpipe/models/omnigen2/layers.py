"""OmniGen2's transformer (`dpipe.models.omnigen2.transformer`) as pipeline layers, text-to-image.

    embed -> context_refiner blocks (caption) -> noise_refiner blocks (image, modulated by t)
          -> join (parameter-free: [caption, image] per item) -> main blocks -> head

As the transformer's forward: each item's caption tokens first (RoPE (i, i, i)), then its image
tokens (RoPE (caption length, row, column)). Captions come cut after the micro-batch's longest
(`OmniGen2Spec.make_inputs`); `cap_mask` (B, longest caption) marks their tokens, or is empty,
(B, 0), when every caption has the longest's length, and then no block gets a mask (the reference
passes an all-true one: the same numbers).

Tuples: before the join (x, cap, temb, cap_len, cap_mask, grid); after it (joint, temb, ids,
mask, cap_len, grid), where mask marks each item's tokens in the joint sequence or is empty, and
grid is the latent (height, width) in patches, carried in a shape (`dpipe.models.sync_free`).
The reference-image weights (editing) are in no layer: `OmniGen2Spec.export_full` copies them
from the base model.
"""

from __future__ import annotations

import torch
from torch import nn

from dpipe.models.attention_mask import has_padding, key_mask, padding_mask
from dpipe.models.common.stage_io import needs_grad
from dpipe.models.omnigen2.transformer import (
    caption_ids, image_ids, join, patchify, rope_frequencies, unpatchify)
from dpipe.models.spec import PipelineLayer
from dpipe.models.sync_free import carrier, sizes


class OmniGen2Embed(PipelineLayer):
    def __init__(self, transformer: nn.Module):
        super().__init__()
        self.adopt("time_caption_embed", transformer.time_caption_embed, "time_caption_embed")
        self.adopt("x_embedder", transformer.x_embedder, "x_embedder")
        self.patch = transformer.config.patch_size

    def forward(self, inputs):
        latents, t, cap, cap_len, cap_mask = inputs
        temb, cap = self.time_caption_embed(t, cap, latents.dtype)
        x = self.x_embedder(patchify(latents, self.patch))
        h, w = latents.shape[-2] // self.patch, latents.shape[-1] // self.patch
        return (needs_grad(x), needs_grad(cap), needs_grad(temb), cap_len.long(), cap_mask,
                carrier(h, w, device=latents.device))


class OmniGen2Refiner(PipelineLayer):
    """A context_refiner block (caption tokens, masked to each caption's length) or a
    noise_refiner block (image tokens, modulated by t)."""

    def __init__(self, block: nn.Module, axes: tuple[int, ...], source_name: str, stream: str):
        super().__init__()
        self.adopt("block", block, source_name)
        self.axes, self.stream = axes, stream

    def forward(self, inputs):
        x, cap, temb, cap_len, cap_mask, grid = inputs
        if self.stream == "caption":
            freqs = rope_frequencies(caption_ids(cap.shape[1], cap.shape[0], cap.device), self.axes)
            mask = padding_mask(cap_mask)
            if mask is not None:
                freqs = freqs * mask[..., None]  # zero past each caption, as the reference
            cap = self.block(cap, mask, freqs)
        else:
            x = self.block(x, None, rope_frequencies(image_ids(cap_len, *sizes(grid)), self.axes),
                           temb)
        return x, cap, temb, cap_len, cap_mask, grid


class OmniGen2Join(PipelineLayer):
    """Per item: [caption[:cap_len], image tokens], then zeros up to the longest item."""

    def forward(self, inputs):
        x, cap, temb, cap_len, cap_mask, grid = inputs
        joint, in_cap, in_img = join(cap, cap_len, x)
        b, length = joint.shape[:2]
        ids = torch.where(in_cap[..., None], caption_ids(length, b, joint.device), 0)
        li = x.shape[1]
        offset = (torch.arange(length, device=x.device)[None] - cap_len[:, None]).clamp(0, li - 1)
        img_part = torch.gather(image_ids(cap_len, *sizes(grid)), 1,
                                offset[..., None].expand(b, length, 3))
        ids = torch.where(in_img[..., None], img_part, ids)
        mask = key_mask(cap_len + li, length).long() if has_padding(cap_mask) else cap_mask
        return joint, temb, ids, mask, cap_len, grid


class OmniGen2Block(PipelineLayer):
    def __init__(self, block: nn.Module, axes: tuple[int, ...], source_name: str):
        super().__init__()
        self.adopt("block", block, source_name)
        self.axes = axes

    def forward(self, inputs):
        joint, temb, ids, mask, cap_len, grid = inputs
        joint = self.block(joint, padding_mask(mask), rope_frequencies(ids, self.axes), temb)
        return joint, temb, ids, mask, cap_len, grid


class OmniGen2Head(PipelineLayer):
    def __init__(self, transformer: nn.Module):
        super().__init__()
        self.adopt("norm_out", transformer.norm_out, "norm_out")
        self.patch = transformer.config.patch_size
        self.out_channels = transformer.out_channels

    def forward(self, inputs):
        joint, temb, _ids, _mask, cap_len, grid = inputs
        out = self.norm_out(joint, temb)
        h, w = sizes(grid)
        index = cap_len[:, None] + torch.arange(h * w, device=out.device)[None, :]
        img = torch.gather(out, 1, index[..., None].expand(-1, -1, out.shape[-1]))
        return unpatchify(img, h, w, self.patch, self.out_channels)


def omnigen2_layers(transformer: nn.Module) -> list[PipelineLayer]:
    axes = tuple(transformer.config.axes_dim_rope)
    layers: list[PipelineLayer] = [OmniGen2Embed(transformer)]
    for i, block in enumerate(transformer.context_refiner):
        layers.append(OmniGen2Refiner(block, axes, f"context_refiner.{i}", "caption"))
    for i, block in enumerate(transformer.noise_refiner):
        layers.append(OmniGen2Refiner(block, axes, f"noise_refiner.{i}", "image"))
    layers.append(OmniGen2Join())
    for i, block in enumerate(transformer.layers):
        layers.append(OmniGen2Block(block, axes, f"layers.{i}"))
    layers.append(OmniGen2Head(transformer))
    return layers
