"""Z-Image's single-stream transformer as pipeline layers.

    embed -> noise_refiner blocks (image tokens) -> context_refiner blocks (caption tokens)
          -> join (parameter-free: [image, caption] per item) -> main blocks -> head

This follows `ZImageTransformer2DModel.forward` (basic, non-omni mode) step by step: captions and
images are each padded to a multiple of 32 tokens with their own pad token, and the image's RoPE
positions start after the caption's. Captions come cut after the micro-batch's longest
(`ZImageSpec.make_inputs`), so the batch is padded to its longest caption as in diffusers; only
that batch padding is masked, by `cap_mask`, the caption tokens every query may attend to. With
nothing to mask (one item, or captions of one padded length) `cap_mask` is empty, (B, 0), and
attention runs unmasked, as in diffusers: SDPA may use flash.
RoPE frequencies are recomputed in each block from integer position ids (integers cross stage
boundaries without gradients).

Tuples: before the join (x, cap, adaln, x_ids, cap_ids, cap_mask, grid); after it (unified, adaln,
ids, mask, grid), where mask is [image tokens, cap_mask] or empty, and grid carries the latent
(frames, height, width) in its shape (`dpipe.models.sync_free`).
"""

from __future__ import annotations

import torch
from torch import nn

from dpipe.models.attention_mask import has_padding, padding_mask
from dpipe.models.common.shapes import round_up
from dpipe.models.common.stage_io import needs_grad
from dpipe.models.spec import PipelineLayer, block_layers
from dpipe.models.sync_free import carrier, sizes

SEQ_MULTI_OF = 32  # diffusers' transformer_z_image.SEQ_MULTI_OF


def _grid_ids(f: int, h: int, w: int, device: torch.device) -> torch.Tensor:
    """(f*h*w, 3): each patch's (frame, row, column), from 0."""
    axes = [torch.arange(n, device=device) for n in (f, h, w)]
    return torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)


class ZImageEmbed(PipelineLayer):
    def __init__(self, transformer: nn.Module):
        super().__init__()
        cfg = transformer.config
        self.patch, self.f_patch = cfg.all_patch_size[0], cfg.all_f_patch_size[0]
        key = f"{self.patch}-{self.f_patch}"
        self.adopt("x_embedder", transformer.all_x_embedder[key], f"all_x_embedder.{key}")
        self.adopt("t_embedder", transformer.t_embedder, "t_embedder")
        self.adopt("cap_embedder", transformer.cap_embedder, "cap_embedder")
        # The pad tokens are Parameters at the denoiser's top level: same names here.
        self.adopt("x_pad_token", transformer.x_pad_token, "x_pad_token")
        self.adopt("cap_pad_token", transformer.cap_pad_token, "cap_pad_token")
        self.t_scale = float(cfg.t_scale)

    def forward(self, inputs):
        latents, t, cap, cap_len, cap_mask = inputs
        b, c, h, w = latents.shape
        device = latents.device
        p, pf = self.patch, self.f_patch
        adaln = self.t_embedder(t * self.t_scale).type_as(latents)

        # Image: (B, C, 1, H, W) -> patches ordered (f, h, w), features (pf, ph, pw, c).
        f_t, h_t, w_t = 1 // pf, h // p, w // p
        x = latents.view(b, c, f_t, pf, h_t, p, w_t, p).permute(0, 2, 4, 6, 3, 5, 7, 1)
        x = x.reshape(b, f_t * h_t * w_t, pf * p * p * c)
        x_len = x.shape[1]
        x_pad = round_up(x_len, SEQ_MULTI_OF) - x_len
        if x_pad:  # diffusers repeats the last patch, then swaps in the pad token after embedding
            x = torch.cat([x, x[:, -1:].expand(b, x_pad, x.shape[2])], dim=1)
        x = self.x_embedder(x)
        if x_pad:
            is_pad = (torch.arange(x.shape[1], device=device) >= x_len)[None, :, None]
            x = torch.where(is_pad, self.x_pad_token, x)

        # Captions: item i has cap_len[i] tokens, padded to a multiple of 32 (`cap_tokens`), then to
        # the longest; the item-level padding repeats the last token as diffusers does.
        lc = round_up(cap.shape[1], SEQ_MULTI_OF)
        cap_len = cap_len.long()
        cap_tokens = round_up(cap_len, SEQ_MULTI_OF)
        pos = torch.arange(lc, device=device)
        last = (cap_len - 1).clamp(min=0)
        gather = torch.minimum(pos[None, :], last[:, None])  # repeat the last real token
        cap = torch.cat([cap, cap.new_zeros(b, lc - cap.shape[1], cap.shape[2])], dim=1)
        cap = torch.gather(cap, 1, gather[..., None].expand(b, lc, cap.shape[2]))
        cap = self.cap_embedder(cap)
        in_pad = (pos[None, :] >= cap_len[:, None]) & (pos[None, :] < cap_tokens[:, None])
        cap = torch.where(in_pad[..., None], self.cap_pad_token, cap)
        beyond = (pos[None, :] >= cap_tokens[:, None])[..., None]
        cap = cap.masked_fill(beyond, 0.0)  # batch padding, as pad_sequence fills it

        cap_ids = torch.zeros(b, lc, 3, dtype=torch.long, device=device)
        cap_ids[..., 0] = torch.where(pos[None, :] < cap_tokens[:, None], pos[None, :] + 1, 0)
        # The image's frame positions start after its item's caption.
        x_ids = torch.zeros(b, x.shape[1], 3, dtype=torch.long, device=device)
        start = torch.zeros(b, 1, 3, dtype=torch.long, device=device)
        start[..., 0] = cap_tokens[:, None] + 1
        x_ids[:, :x_len] = _grid_ids(f_t, h_t, w_t, device)[None] + start
        grid = carrier(f_t * pf, h, w, device=device)
        return (needs_grad(x), needs_grad(cap), needs_grad(adaln), x_ids, cap_ids, cap_mask, grid)


