"""Pipeline layers of transformers built from Lumina-Image 2.0's blocks (Lumina 2, OmniGen2).

    embed (the family's) -> context_refiner blocks (caption) -> noise_refiner blocks (image,
          modulated by t) -> join (parameter-free: [caption, image] per item) -> main blocks -> head

Each item's caption tokens come first, then its image tokens, whose RoPE positions start at the
caption's length: (caption length, row, column). Captions come cut after the micro-batch's longest
(the family's `make_inputs`), so the joint sequence is as long as the longest item. `cap_mask`
(B, longest caption) marks each caption's tokens; when every caption has the longest's length
(always, for one item) it is empty, (B, 0), and no block gets a mask.

The families differ in their embedder and in `RotaryPositions`: where a caption token sits on the
three RoPE axes (Lumina 2: (i, 0, 0); OmniGen2: (i, i, i)) and how positions become rotations.

Tuples: the embedder gives (x, cap, temb, cap_len, cap_mask, grid); after the join (joint, temb,
ids, mask, cap_len, grid), where mask marks each item's tokens in the joint sequence or is empty,
and grid is the latent (height, width) in patches, carried in a shape (`dpipe.models.sync_free`).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from dpipe.models.attention_mask import has_padding, key_mask, padding_mask, trim_text_padding
from dpipe.models.common.shapes import patchify, unpatchify
from dpipe.models.common.stage_io import needs_grad
from dpipe.models.spec import NoisedBatch, PipelineLayer, block_layers
from dpipe.models.sync_free import carrier, sizes


class RotaryPositions(Protocol):
    def caption(self, length: int, batch: int, device: torch.device) -> torch.Tensor:
        """(B, length, 3) int64 positions of caption tokens 0..length-1."""

    def rotations(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, L, 3) positions -> the blocks' complex RoPE rotations (B, L, head_dim / 2)."""


def image_ids(cap_len: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, h*w, 3): (caption length, row, column) per patch, row-major."""
    b, device = cap_len.shape[0], cap_len.device
    ids = torch.empty(b, h * w, 3, dtype=torch.long, device=device)
    ids[..., 0] = cap_len[:, None]
    ids[..., 1] = torch.arange(h, device=device).repeat_interleave(w)[None]
    ids[..., 2] = torch.arange(w, device=device).repeat(h)[None]
    return ids


def join(cap: torch.Tensor, cap_len: torch.Tensor, img: torch.Tensor):
    """Per item [cap[:cap_len], img], zero-padded to the longest item: (joint (B, L, D), which
    positions hold caption tokens (B, L), which hold image tokens (B, L))."""
    b, lc, d = cap.shape
    li = img.shape[1]
    length = lc + li
    pos = torch.arange(length, device=img.device)[None, :].expand(b, length)
    in_cap = pos < cap_len[:, None]
    in_img = (pos >= cap_len[:, None]) & (pos < cap_len[:, None] + li)
    # Gather from [cap, img, one zero row]: caption index, image index + lc, or the zero row.
    source = torch.cat([cap, img, cap.new_zeros(b, 1, d)], dim=1)
    index = torch.where(in_cap, pos, torch.where(in_img, pos - cap_len[:, None] + lc, lc + li))
    joint = torch.gather(source, 1, index[..., None].expand(b, length, d))
    return joint, in_cap, in_img


def joint_ids(positions: RotaryPositions, cap_len: torch.Tensor, in_cap: torch.Tensor,
              in_img: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, L, 3) RoPE positions of a joined sequence (`join`); 0 on its padding."""
    b, length = in_cap.shape
    ids = torch.where(in_cap[..., None], positions.caption(length, b, in_cap.device), 0)
    offset = (torch.arange(length, device=in_cap.device)[None] - cap_len[:, None]).clamp(0, h * w - 1)
    img_part = torch.gather(image_ids(cap_len, h, w), 1, offset[..., None].expand(b, length, 3))
    return torch.where(in_img[..., None], img_part, ids)


