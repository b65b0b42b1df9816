"""HunyuanVideo (text-to-video, 13B): HunyuanVideoTransformer3DModel + AutoencoderKLHunyuanVideo
(16 channels, 8x spatial, 4x temporal) + a LLaMA-3 text encoder (llava-llama-3-8b) + CLIP-L.

Loads the diffusers folder users download (hunyuanvideo-community/HunyuanVideo), or a single-file
transformer in the original / ComfyUI layout (model.path=<file>.safetensors) with that folder as
model.single_file_config for the rest (see original.py). Prompts go
through `HunyuanVideoPipeline.encode_prompt` with its system template, so text is embedded as at
inference; the one deviation is the tokenizer, loaded so that transformers 5 keeps its byte-level
pre-tokenizer (see tokenizers.py). Images train as 1-frame videos; clips need 4k+1 frames.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpipe.diffusion.loss import weighted_labels
from dpipe.models.attention_mask import real_tokens, trim_text_padding
from dpipe.models.common.lora_targets import DUAL_STREAM_LORA_TARGETS
from dpipe.models.common.shapes import causal_clips
from dpipe.models.diffusers_folder import load_encoders
from dpipe.models.family import diffusers_class
from dpipe.models.hunyuan_video.family import HunyuanVideoFamily
from dpipe.models.hunyuan_video.layers import HunyuanVideoBlock, hunyuan_video_layers
from dpipe.models.hunyuan_video.original import from_original, lora_linears, original_state_dict
from dpipe.models.hunyuan_video.sizes import SAMPLE_SHAPES, SIZES
from dpipe.models.single_file import load_or_fail
from dpipe.models.spec import NoisedBatch, joint_attention_train_flops

COMFYUI_LORA = "hunyuan_video_lora_comfyui.safetensors"
# Bump when the way prompts or images are encoded changes, so old cache entries are not reused.
ENCODING_VERSION = 1



class HunyuanVideoSpec(HunyuanVideoFamily):
    family = "hunyuan_video"
    title, example = "HunyuanVideo", "hunyuanvideo-community/HunyuanVideo"
    pipeline_class, denoiser_class = "HunyuanVideoPipeline", "HunyuanVideoTransformer3DModel"
    text_fingerprint = {"llama": "text_encoder", "clip": "text_encoder_2",
                        "tokenizers": ("tokenizer", "tokenizer_2")}
    image_notes = {"encoding": ENCODING_VERSION, "latent": "mode"}
    tiny_writer = "dpipe.models.hunyuan_video.tiny:make_tiny_hunyuan_video"
    lora_modules = DUAL_STREAM_LORA_TARGETS
    # The embedding, every double- and single-stream block, the head.
    block_count_keys, block_types = ("num_layers", "num_single_layers"), (HunyuanVideoBlock,)
    sampler = "dpipe.models.hunyuan_video.sampling:HunyuanVideoSampling"
    # A single file in the original / ComfyUI layout (original.py); its names both ways.
    from_single_file, to_original = from_original, original_state_dict
    # The original HunyuanVideo names ComfyUI maps back (as diffusion-pipe's and musubi-tuner's
    # LoRAs have them), and ComfyUI's own names for the embedder MLPs, whose original names its
    # loader does not map (`original.lora_module`).
    comfyui_lora, comfyui_mapping = COMFYUI_LORA, lora_linears

    def read_configs(self) -> None:
        # The transformer's too: the pixel multiple and the ComfyUI LoRA's names come from it.
        self.part_config("vae")
        self.part_config("transformer")

    def load_encoders(self, device: torch.device, dtype: torch.dtype) -> Any:
        from dpipe.models.common.tiny_llama3_tokenizer import load_byte_level_tokenizer

        # HunyuanVideo pads prompts on the right and crops its template off the front; the
        # tokenizer loaded so that transformers 5 keeps its byte-level pre-tokenizer.
        tokenizer = load_or_fail(lambda: load_byte_level_tokenizer(
            self.path / "tokenizer", padding_side="right"), self.path / "tokenizer")
        return load_encoders(diffusers_class(self.pipeline_class), self.path, device, dtype,
                             frozen=self.frozen_parts, tokenizer=tokenizer)

    @property
    def text_notes(self) -> dict[str, Any]:
        # The pipeline's prompt template shapes the text too: read from diffusers when asked.
        return {"encoding": ENCODING_VERSION, "template": default_template()}

    # ---- caching -----------------------------------------------------------------------------
    @torch.no_grad()
    def encode_images(self, encoders: Any, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) or (B, 3, F, H, W) in [-1, 1] -> (B, C, f, h, w); images are 1 frame."""
        video = causal_clips(pixels, self.temporal_ratio, self.title)
        vae = encoders.vae
        latents = vae.encode(video.to(vae.device, vae.dtype)).latent_dist.mode()
        return latents * vae.config.scaling_factor

    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, pooled, mask = encoders.encode_prompt(
            prompts, prompt_template=prompt_template(encoders.tokenizer),
            device=encoders.vae.device, max_sequence_length=self.cfg.max_text_tokens)
        return {"llama": embeds, "mask": mask, "pooled": pooled}

    # ---- training ----------------------------------------------------------------------------
    def pipeline_layers(self, denoiser: nn.Module):
        return hunyuan_video_layers(denoiser, self.cfg.attention)  # the kernel is configured

    def make_inputs(self, batch: NoisedBatch):
        b = batch.latents.shape[0]
        guidance = getattr(batch, "guidance", None)  # set when sampling
        if guidance is None:
            guidance = torch.full((b,), float(self.cfg.guidance))
        # Text padding is cut away (dpipe.models.attention_mask): at one clip per micro-batch
        # attention then runs unmasked, on SDPA's flash kernel.
        text, text_mask = trim_text_padding(batch.text["llama"], batch.text["mask"].long())
        inputs = (batch.noisy, batch.timesteps, text, text_mask, batch.text["pooled"], guidance)
        return inputs, weighted_labels(batch)

    # ---- using exported weights ----------------------------------------------------------------
    def denoiser_forward(self, denoiser: nn.Module, inputs) -> torch.Tensor:
        latents, t, text, text_mask, pooled, guidance = inputs
        text_mask = real_tokens(text_mask, text).long()  # diffusers takes one of the text's length
        return denoiser(
            hidden_states=latents, timestep=t * 1000, encoder_hidden_states=text,
            encoder_attention_mask=text_mask, pooled_projections=pooled,
            guidance=guidance * 1000 if denoiser.config.guidance_embeds else None,
            return_dict=False)[0]

    # ---- benchmarks -------------------------------------------------------------------------
    bench_configs = SIZES

    def random_sample(self, size: str):
        shapes = SAMPLE_SHAPES[size]
        mask = torch.zeros(shapes["llama"][0])
        mask[:shapes["text_tokens"]] = 1.0
        text = {"llama": torch.randn(shapes["llama"]), "mask": mask,
                "pooled": torch.randn(shapes["pooled"])}
        return torch.randn(shapes["latents"]), text

    def train_flops(self, denoiser: nn.Module, inputs: tuple, full: bool) -> float:
        latents, _t, text = inputs[:3]
        c = denoiser.config
        b, _, f, h, w = latents.shape
        tokens = (f // c.patch_size_t) * (h // c.patch_size) * (w // c.patch_size)
        seq = tokens + text.shape[1]  # joint attention over video and (trimmed) text tokens
        return joint_attention_train_flops(denoiser, b, seq, full)


def default_template() -> str:
    """diffusers' HunyuanVideo prompt template (imported when asked: diffusers is heavy)."""
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    return DEFAULT_PROMPT_TEMPLATE["template"]


def prompt_template(tokenizer) -> dict[str, Any]:
    """diffusers' HunyuanVideo template, cropped where the user's prompt starts.

    The pipeline's default `crop_start` (95) is the template's length in the real Llama-3
    tokenizer; counting it with the tokenizer at hand gives that same number there, and the right
    one for any other tokenizer (tiny test models)."""
    template = default_template()
    prefix = template.split("{}")[0]
    return {"template": template, "crop_start": len(tokenizer(prefix).input_ids)}

