"""HunyuanVideo 1.5's transformer as pipeline layers: embed -> double-stream blocks -> head.

The embedder does what the diffusers forward does before its blocks: the Qwen2.5-VL text through
the token refiner, the ByT5 glyph text and the (zero, for text-to-video) SigLIP image tokens
through their projections, each tagged with its `cond_type_embed`, then per sample the valid tokens
moved to the front. Both text streams come cut after their longest prompt, and the ordered
tokens are cut after the sample with the most real ones (`joint_mask`, from
`HunyuanVideo15Spec.make_inputs`): the 729 zero image tokens of text-to-video, always masked,
never reach a block. Layers pass (hidden, text, temb, text_mask, grid): `text_mask` (B, L) is
int64, or (B, 0) with nothing to mask (one prompt per micro-batch), when the blocks attend
unmasked, and otherwise mask only the keys (`attention.py`); `grid` carries (f, h, w) in its
shape (`dpipe.models.sync_free`); both travel without gradients; the rotary embedding is rebuilt
per block.
"""

from __future__ import annotations

import torch
from torch import nn

from dpipe.models.attention_mask import has_padding, padding_mask, real_tokens
from dpipe.models.common.stage_io import needs_grad
from dpipe.models.hunyuan_video.layers import HunyuanVideoHead, rotary
from dpipe.models.hunyuan_video.hunyuan_video15.attention import mask_keys_only
from dpipe.models.spec import PipelineLayer, block_layers
from dpipe.models.sync_free import carrier, valid_first

# HunyuanVideo15Pipeline.vision_num_semantic_tokens: the SigLIP tokens the pipeline always passes
# (zeros for text-to-video).
IMAGE_TOKENS = 729


class HunyuanVideo15Embed(PipelineLayer):
    parts = ("x_embedder", "image_embedder", "context_embedder", "context_embedder_2",
             "time_embed", "cond_type_embed")

    def __init__(self, transformer: nn.Module):
        super().__init__(transformer)
        self.image_dim = transformer.config.image_embed_dim
        self.patch, self.patch_t = transformer.config.patch_size, transformer.config.patch_size_t

    def forward(self, inputs):
        x, t, text, text_mask, glyph, glyph_mask, joint_mask = inputs
        b = x.shape[0]
        timestep = t * 1000  # the pipeline passes the scheduler's timesteps, sigma * 1000
        temb = self.time_embed(timestep)
        hidden = self.x_embedder(x).contiguous()  # a transposed view: stages send contiguous
        text = self.context_embedder(text, timestep,
                                     text_mask if has_padding(text_mask) else None)
        text = text + self.cond_type_embed(torch.zeros_like(text[:, :, 0], dtype=torch.long))
        glyph = self.context_embedder_2(glyph)
        glyph = glyph + self.cond_type_embed(torch.ones_like(glyph[:, :, 0], dtype=torch.long))
        # Text-to-video: the pipeline's all-zero image embeddings, zeroed and masked out.
        image = self.image_embedder(x.new_zeros(b, IMAGE_TOKENS, self.image_dim)) * 0.0
        image = image + self.cond_type_embed(2 * torch.ones_like(image[:, :, 0], dtype=torch.long))
        image_mask = torch.zeros(b, IMAGE_TOKENS, dtype=torch.bool, device=x.device)
        text_mask, glyph_mask = real_tokens(text_mask, text), real_tokens(glyph_mask, glyph)
        # Per sample: the valid tokens first (image, glyph, text), then the invalid ones (glyph and
        # text zeroed), as diffusers orders them; past the most real tokens of any sample, only
        # invalid ones: cut.
        tokens, _ = valid_first(
            torch.cat([image, torch.where(glyph_mask[..., None], glyph, 0.0),
                       torch.where(text_mask[..., None], text, 0.0)], dim=1),
            torch.cat([image_mask, glyph_mask, text_mask], dim=1))
        kept = joint_mask.shape[1] if has_padding(joint_mask) else glyph.shape[1] + text.shape[1]
        _, _, f, h, w = x.shape
        grid = carrier(f // self.patch_t, h // self.patch, w // self.patch, device=x.device)
        return (needs_grad(hidden), needs_grad(tokens[:, :kept].contiguous()), needs_grad(temb),
                joint_mask, grid)


class HunyuanVideo15Block(PipelineLayer):
    parts = ("rope",)

    def __init__(self, transformer: nn.Module, block: nn.Module, source_name: str):
        super().__init__(transformer, block, source_name)
        self.patch, self.patch_t = transformer.config.patch_size, transformer.config.patch_size_t

    def forward(self, inputs):
        hidden, text, temb, text_mask, grid = inputs
        rope = rotary(self.rope, grid, self.patch, self.patch_t, hidden.device)
        # None when nothing is padded: SDPA may run flash.
        hidden, text = self.block(hidden, text, temb, padding_mask(text_mask), rope)
        return hidden, text, temb, text_mask, grid


def hunyuan_video15_layers(transformer: nn.Module) -> list[PipelineLayer]:
    if transformer.config.use_meanflow:
        raise NotImplementedError("HunyuanVideo 1.5 MeanFlow (super-resolution) transformers are "
                                  "not supported; use a 480p/720p text-to-video checkpoint")
    mask_keys_only(transformer)  # diffusers' processor builds an S x S mask per call
    return [HunyuanVideo15Embed(transformer),
            *block_layers(HunyuanVideo15Block, transformer, "transformer_blocks"),
            HunyuanVideoHead(transformer)]
