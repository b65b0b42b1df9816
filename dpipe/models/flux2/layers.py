"""FLUX.2's transformer as pipeline layers: embed -> double blocks -> single blocks -> head.

FLUX.2 computes the blocks' modulations once, outside the blocks, from the timestep (and
guidance) embedding `temb`: one set shared by all double blocks' image streams, one by their text
streams, one by all single blocks. The embed layer computes them (their Linears live there, once,
so a full fine-tune trains each on one stage only), and they travel in the tuple:

    double blocks: (hidden, text_hidden, temb, mod_img, mod_txt, mod_single, ids)
    single blocks: (hidden, text_hidden, temb, mod_single, ids)

The first single block drops the double-block modulations (giving them a zero gradient path, as a
float received across a stage boundary needs one). `ids` holds the text then the image (and
reference image) position ids, 4 axes each, as int64; rotary embeddings are recomputed per block.
"""

from __future__ import annotations

import torch
from torch import nn

from dpipe.models.common.stage_io import keep_in_graph, needs_grad
from dpipe.models.spec import PipelineLayer, block_layers


def _rotary(pos_embed: nn.Module, ids: torch.Tensor, text_len: int):
    # As Flux2Transformer2DModel.forward: text and image rotary tables computed apart, then joined.
    txt_cos, txt_sin = pos_embed(ids[:text_len])
    img_cos, img_sin = pos_embed(ids[text_len:])
    return torch.cat([txt_cos, img_cos], dim=0), torch.cat([txt_sin, img_sin], dim=0)


class Flux2Embed(PipelineLayer):
    parts = ("x_embedder", "context_embedder", "time_guidance_embed",
             "double_stream_modulation_img", "double_stream_modulation_txt",
             "single_stream_modulation")

    def __init__(self, transformer: nn.Module):
        super().__init__(transformer)
        self.has_guidance = bool(transformer.config.guidance_embeds)

    def forward(self, inputs):
        packed, t, text, guidance, txt_ids, img_ids = inputs
        hidden = self.x_embedder(packed)
        # The pipeline passes t in [0, 1] (its timesteps / 1000); the model scales both by 1000.
        timestep = t.to(hidden.dtype) * 1000
        guidance = guidance.to(hidden.dtype) * 1000 if self.has_guidance else None
        temb = self.time_guidance_embed(timestep, guidance)
        mods = (self.double_stream_modulation_img(temb), self.double_stream_modulation_txt(temb),
                self.single_stream_modulation(temb))
        text_hidden = self.context_embedder(text)
        ids = torch.cat([txt_ids, img_ids], dim=0).long()
        return (needs_grad(hidden), needs_grad(text_hidden), needs_grad(temb),
                *(needs_grad(m) for m in mods), ids)


class Flux2DoubleBlock(PipelineLayer):
    parts = ("pos_embed",)

    def forward(self, inputs):
        hidden, text_hidden, temb, mod_img, mod_txt, mod_single, ids = inputs
        text_hidden, hidden = self.block(
            hidden_states=hidden, encoder_hidden_states=text_hidden, temb_mod_img=mod_img,
            temb_mod_txt=mod_txt, image_rotary_emb=_rotary(self.pos_embed, ids,
                                                           text_hidden.shape[1]))
        return hidden, text_hidden, temb, mod_img, mod_txt, mod_single, ids


class Flux2SingleBlock(PipelineLayer):
    parts = ("pos_embed",)

    def __init__(self, transformer: nn.Module, block: nn.Module, source_name: str):
        super().__init__(transformer, block, source_name)
        self.first = block is transformer.single_transformer_blocks[0]

    def forward(self, inputs):
        if self.first:
            hidden, text_hidden, temb, mod_img, mod_txt, mod_single, ids = inputs
            # The double-block modulations end here (see the module docstring).
            hidden = keep_in_graph(hidden, mod_img, mod_txt)
        else:
            hidden, text_hidden, temb, mod_single, ids = inputs
        text_hidden, hidden = self.block(
            hidden_states=hidden, encoder_hidden_states=text_hidden, temb_mod=mod_single,
            image_rotary_emb=_rotary(self.pos_embed, ids, text_hidden.shape[1]),
            split_hidden_states=True)
        return hidden, text_hidden, temb, mod_single, ids


class Flux2Head(PipelineLayer):
    parts = ("norm_out", "proj_out")

    def forward(self, inputs):
        hidden, text_hidden, temb, mod_single, _ids = inputs
        out = self.proj_out(self.norm_out(hidden, temb))
        # Text stream and single-block modulations end unused here; when the head starts a
        # stage, what it received still needs a gradient.
        return keep_in_graph(out, text_hidden, mod_single)


def flux2_layers(transformer: nn.Module) -> list[PipelineLayer]:
    if not len(transformer.single_transformer_blocks):
        raise ValueError("FLUX.2 transformers without single-stream blocks are not supported")
    return [Flux2Embed(transformer),
            *block_layers(Flux2DoubleBlock, transformer, "transformer_blocks"),
            *block_layers(Flux2SingleBlock, transformer, "single_transformer_blocks"),
            Flux2Head(transformer)]
