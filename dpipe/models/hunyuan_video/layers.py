"""HunyuanVideo's transformer as pipeline layers: embed -> double blocks -> single blocks -> head.

Every layer passes (hidden, text_hidden, temb, text_mask, grid). `text_mask` (B, L) is int64, or
(B, 0) when the micro-batch's text has no padding left (`dpipe.models.attention_mask`: then no
attention is masked); `grid` carries the post-patch latent size f, h, w in its shape
(`dpipe.models.sync_free`); both travel between stages without gradients. The joint attention mask (in the form `model.attention`'s
kernel takes) and the rotary embedding are rebuilt from them in each block, as the diffusers
forward builds them once. Float tensors crossing a stage boundary all get gradients.
"""

from __future__ import annotations

import torch
from torch import nn

from dpipe.config.schema import AttentionKernel
from dpipe.models.attention_mask import has_padding, key_padding_mask
from dpipe.models.common.stage_io import keep_in_graph, needs_grad
from dpipe.models.spec import PipelineLayer, block_layers
from dpipe.models.sync_free import carrier, sizes


def rotary(rope: nn.Module, grid: torch.Tensor, patch: int, patch_t: int, device) -> tuple:
    """HunyuanVideoRotaryPosEmbed reads only the latent's shape: give it a zero-size stand-in."""
    f, h, w = sizes(grid)
    stand_in = torch.empty((), device=device).expand(1, 1, f * patch_t, h * patch, w * patch)
    return rope(stand_in)


def joint_valid_keys(text_mask: torch.Tensor, image_tokens: int) -> torch.Tensor:
    """(B, N) bool over [image tokens, text tokens]: the diffusers forward's mask (text padding is
    at the end, so the valid tokens are a prefix of the joint sequence)."""
    valid = image_tokens + text_mask.sum(dim=1, dtype=torch.int)
    length = image_tokens + text_mask.shape[1]
    return torch.arange(length, device=text_mask.device)[None, :] < valid[:, None]


def unpatchify(x: torch.Tensor, grid: torch.Tensor, patch: int, patch_t: int) -> torch.Tensor:
    """(B, f*h*w, C*pt*p*p) -> (B, C, F, H, W), as HunyuanVideoTransformer3DModel.forward ends."""
    f, h, w = sizes(grid)
    x = x.reshape(x.shape[0], f, h, w, -1, patch_t, patch, patch)
    return x.permute(0, 4, 1, 5, 2, 6, 3, 7).flatten(6, 7).flatten(4, 5).flatten(2, 3)


class HunyuanVideoEmbed(PipelineLayer):
    parts = ("x_embedder", "context_embedder", "time_text_embed")

    def __init__(self, transformer: nn.Module):
        super().__init__(transformer)
        self.guidance = bool(transformer.config.guidance_embeds)
        self.patch, self.patch_t = transformer.config.patch_size, transformer.config.patch_size_t

    def forward(self, inputs):
        latents, t, text, text_mask, pooled, guidance = inputs
        timestep = t * 1000  # the pipeline passes the scheduler's timesteps, sigma * 1000
        temb, _token_replace = self.time_text_embed(
            timestep, pooled, guidance * 1000 if self.guidance else None)
        hidden = self.x_embedder(latents).contiguous()  # a transposed view: stages send contiguous
        text_hidden = self.context_embedder(
            text, timestep, text_mask if has_padding(text_mask) else None)
        _, _, f, h, w = latents.shape
        grid = carrier(f // self.patch_t, h // self.patch, w // self.patch, device=latents.device)
        return needs_grad(hidden), needs_grad(text_hidden), needs_grad(temb), text_mask.long(), grid


class HunyuanVideoBlock(PipelineLayer):
    """A double-stream or single-stream block: both take and return (image, text) streams."""

    parts = ("rope",)

    def __init__(self, transformer: nn.Module, block: nn.Module, source_name: str,
                 attention: AttentionKernel):
        super().__init__(transformer, block, source_name)
        self.patch, self.patch_t = transformer.config.patch_size, transformer.config.patch_size_t
        self.attention = attention

    def forward(self, inputs):
        hidden, text_hidden, temb, text_mask, grid = inputs
        rope = rotary(self.rope, grid, self.patch, self.patch_t, hidden.device)
        mask = (key_padding_mask(joint_valid_keys(text_mask, hidden.shape[1]), self.attention)
                if has_padding(text_mask) else None)
        hidden, text_hidden = self.block(hidden, text_hidden, temb, mask, rope)
        # Single-stream blocks return slices of one joint tensor; stage boundaries send only
        # contiguous tensors (a no-op for double-stream blocks).
        return hidden.contiguous(), text_hidden.contiguous(), temb, text_mask, grid


class HunyuanVideoHead(PipelineLayer):
    parts = ("norm_out", "proj_out")

    def __init__(self, transformer: nn.Module):
        super().__init__(transformer)
        self.patch, self.patch_t = transformer.config.patch_size, transformer.config.patch_size_t

    def forward(self, inputs):
        hidden, text_hidden, temb, _text_mask, grid = inputs
        out = unpatchify(self.proj_out(self.norm_out(hidden, temb)), grid, self.patch, self.patch_t)
        # The text stream ends unused; it still needs a gradient when the head is alone on a
        # stage: through its first token, which is always a valid one (masked tokens may hold
        # non-finite values that `0 * x` would not cancel). HunyuanVideo 1.5's head too.
        return keep_in_graph(out, text_hidden[:, 0])


def hunyuan_video_layers(transformer: nn.Module, attention: AttentionKernel) -> list[PipelineLayer]:
    if transformer.config.image_condition_type is not None:
        raise NotImplementedError(
            "HunyuanVideo image-to-video transformers (image_condition_type="
            f"{transformer.config.image_condition_type!r}) are not supported yet; use the "
            "text-to-video model")
    return [HunyuanVideoEmbed(transformer),
            *block_layers(HunyuanVideoBlock, transformer, "transformer_blocks",
                          "single_transformer_blocks", attention=attention),
            HunyuanVideoHead(transformer)]
