"""Ideogram 4's single-stream transformer as pipeline layers: embed -> blocks -> head.

The first layer takes (image, t, text, text_lens, grid): the noisy image tokens (B, N, 4C) in
the pipeline's 2x2-patch layout, dpipe's t in [0, 1] (1 = noise), the text features (B, T, F)
left-padded as `Ideogram4Pipeline.encode_prompt` pads them, each prompt's token count (int64,
(B,)) and the latent grid in patches, carried in a shape (`dpipe.models.sync_free`). It builds
the packed [left padding | text | image] layout of `Ideogram4Pipeline._prepare_ids` on the
device (no host sync), runs the input, text and timestep projections, and every layer after it
passes (hidden, adaln, position_ids, segment_ids, grid): the packed sequence, the blocks' AdaLN
input (B, 1, A), the (t, h, w) positions, the segment ids and the grid. RoPE and the
block-diagonal mask are rebuilt per block; integers cross stage boundaries without gradients.

The transformer gets model time 1 - t (0 = noise) and predicts x0 - noise: the pipeline steps
the scheduler with its negation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpipe.models.common.stage_io import needs_grad
from dpipe.models.spec import PipelineLayer, block_layers
from dpipe.models.sync_free import sizes

# From diffusers' transformer_ideogram4 (the values the pipeline's _prepare_ids writes).
PAD, IMAGE, TEXT = -1, 2, 3
IMAGE_POSITION_OFFSET = 65536


def packed_ids(text_lens: torch.Tensor, text_tokens: int, h: int, w: int):
    """(position_ids (B, S, 3), segment_ids (B, S), indicator (B, S)) as
    `Ideogram4Pipeline._prepare_ids` makes them for left-padded text of `text_tokens` slots,
    computed from the lengths on their device."""
    b, device = text_lens.shape[0], text_lens.device
    slot = torch.arange(text_tokens, device=device).view(1, -1)
    text_pos = slot - (text_tokens - text_lens.view(b, 1))  # < 0 on padding
    is_text = text_pos >= 0
    text_ids = (text_pos * is_text).unsqueeze(-1).expand(b, text_tokens, 3)
    ys, xs = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device),
                            indexing="ij")
    image = torch.stack([torch.zeros_like(ys), ys, xs], dim=-1).reshape(1, h * w, 3)
    position_ids = torch.cat([text_ids, (image + IMAGE_POSITION_OFFSET).expand(b, -1, -1)], 1)
    ones = torch.ones((b, h * w), dtype=torch.long, device=device)
    segment_ids = torch.cat([torch.where(is_text, 1, PAD), ones], dim=1)
    indicator = torch.cat([torch.where(is_text, TEXT, 0), ones * IMAGE], dim=1)
    return position_ids, segment_ids, indicator


def rotary(theta: float, head_dim: int, section: tuple, position_ids: torch.Tensor,
           dtype: torch.dtype) -> tuple:
    """`Ideogram4MRoPE.forward`: its one-term matmul as an elementwise float32 product (equal bit
    for bit), without the autocast context it opens, which fails on the meta device (the
    harness's host-sync check). Its `inv_freq` is recomputed as its __init__ makes it: a
    non-persistent buffer is not loaded with a stage's weights."""
    device = position_ids.device
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    pos = position_ids.permute(2, 0, 1).float()
    freqs = pos.unsqueeze(-1) * inv_freq.to(device)  # (3, B, L, head_dim / 2)
    freqs_t = freqs[0].clone()
    for axis in (1, 2):
        idx = torch.arange(axis, section[axis] * 3, 3, device=device)
        freqs_t[..., idx] = freqs[axis][..., idx]
    emb = torch.cat((freqs_t, freqs_t), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def segment_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    return (segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1)).unsqueeze(1)


class Ideogram4Embed(PipelineLayer):
    parts = ("input_proj", "llm_cond_norm", "llm_cond_proj", "t_embedding", "adaln_proj",
             "embed_image_indicator")

    def forward(self, inputs):
        image, t, text, text_lens, grid = inputs
        h, w = sizes(grid)
        text_tokens = text.shape[1]
        position_ids, segment_ids, indicator = packed_ids(text_lens, text_tokens, h, w)
        # As Ideogram4Transformer2DModel.forward up to its block loop, each projection over the
        # rows it keeps: the forward zeroes the text rows' input projection and the image rows'
        # text projection (its image rows carry zero features), so those rows are 0 here too.
        text_mask = (indicator[:, :text_tokens] == TEXT).to(image.dtype).unsqueeze(-1)
        text = self.llm_cond_proj(self.llm_cond_norm(text.to(image.dtype) * text_mask))
        hidden = torch.cat([text * text_mask, self.input_proj(image)], dim=1)
        hidden = hidden + self.embed_image_indicator((indicator == IMAGE).long())
        t_cond = self.t_embedding((1.0 - t).to(image.dtype)).unsqueeze(1)
        adaln = F.silu(self.adaln_proj(t_cond))
        return needs_grad(hidden), needs_grad(adaln), position_ids, segment_ids, grid


class Ideogram4Block(PipelineLayer):
    def __init__(self, transformer: nn.Module, block: nn.Module, source_name: str):
        super().__init__(transformer, block, source_name)
        config = transformer.config
        self.rope = (config.rope_theta, config.attention_head_dim, tuple(config.mrope_section))

    def forward(self, inputs):
        hidden, adaln, position_ids, segment_ids, grid = inputs
        rope = rotary(*self.rope, position_ids, hidden.dtype)
        hidden = self.block(hidden, segment_mask(segment_ids), rope, adaln)
        return hidden, adaln, position_ids, segment_ids, grid


class Ideogram4Head(PipelineLayer):
    parts = ("final_layer",)

    def forward(self, inputs):
        hidden, adaln, _position_ids, _segment_ids, grid = inputs
        h, w = sizes(grid)
        # Per token: the image tokens alone, as the pipeline keeps them.
        return self.final_layer(hidden[:, -h * w:], conditioning=adaln)


def ideogram4_layers(transformer: nn.Module) -> list[PipelineLayer]:
    return [Ideogram4Embed(transformer), *block_layers(Ideogram4Block, transformer, "layers"),
            Ideogram4Head(transformer)]
