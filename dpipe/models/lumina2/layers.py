"""Lumina 2's transformer as pipeline layers.

    embed -> context_refiner blocks (caption) -> noise_refiner blocks (image, modulated by t)
          -> join (parameter-free: [caption, image] per item) -> main blocks -> head

This follows `Lumina2Transformer2DModel.forward`: the joint sequence puts each item's caption
tokens first, then its image tokens, whose RoPE positions start at the caption's length. Captions
come cut after the micro-batch's longest (`Lumina2Spec.make_inputs`), so the joint sequence is as
long as the longest item, as in diffusers. `cap_mask` (B, longest caption) marks each caption's
tokens; when every caption has the longest's length (always, for one item) it is empty, (B, 0),
and no block gets a mask: as in diffusers for the joint blocks, where its caption refiner still
masks the tokenizer's padding. RoPE frequencies are recomputed per block from int64 position ids.

Tuples: before the join (x, cap, temb, cap_len, cap_mask, grid); after it (joint, temb, ids,
mask, cap_len, grid), where mask marks each item's tokens in the joint sequence or is empty, and
grid is the latent (height, width) in patches, carried in a shape (`dpipe.models.sync_free`).
"""

from __future__ import annotations

import torch
from torch import nn

from dpipe.models.attention_mask import key_mask, has_padding, padding_mask
from dpipe.models.common.stage_io import needs_grad
from dpipe.models.spec import PipelineLayer
from dpipe.models.sync_free import carrier, sizes


def _image_ids(cap_len: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, h*w, 3): (caption length, row, column) for each patch, as Lumina2RotaryPosEmbed."""
    b, device = cap_len.shape[0], cap_len.device
    ids = torch.zeros(b, h * w, 3, dtype=torch.long, device=device)
    ids[..., 0] = cap_len[:, None]
    ids[..., 1] = torch.arange(h, device=device).repeat_interleave(w)[None]
    ids[..., 2] = torch.arange(w, device=device).repeat(h)[None]
    return ids


def _freqs(rope: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Lumina2RotaryPosEmbed's frequencies for position ids. Its tables are a plain list of CPU
    tensors, which it copies to the ids' device on every call (a host sync each time on a GPU):
    they move once here."""
    if rope.freqs_cis[0].device != ids.device:
        rope.freqs_cis = [table.to(ids.device) for table in rope.freqs_cis]
    return rope._get_freqs_cis(ids)


class Lumina2Embed(PipelineLayer):
    def __init__(self, transformer: nn.Module):
        super().__init__()
        self.adopt("time_caption_embed", transformer.time_caption_embed, "time_caption_embed")
        self.adopt("x_embedder", transformer.x_embedder, "x_embedder")
        self.patch = transformer.config.patch_size

    def forward(self, inputs):
        latents, t, cap, cap_len, cap_mask = inputs
        temb, cap = self.time_caption_embed(latents, t, cap)
        b, c, h, w = latents.shape
        p = self.patch
        x = latents.view(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1).flatten(3).flatten(1, 2)
        x = self.x_embedder(x)
        grid = carrier(h // p, w // p, device=latents.device)
        return (needs_grad(x), needs_grad(cap), needs_grad(temb), cap_len.long(), cap_mask,
                grid)


class Lumina2Refiner(PipelineLayer):
    """A context_refiner block (caption tokens, masked to each caption's length) or a
    noise_refiner block (image tokens, modulated by t)."""

    def __init__(self, block: nn.Module, rope: nn.Module, source_name: str, stream: str):
        super().__init__()
        self.adopt("block", block, source_name)
        self.adopt("rope", rope, "rope_embedder")  # no weights
        self.stream = stream

    def forward(self, inputs):
        x, cap, temb, cap_len, cap_mask, grid = inputs
        if self.stream == "caption":
            b, lc = cap.shape[:2]
            pos = torch.arange(lc, device=cap.device)
            ids = torch.zeros(b, lc, 3, dtype=torch.long, device=cap.device)
            ids[..., 0] = pos[None]
            freqs = _freqs(self.rope, ids)
            mask = None
            if has_padding(cap_mask):
                mask = cap_mask.bool()
                # diffusers zeroes the frequencies past each caption (those tokens are masked out)
                freqs = freqs * mask[..., None]
            cap = self.block(cap, mask, freqs)
        else:
            freqs = _freqs(self.rope, _image_ids(cap_len, *sizes(grid)))
            x = self.block(x, None, freqs, temb)
        return x, cap, temb, cap_len, cap_mask, grid


class Lumina2Join(PipelineLayer):
    """Per item: [caption[:cap_len], image tokens], then zeros up to the longest item's length."""

    def forward(self, inputs):
        x, cap, temb, cap_len, cap_mask, grid = inputs
        b, lc, d = cap.shape
        li = x.shape[1]
        length = lc + li
        pos = torch.arange(length, device=x.device)[None, :].expand(b, length)
        in_cap = pos < cap_len[:, None]
        in_img = (pos >= cap_len[:, None]) & (pos < cap_len[:, None] + li)
        # Gather from [cap, x, one zero row]: caption index, image index + lc, or the zero row.
        source = torch.cat([cap, x, cap.new_zeros(b, 1, d)], dim=1)
        index = torch.where(in_cap, pos, torch.where(in_img, pos - cap_len[:, None] + lc, lc + li))
        joint = torch.gather(source, 1, index[..., None].expand(b, length, d))
        ids = torch.zeros(b, length, 3, dtype=torch.long, device=x.device)
        ids[..., 0] = torch.where(in_cap, pos, 0)
        img_ids = _image_ids(cap_len, *sizes(grid))
        img_index = (pos - cap_len[:, None]).clamp(0, li - 1)
        img_part = torch.gather(img_ids, 1, img_index[..., None].expand(b, length, 3))
        ids = torch.where(in_img[..., None], img_part, ids)
        mask = key_mask(cap_len + li, length).long() if has_padding(cap_mask) else cap_mask
        return joint, temb, ids, mask, cap_len, grid


class Lumina2Block(PipelineLayer):
    def __init__(self, block: nn.Module, rope: nn.Module, source_name: str):
        super().__init__()
        self.adopt("block", block, source_name)
        self.adopt("rope", rope, "rope_embedder")

    def forward(self, inputs):
        joint, temb, ids, mask, cap_len, grid = inputs
        joint = self.block(joint, padding_mask(mask), _freqs(self.rope, ids), temb)
        return joint, temb, ids, mask, cap_len, grid


class Lumina2Head(PipelineLayer):
    def __init__(self, transformer: nn.Module):
        super().__init__()
        self.adopt("norm_out", transformer.norm_out, "norm_out")
        self.patch = transformer.config.patch_size
        self.out_channels = transformer.out_channels

    def forward(self, inputs):
        joint, temb, _ids, _mask, cap_len, grid = inputs
        out = self.norm_out(joint, temb)
        b, _, d = out.shape
        h, w = sizes(grid)
        index = cap_len[:, None] + torch.arange(h * w, device=out.device)[None, :]
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
