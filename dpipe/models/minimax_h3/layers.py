"""MiniMax H3's transformer as pipeline layers: embed -> blocks -> head.

MiniMax H3 runs one stack of blocks over one packed sequence per sample,
`[text | audio | video]` (MiniMaxH3PrepareLayoutStep's t2va layout), with full self-attention
over it: the video rows attend to the text and audio rows in every block, so the video
prediction depends on the audio rows. Training video only (no audio rows) is therefore not the
computation t2va sampling runs, which always carries the soundtrack's rows; with `model.audio`
the audio rows ride along and both heads are trained (docs/models/minimax_h3.md).

The diffusers forward takes one layout that every batch item shares; a sample's layout depends
on its prompt's length (text rows come first and the media's rotary clock starts after them), so
the layers run each sample as its own sequence, exactly as the diffusers forward runs it with a
batch of 1, and stack the samples padded at the end to the longest.

The first layer takes `MiniMaxH3Spec.make_inputs`' tuple
  (video (B, Nv, C*4) patchified rows, [audio (B, Na, Ca) rows,] t (B, 2) the model's t of the
   video and of the audio rows (1 - sigma; 1 is clean; text rows take the video's, as in the
   pipeline), text (B, L, D) padded, text_lengths carrier (L_1, ..., L_B),
   layout carrier (frames, h, w, audio latents per channel, B with CFG-augmented training or 0))
With CFG-augmented training (`model.guidance` s > 1) the text and its lengths hold B more
sequences, each sample with the unconditional prompt; they run without gradient and the head
returns (conditional + (s - 1) unconditional) / s for the B samples (`cfg_augmented`).
and the layers pass (hidden (B, S, hidden), temb (B, 2, time_embed_dim), text_lengths, layout).
The head returns the video rows' prediction (B, Nv, C*4); with audio rows, the video's and the
audio's predictions flattened and joined, (B, Nv*C*4 + Na*Ca): one tensor, as the sampler's
stages pass it (the spec splits it). Rotary positions, modality tags and row indices are rebuilt
per layer from the carried sizes by the pipeline's own `build_packed_sequence` (cached per
layout), on the host.
"""

from __future__ import annotations

import contextlib
import copy
from functools import lru_cache

import torch
from torch import nn

from dpipe.models.common.stage_io import needs_grad
from dpipe.models.spec import PipelineLayer, block_layers
from dpipe.models.sync_free import on_host, sizes

AUDIO_CHANNELS = 2  # stereo, packed channel-major (MINIMAX_H3_AUDIO_CHANNELS)
VIDEO_TAG, TEXT_TAG, AUDIO_TAG = 0, 1, 2


@lru_cache(maxsize=64)
def packed_layout(text_length: int, frames: int, height: int, width: int, audio_latents: int,
                  patch: tuple[int, int, int]):
    """One sample's layout, as MiniMaxH3PrepareLayoutStep builds the t2va layout (on the CPU):
    (position_ids (S, 3) float64, token_tags (S,), video, audio and text row indices,
    time_index (S,): 1 on audio rows (the audio's t), 0 elsewhere, and adaln (S,): each row's
    row of the AdaLN table, time_index * 3 + tag, as the transformer addresses it)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep

    positions, tags, video, audio, text, _, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        torch.full((text_length,), TEXT_TAG, dtype=torch.long), frames, height, width,
        audio_latents, patch, AUDIO_CHANNELS, AUDIO_TAG, VIDEO_TAG)
    time_index = (tags == AUDIO_TAG).long()
    return positions, tags, video, audio, text, time_index, time_index * 3 + tags


@lru_cache(maxsize=64)
def _layout_on(device: torch.device, *key) -> tuple[torch.Tensor, ...]:
    """`packed_layout(*key)` copied to `device` once (positions as float32, as the rotary
    module takes them): a copy from pageable host memory in every block would make the host
    wait for the GPU each time."""
    with on_host():
        positions, *rest = packed_layout(*key)
    return (positions.to(device, torch.float32), *(t.to(device) for t in rest))


def _layout(text_lengths: torch.Tensor, layout: torch.Tensor, patch,
            device: torch.device) -> list[tuple]:
    frames, height, width, audio, _ = sizes(layout)
    return [_layout_on(device, n, frames, height, width, audio, patch)
            for n in sizes(text_lengths)]


def guided(layout: torch.Tensor) -> int:
    """With CFG-augmented training: the number of conditional sequences B, the batch holding B
    more, the same samples with the unconditional prompt; 0 without."""
    return sizes(layout)[4]


def _grad_unless(unconditional: bool):
    """The unconditional sequences run without gradient (the model's own prediction, a fixed
    part of the target); the conditional ones as usual."""
    return torch.no_grad() if unconditional else contextlib.nullcontext()


def _stack(rows: list[torch.Tensor], length: int) -> torch.Tensor:
    """Samples' (1, S_i, D) sequences stacked into (B, length, D), zero rows at the end."""
    return torch.cat([nn.functional.pad(r, (0, 0, 0, length - r.shape[1])) for r in rows])


