"""HiDream-I1's sparse-MoE transformer as pipeline layers: embed -> dual-stream blocks ->
single-stream blocks -> head.

Every block of HiDream reads its own projection of one Llama layer's hidden states. The embed layer
computes all of them (exactly as diffusers: `caption_projection[i](llama[llama_layers[i]])`) and
sends them on as one stack; each block takes the first entry and passes the rest. The tuple:

    (hidden, text, temb, img_ids, img_mask, img_sizes[, per_block])

`text` is the joint text stream (T5 projection, then the last block's Llama projection), updated by
the dual blocks and carried by the single blocks beside the image stream (concatenated and split
again, exactly). `img_ids` and `img_mask` are integers and `img_sizes` carries the patch grid's
height and width in its shape (`dpipe.models.sync_free`): diffusers pads non-square latents to
`max_seq` tokens with a mask (keys of padding zeroed) and uses no mask for square ones.
Rotary embeddings are recomputed per block from the ids. The last block sends no Llama stack.
The blocks' MoE feed-forwards run without host syncs (`moe.py`).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from dpipe.models.common.shapes import unpatchify
from dpipe.models.common.stage_io import keep_in_graph, needs_grad
from dpipe.models.hidream.moe import make_sync_free
from dpipe.models.spec import PipelineLayer, block_layers
from dpipe.models.sync_free import carrier, sizes


class HiDreamEmbed(PipelineLayer):
    parts = ("x_embedder", "t_embedder", "p_embedder", "caption_projection")

    def __init__(self, transformer: nn.Module):
        super().__init__(transformer)
        # diffusers' patchify reads only the patch size and max_seq; calling it on a stand-in
        # keeps this layer from holding the whole transformer.
        self._patchify = type(transformer).patchify
        self._patch_config = SimpleNamespace(
            config=SimpleNamespace(patch_size=transformer.config.patch_size),
            max_seq=transformer.max_seq)
        self.llama_layers = list(transformer.config.llama_layers)

    def forward(self, inputs):
        latents, timesteps, t5, llama, pooled = inputs
        b = latents.shape[0]
        hidden, img_mask, _, img_ids = self._patchify(self._patch_config, latents)
        p = self._patch_config.config.patch_size
        img_sizes = carrier(latents.shape[-2] // p, latents.shape[-1] // p, device=latents.device)
        hidden = self.x_embedder(hidden)
        temb = self.t_embedder(timesteps, latents.dtype) + self.p_embedder(pooled)
        width = hidden.shape[-1]
        per_block = [self.caption_projection[i](llama[k]).view(b, -1, width)
                     for i, k in enumerate(self.llama_layers)]
        t5_proj = self.caption_projection[-1](t5).view(b, -1, width)
        text = torch.cat([t5_proj, per_block[-1]], dim=1)
        if img_mask is None:
            mask = torch.ones(b, hidden.shape[1], dtype=torch.long, device=hidden.device)
        else:
            mask = img_mask.round().long()
        return (needs_grad(hidden), needs_grad(text), needs_grad(temb), img_ids.long(), mask,
                img_sizes, needs_grad(torch.stack(per_block)))


def _image_mask(img_mask, img_sizes, dtype):
    """diffusers masks only padded (non-square) latents."""
    ph, pw = sizes(img_sizes)
    return None if ph == pw else img_mask.to(dtype)


def _rest(per_block):
    return (per_block[1:],) if per_block.shape[0] > 1 else ()


def _rope(pe_embedder, img_ids, text_len):
    txt_ids = torch.zeros(img_ids.shape[0], text_len, 3, dtype=torch.float32, device=img_ids.device)
    return pe_embedder(torch.cat([img_ids.float(), txt_ids], dim=1))


class HiDreamBlockLayer(PipelineLayer):
    """A block of either stream, with the transformer's rotary embedder."""

    parts = ("pe_embedder",)


class HiDreamDualBlock(HiDreamBlockLayer):
    def forward(self, inputs):
        hidden, text, temb, img_ids, img_mask, img_sizes, per_block = inputs
        llama = per_block[0]
        rotary = _rope(self.pe_embedder, img_ids, text.shape[1] + llama.shape[1])
        masks = _image_mask(img_mask, img_sizes, hidden.dtype)
        hidden, text_out = self.block(
            hidden_states=hidden, hidden_states_masks=masks,
            encoder_hidden_states=torch.cat([text, llama], dim=1), temb=temb,
            image_rotary_emb=rotary)
        # The block's own Llama tokens are dropped, as diffusers does.
        return (hidden, text_out[:, :text.shape[1]].contiguous(), temb, img_ids, img_mask,
                img_sizes, *_rest(per_block))


class HiDreamSingleBlock(HiDreamBlockLayer):
    def forward(self, inputs):
        hidden, text, temb, img_ids, img_mask, img_sizes, per_block = inputs
        llama = per_block[0]
        n_img, n_text = hidden.shape[1], text.shape[1]
        rotary = _rope(self.pe_embedder, img_ids, n_text + llama.shape[1])
        masks = _image_mask(img_mask, img_sizes, hidden.dtype)
        if masks is not None:
            ones = hidden.new_ones(hidden.shape[0], n_text + llama.shape[1])
            masks = torch.cat([masks, ones], dim=1)
        joint = self.block(hidden_states=torch.cat([hidden, text, llama], dim=1),
                           hidden_states_masks=masks, encoder_hidden_states=None, temb=temb,
                           image_rotary_emb=rotary)
        hidden = joint[:, :n_img].contiguous()
        text = joint[:, n_img:n_img + n_text].contiguous()
        return (hidden, text, temb, img_ids, img_mask, img_sizes, *_rest(per_block))


class HiDreamHead(PipelineLayer):
    parts = ("final_layer",)

    def __init__(self, transformer: nn.Module):
        super().__init__(transformer)
        self.patch = int(transformer.config.patch_size)

    def forward(self, inputs):
        hidden, text, temb, _ids, _mask, img_sizes = inputs
        out = self.final_layer(hidden, temb)
        ph, pw = sizes(img_sizes)
        # As diffusers' unpatchify at inference (each sample's valid tokens, patch-major).
        images = unpatchify(out[:, :ph * pw], ph, pw, self.patch)
        # The text stream ends here; crossing a stage boundary it still needs a gradient path.
        return keep_in_graph(images, text)


def hidream_layers(transformer: nn.Module) -> list[PipelineLayer]:
    make_sync_free(transformer)  # diffusers' MoE syncs the host per expert (moe.py)
    return [HiDreamEmbed(transformer),
            *block_layers(HiDreamDualBlock, transformer, "double_stream_blocks"),
            *block_layers(HiDreamSingleBlock, transformer, "single_stream_blocks"),
            HiDreamHead(transformer)]