class ZImageRefiner(PipelineLayer):
    """A noise_refiner block (image tokens, modulated by t) or a context_refiner block (caption)."""

    def __init__(self, transformer: nn.Module, block: nn.Module, source_name: str, stream: str):
        super().__init__(transformer, block, source_name)
        self.rope = transformer.rope_embedder  # diffusers' RopeEmbedder: not a Module, no weights
        self.stream = stream

    def forward(self, inputs):
        x, cap, adaln, x_ids, cap_ids, cap_mask, grid = inputs
        if self.stream == "image":
            # Every item has all x.shape[1] image tokens: nothing to mask.
            x = self.block(x, None, _freqs(self.rope, x_ids), adaln)
        else:
            cap = self.block(cap, padding_mask(cap_mask), _freqs(self.rope, cap_ids))
        return x, cap, adaln, x_ids, cap_ids, cap_mask, grid


class ZImageJoin(PipelineLayer):
    """Per item: [image tokens, caption tokens], then the fixed-length batch padding."""

    def forward(self, inputs):
        x, cap, adaln, x_ids, cap_ids, cap_mask, grid = inputs
        unified = torch.cat([x, cap], dim=1)
        ids = torch.cat([x_ids, cap_ids], dim=1)
        # Tokens past an item's caption are already zero with ids 0: the layout is the same as
        # diffusers' [x[:x_len], cap[:cap_len]] padded, because every item has all x.shape[1]
        # image tokens.
        mask = cap_mask
        if has_padding(cap_mask):
            mask = torch.cat([cap_mask.new_ones(cap_mask.shape[0], x.shape[1]), cap_mask], dim=1)
        return unified, adaln, ids, mask, grid


class ZImageBlock(PipelineLayer):
    def __init__(self, transformer: nn.Module, block: nn.Module, source_name: str):
        super().__init__(transformer, block, source_name)
        self.rope = transformer.rope_embedder

    def forward(self, inputs):
        unified, adaln, ids, mask, grid = inputs
        unified = self.block(unified, padding_mask(mask), _freqs(self.rope, ids), adaln)
        return unified, adaln, ids, mask, grid


class ZImageHead(PipelineLayer):
    def __init__(self, transformer: nn.Module):
        super().__init__()
        cfg = transformer.config
        self.patch, self.f_patch = cfg.all_patch_size[0], cfg.all_f_patch_size[0]
        key = f"{self.patch}-{self.f_patch}"
        self.adopt("final_layer", transformer.all_final_layer[key], f"all_final_layer.{key}")
        self.out_channels = transformer.out_channels

    def forward(self, inputs):
        unified, adaln, _ids, _mask, grid = inputs
        out = self.final_layer(unified, c=adaln)
        f, h, w = sizes(grid)
        p, pf, c = self.patch, self.f_patch, self.out_channels
        n = (f // pf) * (h // p) * (w // p)
        out = out[:, :n].reshape(out.shape[0], f // pf, h // p, w // p, pf, p, p, c)
        out = out.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(out.shape[0], c, f, h, w)
        return out[:, :, 0] if f == 1 else out


def _freqs(rope, ids: torch.Tensor) -> torch.Tensor:
    b, n, _ = ids.shape
    return rope(ids.reshape(b * n, 3)).reshape(b, n, -1)


def z_image_layers(transformer: nn.Module) -> list[PipelineLayer]:
    return [ZImageEmbed(transformer),
            *block_layers(ZImageRefiner, transformer, "noise_refiner", stream="image"),
            *block_layers(ZImageRefiner, transformer, "context_refiner", stream="caption"),
            ZImageJoin(),
            *block_layers(ZImageBlock, transformer, "layers"),
            ZImageHead(transformer)]
