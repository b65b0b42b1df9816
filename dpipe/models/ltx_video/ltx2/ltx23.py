"""LTX-2.3 (22B audio-video): LTX-2's family (`dpipe.models.ltx_video.ltx2`) on the LTX-2.3
release, whose diffusers classes are LTX-2's with 2.3's switches on (see ltx23_tiny.py): gated
attention, the text cross-attention modulated by the timestep (`prompt_adaln`, 9 modulation rows
per block), prompt tokens projected per stream by the connectors (no caption_projection), a
larger VAE decoder and a vocoder with bandwidth extension.

Loads the diffusers folder of the release (diffusers/LTX-2.3-Diffusers), or the transformer from
Lightricks' single file (ltx-2.3-22b-dev.safetensors) with that folder as
model.single_file_config. Training, sampling and exports are LTX-2's (model.audio=false: the
video stream only, each block's video path with isolated modalities; model.audio=true: both
streams and their cross-modal attentions); what 2.3 adds is trained too: the LoRA covers the
attentions' gates (`attn1.to_gate_logits`, `attn2.to_gate_logits`, and with model.audio the
audio and cross-modal attentions' ones) next to LTX-2's Linears, and a full fine-tune updates
`prompt_adaln` (and `audio_prompt_adaln`) and the blocks' prompt modulation tables.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpipe.models.adapters import is_adapter_param
from dpipe.models.ltx_video.ltx2.av_layers import LTX2AVBlock
from dpipe.models.ltx_video.ltx2.layers import LTX2VideoBlock
from dpipe.models.ltx_video.ltx2.ltx23_sizes import SAMPLE_SHAPES, SIZES, VAES
from dpipe.models.ltx_video.ltx2.release import RELEASES
from dpipe.models.ltx_video.ltx2.spec import AUDIO_TEXT_KEY, LTX2Spec
from dpipe.models.spec import attention_train_flops

COMFYUI_LORA = "ltx23_lora_comfyui.safetensors"

# LTX-2's video-path Linears of every block and the per-head gates LTX-2.3 adds to them.
LORA_TARGETS = (r"transformer_blocks\.\d+\.(?:attn1\.to_q|attn1\.to_k|attn1\.to_v|attn1\.to_out\.0"
                r"|attn1\.to_gate_logits|attn2\.to_q|attn2\.to_k|attn2\.to_v|attn2\.to_out\.0"
                r"|attn2\.to_gate_logits|ff\.net\.0\.proj|ff\.net\.2)")
# With model.audio: LTX-2's audio-path Linears and the gates of those attentions.
AUDIO_LORA_TARGETS = (r"|transformer_blocks\.\d+\.(?:(?:audio_attn1|audio_attn2|audio_to_video_attn"
                      r"|video_to_audio_attn)\.(?:to_q|to_k|to_v|to_out\.0|to_gate_logits)"
                      r"|audio_ff\.net\.0\.proj|audio_ff\.net\.2)")


class LTX23Spec(LTX2Spec):
    family = "ltx23"
    release = "2.3"
    title, example = "LTX-2.3", RELEASES["2.3"][1]
    tiny_writer = "dpipe.models.ltx_video.ltx2.ltx23_tiny:make_tiny_ltx23"
    lora_modules, audio_lora_modules = LORA_TARGETS, AUDIO_LORA_TARGETS
    comfyui_lora = COMFYUI_LORA
    # Equal blocks, light embedder and head. By parameters the embedder (time_embed's 9-row and
    # prompt_adaln's modulation, ~200M at 22B) would weigh half a block, and every block carries
    # its audio half, which video-only training never runs; the embedder and head run a few
    # Linears on one timestep token or memory-bound per-token ones. With model.audio every block
    # runs both streams: the blocks stay equal.
    block_types = (LTX2VideoBlock, LTX2AVBlock)

    # ---- benchmarks -------------------------------------------------------------------------
    bench_configs, sample_shapes = SIZES, SAMPLE_SHAPES

    def bench_folder(self, size: str) -> dict[str, dict[str, Any]]:
        return {"transformer/config.json": SIZES[size], "vae/config.json": VAES[size]}

    def random_denoiser(self, size: str, dtype: torch.dtype, device: torch.device) -> nn.Module:
        """Made in `dtype` directly: 22B parameters in fp32 (88 GB) would not fit an 80 GB GPU
        on the way to bf16."""
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            return super().random_denoiser(size, dtype, device)
        finally:
            torch.set_default_dtype(default)

    def random_sample(self, size: str):
        shapes = self.sample_shapes[size]
        tokens = shapes["video_text"][0]
        text = {"video_text": torch.randn(shapes["video_text"]),
                "mask": torch.ones(tokens, dtype=torch.long)}
        if self.cfg.audio:  # the audio stream's prompt tokens, as encode_prompts caches them
            text[AUDIO_TEXT_KEY] = torch.randn(shapes["audio_text"])
        return torch.randn(self.cached_latent_shape(shapes["latents"])), text

    def train_flops(self, denoiser: nn.Module, inputs: tuple, full: bool) -> float:
        """The streams that run: their weights x the tokens each sees (the text keys and values
        of the cross-attentions see the prompt tokens, the embedders one timestep), and the
        attentions. Video only (model.audio=false, or a micro-batch without sound): self-
        attention over the video and cross-attention to the prompt. With sound, the audio
        stream's too, and the audio-to-video and video-to-audio attentions (at the audio
        stream's width)."""
        packed, _t, text = inputs[:3]
        b, video = packed.shape[:2]
        audio = inputs[6].shape[1] if len(inputs) > 6 else 0
        tokens = {"video": video, "text": text.shape[1], "audio": audio}
        weights = sum(p.numel() * _tokens_of(name, tokens)
                      for name, p in denoiser.named_parameters() if not is_adapter_param(name))
        c = denoiser.config
        width = c.num_attention_heads * c.attention_head_dim
        per_block = (attention_train_flops(video, width)
                     + attention_train_flops(video, width, text.shape[1]))
        if audio:
            audio_width = c.audio_num_attention_heads * c.audio_attention_head_dim
            per_block += (attention_train_flops(audio, audio_width)
                          + attention_train_flops(audio, audio_width, text.shape[1])
                          + attention_train_flops(video, audio_width, audio)
                          + attention_train_flops(audio, audio_width, video))
        return b * ((6 if full else 4) * weights + c.num_layers * per_block)


