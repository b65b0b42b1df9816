"""LTX-2's transformer, video stream only (model.audio=false), as pipeline layers: embed ->
blocks -> head. Both streams (model.audio=true): av_layers.py.

LTX-2 blocks carry a video and an audio stream with audio<->video cross-attention. Here dpipe
trains video only: each block runs its video path as `LTX2VideoTransformerBlock.forward` runs it
with the audio-to-video cross-attention off (`isolate_modalities=True` in the transformer's
forward), where the video output does not depend on the audio stream at all; the audio stream is
not computed. Layers pass (hidden, text, temb, embedded_t, [temb_prompt,] text_mask, grid, rate);
`temb_prompt` only for LTX-2.3-style checkpoints with prompt modulation (`cross_attn_mod`: 9
modulation rows per block, the text keys/values modulated by the sigma's own embedding; the
attention gates of `gated_attn` run inside the attention modules); `rate` (B,) is each clip's frame
rate in thousandths of a frame per second; `grid` and `rate` are carried in shapes, as LTX-Video's.
Rotary embeddings are rebuilt per block from them.
"""

from __future__ import annotations

import torch
from torch import nn

from dpipe.models.common.stage_io import keep_in_graph, needs_grad
from dpipe.models.ltx_video.ltx2.keyframes import video_coords
from dpipe.models.ltx_video.layers import LTXHead, frame_rate, text_bias, time_embedding
from dpipe.models.spec import PipelineLayer, block_layers


def video_rotary(rope: nn.Module, grid: torch.Tensor, hidden: torch.Tensor, rate: torch.Tensor):
    # The temporal coordinates (B, N, 2) are divided by the frame rate: one per sample; a given
    # last frame's appended tokens have positions of their own (keyframes.py).
    coords = video_coords(rope, grid, hidden.shape[1], hidden.shape[0], frame_rate(rate, 3),
                          hidden.device)
    return rope(coords, device=hidden.device)


def sample_sigma(t: torch.Tensor) -> torch.Tensor:
    """(B,) each sample's sigma * 1000 from its tokens' t, (B, 1) or (B, N): the largest, since
    only a given frame's tokens differ (t = 0) and a clip has frames that are not given."""
    return t.amax(dim=1) * 1000


def prompt_modulation(transformer: nn.Module) -> bool:
    """LTX-2.3-style checkpoints: the prompt tokens modulated by the sigma's own embedding."""
    return bool(transformer.prompt_modulation and transformer.config.use_prompt_adaln_single)


class LTX2Embed(PipelineLayer):
    def __init__(self, transformer: nn.Module):
        super().__init__()
        self.prompt_modulation = prompt_modulation(transformer)
        # LTX-2.0 projects the prompt tokens here; LTX-2.3's connectors already give them at the
        # transformer's width (`use_prompt_embeddings=False`, no caption_projection).
        self.project_text = bool(transformer.config.use_prompt_embeddings)
        names = ["proj_in", "time_embed"] + (["caption_projection"] if self.project_text else [])
        if self.prompt_modulation:
            names.append("prompt_adaln")
        for name in names:
            self.adopt(name, getattr(transformer, name), name)

    def forward(self, inputs):
        packed, t, text, text_mask, grid, rate = inputs
        b = packed.shape[0]
        hidden = self.proj_in(packed)
        # The pipeline passes the scheduler's timesteps (sigma * 1000) as timestep and as sigma.
        temb, embedded = time_embedding(self.time_embed, t, b, hidden.dtype)
        text_hidden = (self.caption_projection(text).view(b, -1, hidden.shape[-1])
                       if self.project_text else text)
        out = [needs_grad(hidden), needs_grad(text_hidden), needs_grad(temb), needs_grad(embedded)]
        if self.prompt_modulation:
            temb_prompt, _ = self.prompt_adaln(sample_sigma(t), batch_size=b,
                                               hidden_dtype=hidden.dtype)
            out.append(needs_grad(temb_prompt.view(b, -1, temb_prompt.shape[-1])))
        return (*out, text_mask.long(), grid, rate)


class LTX2VideoBlock(PipelineLayer):
    parts = ("rope",)

    def forward(self, inputs):
        hidden, text, temb, embedded, *prompt, text_mask, grid, rate = inputs
        rope = video_rotary(self.rope, grid, hidden, rate)
        out = video_path(self.block, hidden, text, temb, prompt[0] if prompt else None, rope,
                         text_bias(text_mask, hidden.dtype))
        return (out, text, temb, embedded, *prompt, text_mask, grid, rate)


def video_path(block, hidden, text, temb, temb_prompt, rope, mask):
    """The video half of LTX2VideoTransformerBlock.forward without audio-to-video attention."""
    b = hidden.shape[0]
    ada = block.get_mod_params(block.scale_shift_table, temb, b)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = ada[:6]
    norm = block.norm1(hidden) * (1 + scale_msa) + shift_msa
    self_attn = {"hidden_states": norm, "encoder_hidden_states": None, "query_rotary_emb": rope,
                 "attention_mask": None}
    if block.perturbed_attn:
        self_attn.update(perturbation_mask=None, all_perturbed=None)
    hidden = hidden + block.attn1(**self_attn) * gate_msa
    norm = block.norm2(hidden)
    if block.video_cross_attn_adaln:
        shift_q, scale_q, gate_q = ada[6:9]
        norm = norm * (1 + scale_q) + shift_q
    if block.cross_attn_adaln:
        if temb_prompt is not None:
            shift_kv, scale_kv = block.get_mod_params(block.prompt_scale_shift_table, temb_prompt, b)
        else:
            shift_kv, scale_kv = block.prompt_scale_shift_table[None, None].to(
                device=hidden.device, dtype=hidden.dtype).unbind(dim=2)
        text = text * (1 + scale_kv) + shift_kv
    attn = block.attn2(norm, encoder_hidden_states=text, query_rotary_emb=None,
                       attention_mask=mask)
    if block.video_cross_attn_adaln:
        attn = attn * gate_q
    hidden = hidden + attn
    norm = block.norm3(hidden) * (1 + scale_mlp) + shift_mlp
    return hidden + block.ff(norm) * gate_mlp


class LTX2Head(LTXHead):
    def forward(self, inputs):
        hidden, text, temb, embedded, *prompt, _mask, _grid, _rate = inputs
        out = super().forward((hidden, text, temb, embedded))
        return keep_in_graph(out, prompt[0]) if prompt else out


def ltx2_layers(transformer: nn.Module) -> list[PipelineLayer]:
    return [LTX2Embed(transformer), *block_layers(LTX2VideoBlock, transformer, "transformer_blocks"),
            LTX2Head(transformer)]
