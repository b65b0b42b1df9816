"""Chroma's transformer as pipeline layers: embed -> double blocks -> single blocks -> head.

Every layer passes (hidden, text_hidden, mods, ids, mask). `mods` is the output of Chroma's
modulation approximator (`distilled_guidance_layer`): one row per modulation vector of the whole
model, computed once from the timestep; each block slices out its own rows, exactly where
ChromaTransformer2DModel.forward slices them. `ids` (position ids, rotary embeddings recomputed per
block) and `mask` (1 for the text tokens attended to, and every image token) are int64, so they
cross stage boundaries without gradients. With the text cut to its longest prompt and nothing left
to mask, `mask` is empty, (B, 0), and the blocks attend unmasked. Single-stream
blocks take the text and image tokens concatenated, as in diffusers; they split them again so
that every layer passes the same tuple.
"""

from __future__ import annotations

import torch
from torch import nn

from dpipe.models.attention_mask import padding_mask
from dpipe.models.common.stage_io import keep_in_graph, needs_grad
from dpipe.models.spec import PipelineLayer


class ChromaEmbed(PipelineLayer):
    parts = ("x_embedder", "time_text_embed", "distilled_guidance_layer", "context_embedder")

    def forward(self, inputs):
        packed, t, text, mask, txt_ids, img_ids = inputs
        hidden = self.x_embedder(packed)
        mods = self.distilled_guidance_layer(self.time_text_embed(t.to(hidden.dtype) * 1000))
        text_hidden = self.context_embedder(text)
        ids = torch.cat([txt_ids, img_ids], dim=0).long()
        return needs_grad(hidden), needs_grad(text_hidden), needs_grad(mods), ids, mask


class ChromaDoubleBlock(PipelineLayer):
    parts = ("pos_embed",)

    def __init__(self, transformer: nn.Module, block: nn.Module, source_name: str,
                 img_mod: int, txt_mod: int):
        super().__init__(transformer, block, source_name)
        self.img_mod, self.txt_mod = img_mod, txt_mod

    def forward(self, inputs):
        hidden, text_hidden, mods, ids, mask = inputs
        temb = torch.cat([mods[:, self.img_mod:self.img_mod + 6],
                          mods[:, self.txt_mod:self.txt_mod + 6]], dim=1)
        text_hidden, hidden = self.block(
            hidden_states=hidden, encoder_hidden_states=text_hidden, temb=temb,
            image_rotary_emb=self.pos_embed(ids), attention_mask=padding_mask(mask))
        return hidden, text_hidden, mods, ids, mask


class ChromaSingleBlock(PipelineLayer):
    parts = ("pos_embed",)

    def __init__(self, transformer: nn.Module, block: nn.Module, source_name: str, mod: int):
        super().__init__(transformer, block, source_name)
        self.mod = mod

    def forward(self, inputs):
        hidden, text_hidden, mods, ids, mask = inputs
        joint = torch.cat([text_hidden, hidden], dim=1)
        joint = self.block(hidden_states=joint, temb=mods[:, self.mod:self.mod + 3],
                           image_rotary_emb=self.pos_embed(ids), attention_mask=padding_mask(mask))
        text_len = text_hidden.shape[1]
        return joint[:, text_len:], joint[:, :text_len], mods, ids, mask


class ChromaHead(PipelineLayer):
    parts = ("norm_out", "proj_out")

    def forward(self, inputs):
        hidden, text_hidden, mods, _ids, _mask = inputs
        out = self.proj_out(self.norm_out(hidden, mods[:, -2:]))
        # The text stream ends here unused; it still needs a gradient when the head starts a stage.
        return keep_in_graph(out, text_hidden)


def chroma_layers(transformer: nn.Module) -> list[PipelineLayer]:
    doubles, singles = transformer.transformer_blocks, transformer.single_transformer_blocks
    img_offset = 3 * len(singles)  # the approximator's rows: singles, double image, double text
    txt_offset = img_offset + 6 * len(doubles)
    return [ChromaEmbed(transformer),
            *(ChromaDoubleBlock(transformer, block, f"transformer_blocks.{i}", img_offset + 6 * i,
                                txt_offset + 6 * i) for i, block in enumerate(doubles)),
            *(ChromaSingleBlock(transformer, block, f"single_transformer_blocks.{i}", 3 * i)
              for i, block in enumerate(singles)),
            ChromaHead(transformer)]
