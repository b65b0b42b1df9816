"""LTX-2's transformer with both streams, as pipeline layers: embed -> joint blocks -> head.

With `model.audio=true` each block runs `LTX2VideoTransformerBlock.forward` itself, the video and
audio streams with both cross-modal attentions (audio-to-video and video-to-audio), as
`LTX2VideoTransformer3DModel.forward` runs it at inference (`isolate_modalities=False`): a LoRA
learns the computation LTX2Pipeline samples with. Both streams denoise at one sigma (the training
batch noises the audio latents at the video's t); a given first frame's video tokens have t = 0
(LTX2ImageToVideoPipeline), while the audio stream and the cross-modal modulations read the
sample's sigma, as the pipeline's `use_cross_timestep` has them.

Layers pass one flat tuple (`AVState.pack`): per stream its tokens, its prompt tokens, its
modulation `temb` and output `embedded` timestep (and, for LTX-2.3-style prompt modulation, the
prompt's `temb_prompt`), then the four cross-modal modulations (scale/shift and gate per stream),
then the int64 text mask, and the video `grid` and frame `rate` carried in shapes as in
layers.py. The audio tokens' count is their own shape; rotary embeddings of both streams and
of the cross-modal attentions are rebuilt per block from these shapes.

A micro-batch without sound (images, clips with no audio track) has zero audio tokens, (B, 0, C):
the tuple keeps its layout (DeepSpeed's engine sends each micro-batch's shapes ahead of it,
dpipe/pipeline/stage_engine.py), the blocks run the video path alone as with `model.audio=false`
(layers.py, no attention to an empty stream) and the audio prediction is empty, so its loss is 0.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import nn

from dpipe.models.common.stage_io import keep_in_graph, needs_grad
from dpipe.models.ltx_video.ltx2.keyframes import video_coords as coords_of
from dpipe.models.ltx_video.ltx2.layers import prompt_modulation, sample_sigma, video_path
from dpipe.models.ltx_video.layers import LTXHead, frame_rate, text_bias
from dpipe.models.spec import PipelineLayer, block_layers


@dataclass
class AVState:
    """What one layer hands the next; `temb_prompt*` only with prompt modulation (LTX-2.3)."""

    hidden: torch.Tensor
    text: torch.Tensor
    temb: torch.Tensor
    embedded: torch.Tensor
    temb_prompt: torch.Tensor | None
    audio: torch.Tensor
    audio_text: torch.Tensor
    audio_temb: torch.Tensor
    audio_embedded: torch.Tensor
    audio_temb_prompt: torch.Tensor | None
    ca_video_scale_shift: torch.Tensor
    ca_audio_scale_shift: torch.Tensor
    ca_video_gate: torch.Tensor
    ca_audio_gate: torch.Tensor
    text_mask: torch.Tensor
    grid: torch.Tensor
    rate: torch.Tensor

    def pack(self) -> tuple[torch.Tensor, ...]:
        return tuple(v for v in (getattr(self, name) for name in _FIELDS) if v is not None)

    @classmethod
    def unpack(cls, inputs: tuple[torch.Tensor, ...], prompt: bool) -> "AVState":
        names = _FIELDS if prompt else _FIELDS_WITHOUT_PROMPT
        assert len(inputs) == len(names), f"{len(inputs)} tensors for {len(names)} fields"
        return cls(**{"temb_prompt": None, "audio_temb_prompt": None, **dict(zip(names, inputs))})


# The field names, read once here: `dataclasses.fields` on the class inside a compiled layer is a
# graph break (tests/unit/test_ltx2_av_training.py compiles the layers and counts them).
_FIELDS = tuple(f.name for f in fields(AVState))
_FIELDS_WITHOUT_PROMPT = tuple(name for name in _FIELDS if "temb_prompt" not in name)


# The floats the head receives and does not read.
_NOT_READ_BY_HEAD = ("text", "temb", "temb_prompt", "audio_text", "audio_temb",
                     "audio_temb_prompt", "ca_video_scale_shift", "ca_audio_scale_shift",
                     "ca_video_gate", "ca_audio_gate")


def has_sound(state: AVState) -> bool:
    return state.audio.shape[1] > 0


class LTX2AVEmbed(PipelineLayer):
    """Both input projections, timestep embeddings and cross-modal modulations, and (LTX-2.0)
    both caption projections, as the transformer's forward computes them before its blocks."""

    def __init__(self, transformer: nn.Module):
        super().__init__()
        c = transformer.config
        self.prompt_modulation = prompt_modulation(transformer)
        self.project_text = bool(c.use_prompt_embeddings)
        # The cross-modal gates are read at t scaled as the transformer's forward scales them.
        self.gate_scale = c.cross_attn_timestep_scale_multiplier / c.timestep_scale_multiplier
        names = ["proj_in", "audio_proj_in", "time_embed", "audio_time_embed",
                 "av_cross_attn_video_scale_shift", "av_cross_attn_video_a2v_gate",
                 "av_cross_attn_audio_scale_shift", "av_cross_attn_audio_v2a_gate"]
        if self.project_text:
            names += ["caption_projection", "audio_caption_projection"]
        if self.prompt_modulation:
            names += ["prompt_adaln", "audio_prompt_adaln"]
        for name in names:
            self.adopt(name, getattr(transformer, name), name)

    def forward(self, inputs):
        packed, t, text, text_mask, grid, rate, audio, audio_text = inputs
        b = packed.shape[0]
        hidden = self.proj_in(packed)
        audio_hidden = self.audio_proj_in(audio)
        # The pipeline passes the scheduler's timesteps (sigma * 1000) as the video's timestep,
        # per token where the first frame is given (t (B, N), 0 on its tokens), and the sample's
        # sigma as the audio's timestep and as both streams' sigma, which the prompt and the
        # cross-modal modulations read (`use_cross_timestep`).
        sigma = sample_sigma(t)

        def embed(module, scale: float = 1.0, timestep: torch.Tensor = sigma):
            emb, embedded = module(timestep * scale, batch_size=b, hidden_dtype=hidden.dtype)
            return emb.view(b, -1, emb.shape[-1]), embedded.view(b, -1, embedded.shape[-1])

        temb, embedded = embed(self.time_embed, timestep=(t * 1000).flatten())
        audio_temb, audio_embedded = embed(self.audio_time_embed)
        if self.project_text:
            text = self.caption_projection(text).view(b, -1, hidden.shape[-1])
            audio_text = self.audio_caption_projection(audio_text).view(
                b, -1, audio_hidden.shape[-1])
        prompt = [embed(m)[0] if self.prompt_modulation else None
                  for m in (getattr(self, "prompt_adaln", None),
                            getattr(self, "audio_prompt_adaln", None))]
        state = AVState(
            hidden=hidden, text=text, temb=temb, embedded=embedded, temb_prompt=prompt[0],
            audio=audio_hidden, audio_text=audio_text, audio_temb=audio_temb,
            audio_embedded=audio_embedded, audio_temb_prompt=prompt[1],
            ca_video_scale_shift=embed(self.av_cross_attn_video_scale_shift)[0],
            ca_audio_scale_shift=embed(self.av_cross_attn_audio_scale_shift)[0],
            ca_video_gate=embed(self.av_cross_attn_video_a2v_gate, self.gate_scale)[0],
            ca_audio_gate=embed(self.av_cross_attn_audio_v2a_gate, self.gate_scale)[0],
            text_mask=text_mask.long(), grid=grid, rate=rate)
        return tuple(needs_grad(x) if x.is_floating_point() else x for x in state.pack())


