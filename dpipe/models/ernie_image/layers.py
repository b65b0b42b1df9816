"""ERNIE-Image's single-stream transformer as pipeline layers: embed -> blocks -> head.

The first layer takes (image, t, text, text_lens): the patchified noisy latents (B, C, h, w), t in
[0, 1], the text states (B, T, D) zero-padded past each prompt and the prompt lengths (int64,
(B,)). It runs the patch and text projections and the timestep embedding; every layer after it
passes (hidden, temb, modulation, text_lens, grid): the joint [image, text] sequence in the
transformer's sequence-first layout (S, B, H), the timestep embedding (for the head), its 6-way
block modulation (B, 6H), the lengths and the latent grid carried in a shape
(`dpipe.models.sync_free`). RoPE and the key-padding mask are rebuilt per block from the lengths,
the grid and the text length as `ErnieImageTransformer2DModel.forward` builds them; integers
cross stage boundaries without gradients.
"""

from __future__ import annotations

import torch
from torch import nn

from dpipe.models.common.shapes import unpatchify
from dpipe.models.common.stage_io import keep_in_graph, needs_grad
from dpipe.models.spec import PipelineLayer, block_layers
from dpipe.models.sync_free import carrier, sizes


def positions(text_lens: torch.Tensor, text_tokens: int, h: int, w: int) -> torch.Tensor:
    """(B, N + T, 3) position ids as the transformer's forward makes them: image tokens at
    (text length, y, x), text tokens at (i, 0, 0)."""
    b, device = text_lens.shape[0], text_lens.device
    text_ids = torch.zeros((b, text_tokens, 3), device=device)
    text_ids[..., 0] = torch.arange(text_tokens, device=device, dtype=torch.float32)
    grid = torch.stack(torch.meshgrid(torch.arange(h, device=device, dtype=torch.float32),
                                      torch.arange(w, device=device, dtype=torch.float32),
                                      indexing="ij"), dim=-1).reshape(-1, 2)
    image_ids = torch.cat([text_lens.float().view(b, 1, 1).expand(-1, h * w, -1),
                           grid.view(1, h * w, 2).expand(b, -1, -1)], dim=-1)
    return torch.cat([image_ids, text_ids], dim=1)


def rotary(pos_embed: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """`ErnieImageEmbedND3.forward` on `ids`, (B, S, 1, head_dim). Its `rope` opens an autocast
    context for the ids' device, which fails on the meta device (the harness's host-sync check);
    here the angles are an elementwise float32 product, which autocast leaves in float32, equal
    bit for bit to its one-term einsum."""
    parts = []
    for i, dim in enumerate(pos_embed.axes_dim):
        scale = torch.arange(0, dim, 2, dtype=torch.float32, device=ids.device) / dim
        omega = 1.0 / (pos_embed.theta**scale)
        parts.append((ids[..., i, None].float() * omega).float())
    emb = torch.cat(parts, dim=-1).unsqueeze(2)
    return torch.stack([emb, emb], dim=-1).reshape(*emb.shape[:-1], -1)


def key_mask(text_lens: torch.Tensor, text_tokens: int, image_tokens: int) -> torch.Tensor:
    """(B, 1, 1, N + T) bool: every image token, the text tokens before each prompt's length."""
    b, device = text_lens.shape[0], text_lens.device
    text = torch.arange(text_tokens, device=device).view(1, -1) < text_lens.view(b, 1)
    image = torch.ones((b, image_tokens), device=device, dtype=torch.bool)
    return torch.cat([image, text], dim=1)[:, None, None, :]


class ErnieImageEmbed(PipelineLayer):
    # text_proj is None where text_in_dim == hidden_size.
    parts = ("x_embedder", "text_proj", "time_proj", "time_embedding", "adaLN_modulation")

    def __init__(self, transformer: nn.Module):
        super().__init__(transformer)
        self.patch_size = transformer.config.patch_size

    def forward(self, inputs):
        image, t, text, text_lens = inputs
        # As ErnieImageTransformer2DModel.forward up to its block loop; the pipeline passes the
        # scheduler's timestep, t * 1000.
        _, _, h, w = image.shape
        hidden = self.x_embedder(image).transpose(0, 1).contiguous()
        text = text.to(image.dtype)
        if self.text_proj is not None and text.numel() > 0:
            text = self.text_proj(text)
        hidden = torch.cat([hidden, text.transpose(0, 1).contiguous()], dim=0)
        temb = self.time_embedding(self.time_proj(t * 1000).to(image.dtype))
        modulation = self.adaLN_modulation(temb)
        return (needs_grad(hidden), needs_grad(temb), needs_grad(modulation), text_lens.long(),
                carrier(h // self.patch_size, w // self.patch_size, device=image.device))


class ErnieImageBlock(PipelineLayer):
    parts = ("pos_embed",)

    def forward(self, inputs):
        hidden, temb, modulation, text_lens, grid = inputs
        h, w = sizes(grid)
        text_tokens = hidden.shape[0] - h * w
        rope = rotary(self.pos_embed, positions(text_lens, text_tokens, h, w))
        mask = key_mask(text_lens, text_tokens, h * w)
        # (1, B, H) broadcasts over the sequence as the forward's expanded copies do.
        parts = [m.unsqueeze(0) for m in modulation.chunk(6, dim=-1)]
        hidden = self.block(hidden, rope, parts, mask)
        return hidden, temb, modulation, text_lens, grid


class ErnieImageHead(PipelineLayer):
    parts = ("final_norm", "final_linear")

    def __init__(self, transformer: nn.Module):
        super().__init__(transformer)
        self.patch_size = transformer.config.patch_size
        self.out_channels = transformer.config.out_channels

    def forward(self, inputs):
        hidden, temb, modulation, _text_lens, grid = inputs
        h, w = sizes(grid)
        x = self.final_norm(hidden, temb).type_as(hidden)
        patches = self.final_linear(x)[:h * w].transpose(0, 1).contiguous()
        out = unpatchify(patches, h, w, self.patch_size, self.out_channels)
        # The block modulation ends unused here; alone on the last stage it still needs a
        # gradient.
        return keep_in_graph(out, modulation)


def ernie_image_layers(transformer: nn.Module) -> list[PipelineLayer]:
    return [ErnieImageEmbed(transformer), *block_layers(ErnieImageBlock, transformer, "layers"),
            ErnieImageHead(transformer)]