def image_tokens(out: torch.Tensor, cap_len: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The h*w image tokens of each item of a joined sequence (B, L, D) -> (B, h*w, D)."""
    index = cap_len[:, None] + torch.arange(h * w, device=out.device)[None, :]
    return torch.gather(out, 1, index[..., None].expand(-1, -1, out.shape[-1]))


class LuminaEmbed(PipelineLayer):
    """Patches through `x_embedder`; t and the caption through `time_caption_embed`, whose
    call each family gives in `time_and_caption`."""

    parts = ("time_caption_embed", "x_embedder")

    def __init__(self, transformer: nn.Module):
        super().__init__(transformer)
        self.patch = transformer.config.patch_size

    def time_and_caption(self, latents: torch.Tensor, t: torch.Tensor, cap: torch.Tensor):
        """(temb, embedded caption)."""
        raise NotImplementedError

    def forward(self, inputs):
        latents, t, cap, cap_len, cap_mask = inputs
        temb, cap = self.time_and_caption(latents, t, cap)
        x = self.x_embedder(patchify(latents, self.patch))
        h, w = latents.shape[-2] // self.patch, latents.shape[-1] // self.patch
        return (needs_grad(x), needs_grad(cap), needs_grad(temb), cap_len.long(), cap_mask,
                carrier(h, w, device=latents.device))


class LuminaRefiner(PipelineLayer):
    """A context_refiner block (caption tokens, masked to each caption's length) or a
    noise_refiner block (image tokens, modulated by t)."""

    def __init__(self, transformer: nn.Module, block: nn.Module, source_name: str,
                 positions: RotaryPositions, stream: str):
        super().__init__(transformer, block, source_name)
        self.positions, self.stream = positions, stream

    def forward(self, inputs):
        x, cap, temb, cap_len, cap_mask, grid = inputs
        if self.stream == "caption":
            freqs = self.positions.rotations(
                self.positions.caption(cap.shape[1], cap.shape[0], cap.device))
            mask = padding_mask(cap_mask)
            if mask is not None:
                # Both references zero the rotations past each caption (masked out anyway).
                freqs = freqs * mask[..., None]
            cap = self.block(cap, mask, freqs)
        else:
            x = self.block(x, None, self.positions.rotations(image_ids(cap_len, *sizes(grid))),
                           temb)
        return x, cap, temb, cap_len, cap_mask, grid


class LuminaJoin(PipelineLayer):
    """Per item: [caption[:cap_len], image tokens], then zeros up to the longest item's length."""

    def __init__(self, positions: RotaryPositions):
        super().__init__()
        self.positions = positions

    def forward(self, inputs):
        x, cap, temb, cap_len, cap_mask, grid = inputs
        joint, in_cap, in_img = join(cap, cap_len, x)
        ids = joint_ids(self.positions, cap_len, in_cap, in_img, *sizes(grid))
        length = joint.shape[1]
        mask = key_mask(cap_len + x.shape[1], length).long() if has_padding(cap_mask) else cap_mask
        return joint, temb, ids, mask, cap_len, grid


class LuminaBlock(PipelineLayer):
    def __init__(self, transformer: nn.Module, block: nn.Module, source_name: str,
                 positions: RotaryPositions):
        super().__init__(transformer, block, source_name)
        self.positions = positions

    def forward(self, inputs):
        joint, temb, ids, mask, cap_len, grid = inputs
        joint = self.block(joint, padding_mask(mask), self.positions.rotations(ids), temb)
        return joint, temb, ids, mask, cap_len, grid


class LuminaHead(PipelineLayer):
    parts = ("norm_out",)

    def __init__(self, transformer: nn.Module):
        super().__init__(transformer)
        self.patch = transformer.config.patch_size
        self.out_channels = transformer.out_channels

    def forward(self, inputs):
        joint, temb, _ids, _mask, cap_len, grid = inputs
        h, w = sizes(grid)
        img = image_tokens(self.norm_out(joint, temb), cap_len, h, w)
        return unpatchify(img, h, w, self.patch, self.out_channels)


def lumina_layers(transformer: nn.Module, embed: PipelineLayer,
                  positions: RotaryPositions) -> list[PipelineLayer]:
    """`embed`, the refiners, the join, the main blocks and the head of `transformer`, which
    holds Lumina 2's `context_refiner`, `noise_refiner`, `layers` and `norm_out`."""
    return [embed,
            *block_layers(LuminaRefiner, transformer, "context_refiner", positions=positions,
                          stream="caption"),
            *block_layers(LuminaRefiner, transformer, "noise_refiner", positions=positions,
                          stream="image"),
            LuminaJoin(positions),
            *block_layers(LuminaBlock, transformer, "layers", positions=positions),
            LuminaHead(transformer)]


def lumina_inputs(batch: NoisedBatch) -> tuple[torch.Tensor, ...]:
    """The embedder's input tuple (noisy latents, t, cap, cap_len, cap_mask) from the cached
    caption `cap` and its `cap_mask`. Both families take t with 1 the clean image. The tokenizers
    pad on the right, so each mask is a prefix and its length says it all; captions are cut after
    the longest, on the CPU (with one item nothing is left to mask)."""
    mask = batch.text["cap_mask"] > 0.5
    cap, cap_mask = trim_text_padding(batch.text["cap"], mask)
    return batch.noisy, 1.0 - batch.timesteps, cap, mask.sum(dim=1).long(), cap_mask.long()