class LTX2AVBlock(PipelineLayer):
    """One `LTX2VideoTransformerBlock` with both streams and both cross-modal attentions."""

    # Parameter-free: the positions of each stream and of the cross-modal attentions.
    parts = ("rope", "audio_rope", "cross_attn_rope", "cross_attn_audio_rope")

    def __init__(self, transformer: nn.Module, block: nn.Module, source_name: str):
        super().__init__(transformer, block, source_name)
        self.prompt_modulation = prompt_modulation(transformer)

    def forward(self, inputs):
        s = AVState.unpack(inputs, self.prompt_modulation)
        b, device = s.hidden.shape[0], s.hidden.device
        # The temporal coordinates are divided by each clip's frame rate, and a given last
        # frame's appended tokens placed, as in layers.py.
        video_coords = coords_of(self.rope, s.grid, s.hidden.shape[1], b,
                                 frame_rate(s.rate, 3), device)
        mask = text_bias(s.text_mask, s.hidden.dtype)
        if not has_sound(s):  # no audio in this micro-batch: the video path alone
            s.hidden = video_path(self.block, s.hidden, s.text, s.temb, s.temb_prompt,
                                  self.rope(video_coords, device=device), mask)
            return s.pack()
        audio_coords = self.audio_rope.prepare_audio_coords(b, s.audio.shape[1], device)
        s.hidden, s.audio = self.block(
            hidden_states=s.hidden, audio_hidden_states=s.audio, encoder_hidden_states=s.text,
            audio_encoder_hidden_states=s.audio_text, temb=s.temb, temb_audio=s.audio_temb,
            temb_ca_scale_shift=s.ca_video_scale_shift,
            temb_ca_audio_scale_shift=s.ca_audio_scale_shift, temb_ca_gate=s.ca_video_gate,
            temb_ca_audio_gate=s.ca_audio_gate, temb_prompt=s.temb_prompt,
            temb_prompt_audio=s.audio_temb_prompt,
            video_rotary_emb=self.rope(video_coords, device=device),
            audio_rotary_emb=self.audio_rope(audio_coords, device=device),
            ca_video_rotary_emb=self.cross_attn_rope(video_coords[:, 0:1], device=device),
            ca_audio_rotary_emb=self.cross_attn_audio_rope(audio_coords[:, 0:1], device=device),
            encoder_attention_mask=mask, audio_encoder_attention_mask=mask,
            use_a2v_cross_attention=True, use_v2a_cross_attention=True,
            perturbation_mask=None, all_perturbed=False)
        return s.pack()


