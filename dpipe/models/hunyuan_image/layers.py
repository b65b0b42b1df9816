"""HunyuanImage 2.1's transformer as pipeline layers: embed (+ the first dual-stream block) ->
dual-stream blocks -> single-stream blocks -> head.

Every layer passes (hidden, text_hidden, temb, text_mask, size). The embed layer runs the token
refiner on the Qwen embeddings, projects the ByT5 glyph embeddings and orders the text tokens as
diffusers does (valid ByT5, valid Qwen, then the padding of each); `text_mask` (int64, 1 = a real
token) and `size` (the latent height and width in its shape, `dpipe.models.sync_free`) cross
stage boundaries without gradients.
Both text streams come cut after their longest prompt, and `joint_mask` is the ordered text's
mask, cut after the sample with the most real tokens (`HunyuanImageSpec.make_inputs`, on the
CPU). A mask with nothing to mask is empty, (B, 0): then the refiner pools every token, the
ordering is skipped, and the blocks attend unmasked.
Each block rebuilds the attention mask (in the form `model.attention`'s kernel takes) and the
rotary embedding from them.
"""

from __future__ import annotations

import torch
from torch import nn

from dpipe.config.schema import AttentionKernel
from dpipe.models.attention_mask import has_padding, key_padding_mask, padding_mask, real_tokens
from dpipe.models.common.stage_io import keep_in_graph, needs_grad
from dpipe.models.spec import PipelineLayer, block_layers
from dpipe.models.sync_free import carrier, sizes, valid_first


def order_text(text, mask, glyph, glyph_mask):
    """diffusers' order of the joint text tokens: valid glyph, valid text, glyph padding, text
    padding (per sample, as HunyuanImageTransformer2DModel.forward). Masks may be empty."""
    tokens = torch.cat([glyph, text], dim=1)
    if not (has_padding(mask) or has_padding(glyph_mask)):
        return tokens  # all real: already in that order
    real = torch.cat([real_tokens(glyph_mask, glyph), real_tokens(mask, text)], dim=1)
    return valid_first(tokens, real)[0]


class HunyuanImageEmbed(PipelineLayer):
    """The embedders, followed by the first dual-stream block: under LoRA the embedders are frozen,
    and a stage holding them alone would have nothing to train (the ByT5 projection's fixed
    2048-wide MLP outweighs every block of a small model)."""

    parts = ("rope", "x_embedder", "context_embedder", "time_guidance_embed",  # rope: no weights
             "context_embedder_2")

    def __init__(self, transformer: nn.Module, attention: AttentionKernel):
        super().__init__(transformer, transformer.transformer_blocks[0], "transformer_blocks.0")
        self.attention = attention
        self.guidance = bool(transformer.config.guidance_embeds)
        self.meanflow = bool(transformer.config.use_meanflow)

    def forward(self, inputs):
        latents, timestep, text, mask, glyph, glyph_mask, guidance, joint_mask = inputs[:8]
        h, w = latents.shape[-2:]
        # Meanflow (distilled) models take the interval [r, t]; r = t is the plain flow velocity
        # (training). Sampling passes the pipeline's r (the next timestep) as a ninth input.
        timestep_r = inputs[8] if len(inputs) > 8 else timestep
        temb = self.time_guidance_embed(
            timestep, guidance=guidance if self.guidance else None,
            timestep_r=timestep_r if self.meanflow else None)
        hidden = self.x_embedder(latents)
        text_hidden = self.context_embedder(text, timestep, padding_mask(mask))
        if self.context_embedder_2 is not None:
            text_hidden = order_text(text_hidden, mask, self.context_embedder_2(glyph), glyph_mask)
            if has_padding(joint_mask):  # past the longest sample's real tokens: padding only
                text_hidden = text_hidden[:, :joint_mask.shape[1]]
            mask = joint_mask
        size = carrier(h, w, device=latents.device)
        hidden, text_hidden, temb, mask, size = run_block(
            self.block, self.rope, self.attention, (hidden, text_hidden, temb, mask.long(), size))
        return needs_grad(hidden), needs_grad(text_hidden), needs_grad(temb), mask, size


def run_block(block: nn.Module, rope: nn.Module, attention: AttentionKernel, inputs):
    hidden, text_hidden, temb, mask, size = inputs
    rotary = rope(hidden.new_empty((1, 1, *sizes(size))))
    attention_mask = None  # no padding left: SDPA may run flash
    if has_padding(mask):
        valid_keys = nn.functional.pad(mask.bool(), (hidden.shape[1], 0), value=True)
        attention_mask = key_padding_mask(valid_keys, attention)
    hidden, text_hidden = block(hidden, text_hidden, temb, attention_mask=attention_mask,
                                image_rotary_emb=rotary)
    # Single blocks return slices of the joint sequence; tensors sent between stages must be
    # contiguous.
    return hidden.contiguous(), text_hidden.contiguous(), temb, mask, size


class HunyuanImageBlock(PipelineLayer):
    """A dual-stream or single-stream block; both take and return (image, text) streams."""

    parts = ("rope",)

    def __init__(self, transformer: nn.Module, block: nn.Module, source_name: str,
                 attention: AttentionKernel):
        super().__init__(transformer, block, source_name)
        self.attention = attention

    def forward(self, inputs):
        return run_block(self.block, self.rope, self.attention, inputs)


class HunyuanImageHead(PipelineLayer):
    parts = ("norm_out", "proj_out")

    def __init__(self, transformer: nn.Module):
        super().__init__(transformer)
        self.patch = tuple(int(p) for p in transformer.config.patch_size)
        self.out_channels = int(transformer.config.out_channels)

    def forward(self, inputs):
        hidden, text_hidden, temb, _mask, size = inputs
        out = self.proj_out(self.norm_out(hidden, temb))
        (ph, pw), c = self.patch, self.out_channels
        h, w = (n // p for n, p in zip(sizes(size), self.patch))
        out = out.reshape(out.shape[0], h, w, c, ph, pw).permute(0, 3, 1, 4, 2, 5)
        out = out.reshape(out.shape[0], c, h * ph, w * pw).contiguous()  # a view when p = 1
        # The text stream ends unused; it still needs a gradient when it crossed a stage boundary.
        return keep_in_graph(out, text_hidden)


def hunyuan_image_layers(transformer: nn.Module, attention: AttentionKernel) -> list[PipelineLayer]:
    if len(transformer.config.patch_size) != 2:
        raise ValueError("dpipe's hunyuan_image family trains image (2-D patch) transformers only")
    blocks = block_layers(HunyuanImageBlock, transformer, "transformer_blocks",
                          "single_transformer_blocks", attention=attention)
    # The first block runs in the embed layer.
    return [HunyuanImageEmbed(transformer, attention), *blocks[1:], HunyuanImageHead(transformer)]
