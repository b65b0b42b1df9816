"""Lumina 2's transformer as pipeline layers.

    embed -> context_refiner blocks (caption) -> noise_refiner blocks (image, modulated by t)
          -> join (parameter-free: [caption, image] per item) -> main blocks -> head

This follows `Lumina2Transformer2DModel.forward`: the joint sequence puts each item's caption
tokens first, then its image tokens, whose RoPE positions start at the caption's length. Shapes are
fixed for the run (DeepSpeed sizes its receive buffers once): the joint sequence always has room
for the full padded caption and masks what an item does not use, where diffusers trims it to the
batch's longest caption. RoPE frequencies are recomputed per block from int64 position ids.

Tuples: before the join (x, cap, temb, cap_len, grid); after it (joint, temb, ids, total, cap_len,
grid), with grid the latent (height, width).
"""

from __future__ import annotations

import torch
from torch import nn

from dpipe.models.qwen_image.shared import key_mask, needs_grad
from dpipe.models.spec import PipelineLayer


def _image_ids(cap_len: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, h*w, 3): (caption length, row, column) for each patch, as Lumina2RotaryPosEmbed."""
    b = cap_len.shape[0]
    ids = torch.zeros(b, h * w, 3, dtype=torch.long)
    ids[..., 0] = cap_len[:, None]
    ids[..., 1] = torch.arange(h).repeat_interleave(w)[None]
    ids[..., 2] = torch.arange(w).repeat(h)[None]
    return ids


class Lumina2Embed(PipelineLayer):
    def __init__(self, transformer: nn.Module):
        super().__init__()
        self.adopt("time_caption_embed", transformer.time_caption_embed, "time_caption_embed")
        self.adopt("x_embedder", transformer.x_embedder, "x_embedder")
        self.patch = transformer.config.patch_size

    def forward(self, inputs):
        latents, t, cap, cap_len = inputs
        temb, cap = self.time_caption_embed(latents, t, cap)
        b, c, h, w = latents.shape
        p = self.patch
        x = latents.view(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1).flatten(3).flatten(1, 2)
        x = self.x_embedder(x)
        grid = torch.tensor([[h // p, w // p]] * b, dtype=torch.long)
        return needs_grad(x), needs_grad(cap), needs_grad(temb), cap_len.long(), grid


class Lumina2Refiner(PipelineLayer):
    """A context_refiner block (caption tokens, masked to each caption's length) or a
    noise_refiner block (image tokens, modulated by t)."""

    def __init__(self, block: nn.Module, rope: nn.Module, source_name: str, stream: str):
        super().__init__()
        self.adopt("block", block, source_name)
        self.adopt("rope", rope, "rope_embedder")  # no weights
        self.stream = stream

    def forward(self, inputs):
        x, cap, temb, cap_len, grid = inputs
        if self.stream == "caption":
            b, lc = cap.shape[:2]
            ids = torch.zeros(b, lc, 3, dtype=torch.long)
            ids[..., 0] = torch.arange(lc)[None]
            freqs = self.rope._get_freqs_cis(ids)
            # diffusers zeroes the frequencies past each caption (those tokens are masked out)
            freqs = freqs * (torch.arange(lc)[None, :] < cap_len[:, None])[..., None]
            mask = torch.arange(lc)[None, :] < cap_len[:, None]  # diffusers always passes it
            cap = self.block(cap, mask, freqs)
        else:
            h, w = (int(v) for v in grid[0])
            freqs = self.rope._get_freqs_cis(_image_ids(cap_len, h, w))
            x = self.block(x, None, freqs, temb)
        return x, cap, temb, cap_len, grid


class Lumina2Join(PipelineLayer):
    """Per item: [caption[:cap_len], image tokens], then zeros up to the fixed length."""

    def forward(self, inputs):
        x, cap, temb, cap_len, grid = inputs
        b, lc, d = cap.shape
        li = x.shape[1]
        length = lc + li
        pos = torch.arange(length)[None, :].expand(b, length)
        in_cap = pos < cap_len[:, None]
        in_img = (pos >= cap_len[:, None]) & (pos < cap_len[:, None] + li)
        # Gather from [cap, x, one zero row]: caption index, image index + lc, or the zero row.
        source = torch.cat([cap, x, cap.new_zeros(b, 1, d)], dim=1)
        index = torch.where(in_cap, pos, torch.where(in_img, pos - cap_len[:, None] + lc, lc + li))
        joint = torch.gather(source, 1, index[..., None].expand(b, length, d))
        h, w = (int(v) for v in grid[0])
        ids = torch.zeros(b, length, 3, dtype=torch.long)
        ids[..., 0] = torch.where(in_cap, pos, 0)
        img_ids = _image_ids(cap_len, h, w)
        img_index = (pos - cap_len[:, None]).clamp(0, li - 1)
        img_part = torch.gather(img_ids, 1, img_index[..., None].expand(b, length, 3))
        ids = torch.where(in_img[..., None], img_part, ids)
        total = cap_len + li
        return joint, temb, ids, total, cap_len, grid


class Lumina2Block(PipelineLayer):
    def __init__(self, block: nn.Module, rope: nn.Module, source_name: str):
        super().__init__()
        self.adopt("block", block, source_name)
        self.adopt("rope", rope, "rope_embedder")

    def forward(self, inputs):
        joint, temb, ids, total, cap_len, grid = inputs
        joint = self.block(joint, key_mask(total, joint.shape[1]), self.rope._get_freqs_cis(ids),
                           temb)
        return joint, temb, ids, total, cap_len, grid


class Lumina2Head(PipelineLayer):
    def __init__(self, transformer: nn.Module):
        super().__init__()
        self.adopt("norm_out", transformer.norm_out, "norm_out")
        self.patch = transformer.config.patch_size
        self.out_channels = transformer.out_channels

    def forward(self, inputs):
        joint, temb, _ids, _total, cap_len, grid = inputs
        out = self.norm_out(joint, temb)
        b, _, d = out.shape
        h, w = (int(v) for v in grid[0])
        index = cap_len[:, None] + torch.arange(h * w)[None, :]
        img = torch.gather(out, 1, index[..., None].expand(b, h * w, d))
        p, c = self.patch, self.out_channels
        return img.view(b, h, w, p, p, c).permute(0, 5, 1, 3, 2, 4).flatten(4, 5).flatten(2, 3)


def lumina2_layers(transformer: nn.Module) -> list[PipelineLayer]:
    rope = transformer.rope_embedder
    layers: list[PipelineLayer] = [Lumina2Embed(transformer)]
    for i, block in enumerate(transformer.context_refiner):
        layers.append(Lumina2Refiner(block, rope, f"context_refiner.{i}", "caption"))
    for i, block in enumerate(transformer.noise_refiner):
        layers.append(Lumina2Refiner(block, rope, f"noise_refiner.{i}", "image"))
    layers.append(Lumina2Join())
    for i, block in enumerate(transformer.layers):
        layers.append(Lumina2Block(block, rope, f"layers.{i}"))
    layers.append(Lumina2Head(transformer))
    return layers