# Which stream's tokens each attention reads: (queries and output, keys and values).
_ATTENTION_TOKENS = {"attn1": ("video", "video"), "attn2": ("video", "text"),
                     "audio_attn1": ("audio", "audio"), "audio_attn2": ("audio", "text"),
                     "audio_to_video_attn": ("video", "audio"),
                     "video_to_audio_attn": ("audio", "video")}


def _tokens_of(name: str, tokens: dict[str, int]) -> int:
    """How many tokens the weight `name` of the transformer processes per sample, given the
    micro-batch's {"video", "text", "audio"} token counts (audio 0: the audio stream and the
    cross-modal attentions do not run)."""
    parts = name.split(".")
    audio = tokens["audio"]
    if parts[0] in ("proj_in", "proj_out"):
        return tokens["video"]
    if parts[0] in ("audio_proj_in", "audio_proj_out", "audio_caption_projection"):
        return audio if parts[0] != "audio_caption_projection" else (tokens["text"] if audio else 0)
    if parts[0] == "caption_projection":
        return tokens["text"]
    if parts[0] in ("time_embed", "prompt_adaln"):
        return 1
    if parts[0] in ("audio_time_embed", "audio_prompt_adaln") or parts[0].startswith("av_cross"):
        return 1 if audio else 0
    if parts[0] != "transformer_blocks":
        return 0
    module = parts[2]
    if audio == 0 and module.startswith(("audio_", "video_to_audio")):
        return 0  # the audio stream's and the cross-modal attentions' weights
    if module in _ATTENTION_TOKENS:
        queries, keys = _ATTENTION_TOKENS[module]
        return tokens[keys if parts[3] in ("to_k", "to_v", "norm_k") else queries]
    return {"ff": tokens["video"], "audio_ff": audio}.get(module, 0)
