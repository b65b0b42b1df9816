"""LTX-Video's transformer as pipeline layers: embed -> blocks -> head.

Every layer passes (hidden, text_hidden, temb, embedded_t, text_mask, grid, rate): `temb` and
`embedded_t` are per token (B, N, .) when the first frame is a clean condition (its tokens have
t = 0) and (B, 1, .) otherwise; `text_mask` (B, L) is int64, or (B, 0) when the text was cut
with no padding left (then cross-attention runs unmasked); `grid` (latent frames, height,
width) and `rate` (each clip's frame rate in thousandths of a frame per second) are carried in
shapes (`dpipe.models.sync_free`). All three travel between stages without gradients. Rotary
embeddings and the text attention bias are rebuilt in each block from them, as the diffusers
forward builds them once.
"""

from __future__ import annotations

import torch
from torch import nn

from dpipe.models.attention_mask import has_padding
from dpipe.models.common.stage_io import keep_in_graph, needs_grad
from dpipe.models.spec import PipelineLayer, block_layers
from dpipe.models.sync_free import sizes


def frame_rate(rate: torch.Tensor, dims: int):
    """Frames per second from the carried `rate` (thousandths, one per sample): a float when the
    whole batch has one rate (as the pipelines take it), else (B, 1, ...) with `dims` dims."""
    rates = sizes(rate)
    if len(set(rates)) == 1:
        return rates[0] / 1000
    fps = torch.tensor(rates, dtype=torch.float64, device=rate.device) / 1000
    return fps.float().view(-1, *([1] * (dims - 1)))


def rope_scale(ratios: tuple[int, int], rate: torch.Tensor) -> tuple:
    """LTXPipeline's rope_interpolation_scale (temporal ratio / frame rate, spatial, spatial)."""
    spatial, temporal = ratios
    return (temporal / frame_rate(rate, 5), spatial, spatial)


def text_bias(text_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The additive cross-attention bias LTXVideoTransformer3DModel.forward makes of a 0/1 mask;
    None for an empty mask (text cut with no padding left: `dpipe.models.attention_mask`)."""
    if not has_padding(text_mask):
        return None
    return ((1 - text_mask.to(dtype)) * -10000.0).unsqueeze(1)


def time_embedding(time_embed: nn.Module, t: torch.Tensor, batch: int,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(temb, embedded timestep), each (B, 1 or N, D), of the scheduler's timesteps (sigma *
    1000) as the pipelines pass them: per token where the first frame is a given condition
    (t (B, N), 0 on its tokens), else per sample (t (B, 1))."""
    temb, embedded = time_embed((t * 1000).flatten(), batch_size=batch, hidden_dtype=dtype)
    return temb.view(batch, -1, temb.shape[-1]), embedded.view(batch, -1, embedded.shape[-1])


class LTXEmbed(PipelineLayer):
    parts = ("proj_in", "time_embed", "caption_projection")

    def forward(self, inputs):
        packed, t, text, text_mask, grid, rate = inputs
        b = packed.shape[0]
        hidden = self.proj_in(packed)
        temb, embedded = time_embedding(self.time_embed, t, b, hidden.dtype)
        text_hidden = self.caption_projection(text).view(b, -1, hidden.shape[-1])
        return (needs_grad(hidden), needs_grad(text_hidden), needs_grad(temb), needs_grad(embedded),
                text_mask.long(), grid, rate)


class LTXBlock(PipelineLayer):
    parts = ("rope",)

    def __init__(self, transformer: nn.Module, block: nn.Module, source_name: str,
                 ratios: tuple[int, int]):
        super().__init__(transformer, block, source_name)
        self.ratios = ratios  # the VAE's (spatial, temporal) compression

    def forward(self, inputs):
        hidden, text_hidden, temb, embedded, text_mask, grid, rate = inputs
        f, h, w = sizes(grid)
        rope = self.rope(hidden, f, h, w, rope_scale(self.ratios, rate))
        hidden = self.block(hidden_states=hidden, encoder_hidden_states=text_hidden, temb=temb,
                            image_rotary_emb=rope,
                            encoder_attention_mask=text_bias(text_mask, hidden.dtype))
        return hidden, text_hidden, temb, embedded, text_mask, grid, rate


class LTXHead(PipelineLayer):
    # scale_shift_table: a bare parameter of the transformer, kept under its own (dot-free) name.
    parts = ("norm_out", "proj_out", "scale_shift_table")

    def forward(self, inputs):
        hidden, text_hidden, temb, embedded = inputs[:4]  # then the mask, grid, rate
        values = self.scale_shift_table[None, None] + embedded[:, :, None]
        shift, scale = values[:, :, 0], values[:, :, 1]
        out = self.proj_out(self.norm_out(hidden) * (1 + scale) + shift)
        # The text stream and temb end unused here; they still need a gradient when the head is
        # alone on the last stage.
        return keep_in_graph(out, text_hidden, temb)


def ltx_layers(transformer: nn.Module, ratios: tuple[int, int]) -> list[PipelineLayer]:
    return [LTXEmbed(transformer),
            *block_layers(LTXBlock, transformer, "transformer_blocks", ratios=ratios),
            LTXHead(transformer)]