class LTX2AVHead(LTXHead):
    """Both output layers: (video prediction, audio prediction); the audio one is (B, 0, C) for a
    micro-batch without sound."""

    parts = (*LTXHead.parts, "audio_norm_out", "audio_proj_out", "audio_scale_shift_table")

    def __init__(self, transformer: nn.Module):
        super().__init__(transformer)
        self.prompt_modulation = prompt_modulation(transformer)

    def forward(self, inputs):
        s = AVState.unpack(inputs, self.prompt_modulation)
        video = _output(s.hidden, s.embedded, self.scale_shift_table, self.norm_out,
                        self.proj_out)
        audio = _output(s.audio, s.audio_embedded, self.audio_scale_shift_table,
                        self.audio_norm_out, self.audio_proj_out)
        # Every float received needs a gradient when the head is alone on the last stage; the
        # ones the outputs do not read get a zero one. Chosen by field name: `id()` of a tensor
        # in a compiled layer makes dynamo guard on that very object, and every call recompiled.
        unused = [getattr(s, name) for name in _NOT_READ_BY_HEAD if getattr(s, name) is not None]
        return keep_in_graph(video, *unused), keep_in_graph(audio, *unused)


def _output(hidden, embedded, table, norm, proj):
    values = table[None, None] + embedded[:, :, None]
    shift, scale = values[:, :, 0], values[:, :, 1]
    return proj(norm(hidden) * (1 + scale) + shift)


def ltx2_av_layers(transformer: nn.Module) -> list[PipelineLayer]:
    return [LTX2AVEmbed(transformer), *block_layers(LTX2AVBlock, transformer, "transformer_blocks"),
            LTX2AVHead(transformer)]