class MiniMaxH3Embed(PipelineLayer):
    parts = ("proj_in", "audio_proj_in", "context_embedder", "time_proj", "time_embedder",
             "token_refiner")

    def forward(self, inputs):
        if len(inputs) == 6:
            video, audio, t, text, text_lengths, layout = inputs
        else:
            (video, t, text, text_lengths, layout), audio = inputs, None
        video = self.proj_in(video.to(compute_dtype(self.proj_in, video)))
        if audio is not None:
            audio = self.audio_proj_in(audio.to(compute_dtype(self.audio_proj_in, audio)))
        text = self.context_embedder(text.to(compute_dtype(self.context_embedder, text)))
        b = video.shape[0]
        rows = []
        for i, n in enumerate(sizes(text_lengths)):
            j = i % b  # sequences b.. (CFG-augmented training): sample i - b, unconditional
            with _grad_unless(i >= b):
                # The refiner attends over the prompt's own tokens only, as the pipeline gives them.
                parts = [self.token_refiner(text[i:i + 1, :n])]
            if audio is not None:
                parts.append(audio[j:j + 1].to(parts[0].dtype))
            parts.append(video[j:j + 1].to(parts[0].dtype))
            rows.append(torch.cat(parts, dim=1))
        hidden = _stack(rows, max(r.shape[1] for r in rows))
        t = t.repeat(len(rows) // b, 1)
        t_freq = self.time_proj(t.reshape(-1))
        temb = self.time_embedder(t_freq.to(compute_dtype(self.time_embedder, t_freq)))
        return needs_grad(hidden), needs_grad(temb.view(*t.shape, -1)), text_lengths, layout


def compute_dtype(module: nn.Module, x: torch.Tensor) -> torch.dtype:
    """The dtype `module` computes in: its first floating-point parameter's (the release keeps
    its embedders and heads in fp32, the blocks in bf16), or `x`'s where it has none. A GGUF
    Linear's weight is the file's bytes (uint8), not the dtype it multiplies in."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), x.dtype)


class MiniMaxH3Block(PipelineLayer):
    def __init__(self, transformer: nn.Module, block: nn.Module, source_name: str):
        super().__init__(transformer, block, source_name)
        self.patch = tuple(transformer.config.patch_size)
        # Its own copy of the rotary module (no parameters; a computed inv_freq buffer): a shared
        # one would go to the meta device with the layers of other stages.
        self.rope = copy.deepcopy(transformer.rope)

    def forward(self, inputs):
        hidden, temb, text_lengths, layout = inputs
        out = []
        for i, (positions, tags, *_, adaln) in enumerate(_layout(text_lengths, layout,
                                                                  self.patch, hidden.device)):
            n, b = tags.shape[0], guided(layout) or hidden.shape[0]
            rotary = self.rope(positions)
            with _grad_unless(i >= b):
                out.append(self.block(hidden[i:i + 1, :n], temb[i], adaln, rotary))
        return _stack(out, hidden.shape[1]), temb, text_lengths, layout


class MiniMaxH3Head(PipelineLayer):
    parts = ("norm_out", "proj_out", "audio_proj_out")

    def __init__(self, transformer: nn.Module, guidance: float = 1.0):
        super().__init__(transformer)
        self.patch = tuple(transformer.config.patch_size)
        self.guidance = guidance

    def forward(self, inputs):
        hidden, temb, text_lengths, layout = inputs
        video_out, audio_out = [], []
        b = guided(layout) or hidden.shape[0]
        for i, (_p, tags, video, audio, _t, time_index, _a) in enumerate(
                _layout(text_lengths, layout, self.patch, hidden.device)):
            n = tags.shape[0]
            with _grad_unless(i >= b):
                x = self.norm_out(hidden[i:i + 1, :n], temb[i], time_index)
                x = x.to(compute_dtype(self.proj_out, x))
                video_out.append(self.proj_out(x.index_select(1, video)))
                if audio.numel():
                    audio_out.append(self.audio_proj_out(x.index_select(1, audio)))
        video_pred = torch.cat(video_out)
        if audio_out:
            video_pred = torch.cat([video_pred.flatten(1), torch.cat(audio_out).flatten(1)], 1)
        return cfg_augmented(video_pred, b, self.guidance) if guided(layout) else video_pred


def cfg_augmented(predictions: torch.Tensor, b: int, scale: float) -> torch.Tensor:
    """(conditional + (s - 1) x unconditional) / s of 2B predictions, the B unconditional ones
    without gradient: what CFG-augmented training fits to the flow-matching target, so that the
    model's own output stays the guided one (guidance s baked in, as the release's)."""
    return (predictions[:b] + (scale - 1) * predictions[b:].detach()) / scale


def minimax_h3_layers(transformer: nn.Module, guidance: float = 1.0) -> list[PipelineLayer]:
    """`guidance`: the CFG-augmented training scale s (used where a batch holds unconditional
    sequences)."""
    return [MiniMaxH3Embed(transformer),
            *block_layers(MiniMaxH3Block, transformer, "transformer_blocks"),
            MiniMaxH3Head(transformer, guidance)]
