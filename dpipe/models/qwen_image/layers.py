"""Qwen-Image's double-stream (MMDiT) transformer as pipeline layers: embed -> blocks -> head.

Every layer passes (image, text, temb, text_mask, shapes): the image and text streams, the
timestep embedding, the text mask (int64, (B, L); (B, 0) when no padding is left) and the latent
grids, the same for every item of a micro-batch, carried in a shape (`dpipe.models.sync_free`):
frames, height, width in 2x2 patches of each image, the target first, then Qwen-Image-Edit's
reference image. RoPE is recomputed per block from the grids with the transformer's own
`pos_embed`; integers cross stage boundaries without gradients. The text is cut after the
micro-batch's longest prompt (`text_inputs`), as diffusers pads it, and with no padding left no
attention is masked (SDPA can then run flash); RoPE of a text token does not depend on the
padding.

Qwen-Image-Edit-2511 (`zero_cond_t`): the reference images' tokens are modulated with the
embedding of t = 0, the target's with t's, as the transformer does it: the embed layer passes
both timestep embeddings stacked ((2B, D), t's first), each block picks per token by its image
(`reference_index`), the text stream and the head use t's.
"""

from __future__ import annotations

import torch
from torch import nn

from dpipe.models.attention_mask import key_mask, padding_mask, trim_text_padding
from dpipe.models.common.stage_io import keep_in_graph, needs_grad
from dpipe.models.spec import PipelineLayer, block_layers
from dpipe.models.sync_free import carrier, sizes


def image_grids(*grids: tuple[int, int, int]) -> torch.Tensor:
    """The (f, h, w) grids of a micro-batch's images, carried in a shape."""
    return carrier(*(v for grid in grids for v in grid))


def grids(shapes: torch.Tensor, batch: int) -> list[list[tuple[int, int, int]]]:
    """The carried grids as diffusers' `img_shapes` (one list of (f, h, w) per item)."""
    values = sizes(shapes)
    return [[tuple(values[i:i + 3]) for i in range(0, len(values), 3)]] * batch


def target_tokens(shapes: torch.Tensor) -> int:
    """The target image's token count (an edit's reference tokens follow)."""
    f, h, w = sizes(shapes)[:3]
    return f * h * w


def reference_index(shapes: torch.Tensor, batch: int, device: torch.device) -> torch.Tensor:
    """(B, tokens) int: 0 on the target's tokens, 1 on the references' (the transformer's
    `modulate_index` under zero_cond_t)."""
    values = sizes(shapes)
    total = sum(values[i] * values[i + 1] * values[i + 2] for i in range(0, len(values), 3))
    index = torch.ones(batch, total, dtype=torch.int, device=device)
    index[:, :target_tokens(shapes)] = 0
    return index


def _tables_on(pos_embed: nn.Module, device: torch.device) -> nn.Module:
    """QwenEmbedRope with its frequency tables on `device`. They are plain CPU attributes (not
    buffers: those would drop the imaginary part), copied on every call unless an lru_cache
    keeps the copy, and torch.compile bypasses that cache (a host sync per block): they move
    once here."""
    if pos_embed.pos_freqs.device != device:
        pos_embed.pos_freqs = pos_embed.pos_freqs.to(device)
        pos_embed.neg_freqs = pos_embed.neg_freqs.to(device)
    return pos_embed


class QwenImageEmbed(PipelineLayer):
    parts = ("img_in", "txt_norm", "txt_in", "time_text_embed")

    def __init__(self, transformer: nn.Module):
        super().__init__(transformer)
        self.zero_cond_t = bool(transformer.config.get("zero_cond_t"))

    def forward(self, inputs):
        image, t, text, text_mask, shapes = inputs[:5]
        if len(inputs) > 5:  # Qwen-Image-Edit: the reference image's tokens follow the target's
            image = torch.cat([image, inputs[5]], dim=1)
        hidden = self.img_in(image)
        text_hidden = self.txt_in(self.txt_norm(text))
        t = t.to(hidden.dtype)
        if self.zero_cond_t:  # the references' embedding (t = 0) after the target's
            t = torch.cat([t, t * 0])
        temb = self.time_text_embed(t, hidden)
        return (needs_grad(hidden), needs_grad(text_hidden), needs_grad(temb), text_mask.long(),
                shapes)


class QwenImageBlock(PipelineLayer):
    parts = ("pos_embed",)

    def forward(self, inputs):
        hidden, text_hidden, temb, text_mask, shapes = inputs
        rope = _tables_on(self.pos_embed, hidden.device)
        rotary = rope(grids(shapes, hidden.shape[0]), max_txt_seq_len=text_hidden.shape[1],
                      device=hidden.device)
        index = (reference_index(shapes, hidden.shape[0], hidden.device)
                 if self.block.zero_cond_t else None)
        text_hidden, hidden = self.block(
            hidden_states=hidden, encoder_hidden_states=text_hidden,
            encoder_hidden_states_mask=padding_mask(text_mask),
            temb=temb, image_rotary_emb=rotary, modulate_index=index)
        return hidden, text_hidden, temb, text_mask, shapes


class QwenImageHead(PipelineLayer):
    parts = ("norm_out", "proj_out")

    def forward(self, inputs):
        hidden, text_hidden, temb, _text_mask, shapes = inputs
        if temb.shape[0] != hidden.shape[0]:  # zero_cond_t: t's embedding, not the references'
            temb = temb[:hidden.shape[0]]
        out = self.proj_out(self.norm_out(hidden, temb))
        # The text stream ends unused here; alone on the last stage it still needs a gradient.
        return keep_in_graph(out[:, :target_tokens(shapes)], text_hidden)


def text_inputs(text: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached text (padded to model.max_text_tokens) and its mask, cut after the
    micro-batch's longest prompt (`dpipe.models.attention_mask.trim_text_padding`)."""
    lengths = text["text_len"].reshape(-1).round().long()
    return trim_text_padding(text["text"], key_mask(lengths, text["text"].shape[1]).long())


def qwen_image_layers(transformer: nn.Module) -> list[PipelineLayer]:
    cfg = transformer.config
    unsupported = [k for k in ("use_additional_t_cond", "use_layer3d_rope") if cfg.get(k)]
    if unsupported or cfg.get("guidance_embeds"):
        from dpipe.errors import ModelLoadError

        raise ModelLoadError(
            f"this QwenImageTransformer2DModel sets {', '.join(unsupported) or 'guidance_embeds'} "
            "(Qwen-Image-Layered), which dpipe does not train yet; Qwen-Image, Qwen-Image-Edit "
            "and Qwen-Image-Edit-2509/2511 are supported")
    return [QwenImageEmbed(transformer),
            *block_layers(QwenImageBlock, transformer, "transformer_blocks"),
            QwenImageHead(transformer)]
