"""HunyuanImage 2.1 (hunyuanvideo-community/HunyuanImage-2.1-Diffusers and its distilled variant):
HunyuanImageTransformer2DModel + AutoencoderKLHunyuanImage + Qwen2.5-VL-7B + Glyph-ByT5.

Rectified flow: x_t = (1 - t) x0 + t noise, the transformer predicts noise - x0. The pipeline hands
the transformer its scheduler's timesteps, sigma * 1000, so dpipe's t goes in times 1000 (also to
the token refiner). Prompts go through `HunyuanImagePipeline.encode_prompt`: Qwen2.5-VL's
third-to-last hidden states after the 34-token system template (padded to 1000 tokens; dpipe keeps
the first `model.max_text_tokens`, which drops only padding for shorter prompts: padding is masked
everywhere, so the output is the same), and ByT5 embeddings of quoted text in the prompt (glyph
rendering; zeros and an empty mask when there is none). The distilled checkpoint (guidance and
meanflow embedders) trains with guidance `model.guidance` and r = t (the instantaneous velocity).
LoRAs are written for diffusers and, in the module names ComfyUI runs, for ComfyUI
(`hunyuan_image/comfyui.py`). The transformer may come as a single file in Tencent's original
layout (`model.path=hunyuanimage2.1_bf16.safetensors`, with model.single_file_config the
diffusers folder that gives the VAE, text encoders and configs; `hunyuan_image/original.py`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpipe.diffusion.loss import weighted_labels
from dpipe.models.attention_mask import (
    joint_padding_mask, real_tokens, trim_or_drop, trim_text_padding)
from dpipe.models.comfyui import COMFY_PREFIX
from dpipe.models.common.comfyui_hunyuan import comfyui_module
from dpipe.models.common.lora_targets import DUAL_STREAM_LORA_TARGETS
from dpipe.models.family import SINGLE_FILE_SUFFIXES, DiffusersFamily
from dpipe.models.hunyuan_image.comfyui import comfyui_lora
from dpipe.models.hunyuan_image.layers import HunyuanImageBlock, hunyuan_image_layers
from dpipe.models.hunyuan_image.original import file_form, from_original, to_original
from dpipe.models.lora_files import DIFFUSERS_LORA, LoraFormat, lora_scale
from dpipe.models.single_file import export_like_source
from dpipe.models.spec import NoisedBatch

log = logging.getLogger(__name__)

COMFYUI_LORA = "hunyuan_image_lora_comfyui.safetensors"

TEXT_PARTS = ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")


class HunyuanImageSpec(DiffusersFamily):
    family = "hunyuan_image"
    title, example = "HunyuanImage 2.1", "hunyuanvideo-community/HunyuanImage-2.1-Diffusers"
    pipeline_class, denoiser_class = "HunyuanImagePipeline", "HunyuanImageTransformer2DModel"
    required_parts = ("model_index.json", "transformer", "vae", "text_encoder", "text_encoder_2",
                      "tokenizer", "tokenizer_2", "scheduler")
    frozen_parts = ("vae", "text_encoder", "text_encoder_2")
    unused_parts = ("guider", "ocr_guider")  # sampling only (sampling.py loads them)
    text_fingerprint = {part: part for part in TEXT_PARTS}
    vae_config_keys = ("scaling_factor",)
    tiny_writer = "dpipe.models.hunyuan_image.tiny:make_tiny_hunyuan_image"
    lora_modules = DUAL_STREAM_LORA_TARGETS
    # The embedding runs the first double-stream block; then the other double- and every
    # single-stream block, and the head.
    block_count_keys, edge_layers = ("num_layers", "num_single_layers"), 1
    block_types = (HunyuanImageBlock,)
    sampler = "dpipe.models.hunyuan_image.sampling:HunyuanImageSampling"
    # diffusers 0.42 gives HunyuanImagePipeline no LoRA loader mixin; the file is written in the
    # diffusers format all pipelines share (`transformer.`-prefixed peft keys + adapter
    # metadata), by a mixin that has one, and the transformer's `load_lora_adapter` reads it.
    lora_writer = "HunyuanVideoPipeline"
    # A single file in Tencent's original layout (original.py).
    single_file_suffixes = SINGLE_FILE_SUFFIXES
    gguf_architectures = ("hunyuan_image",)  # not among ComfyUI-GGUF's names
    from_single_file = from_original
    # ComfyUI runs it on its HunyuanVideo code, renaming a file's keys alike (`lora_names`)
    comfyui_file_module = staticmethod(comfyui_module)

    def read_configs(self) -> None:
        # The transformer's too: the pixel multiple and the ComfyUI LoRA's names come from it.
        self.part_config("vae")
        self.part_config("transformer")

    @property
    def pixel_multiple(self) -> int:
        # The VAE's config names its downscale; the transformer's patches on top.
        patch = self.part_config("transformer").get("patch_size", [1, 1])
        return int(self.part_config("vae")["spatial_compression_ratio"]) * int(max(patch))

    # ---- caching -----------------------------------------------------------------------------
    @torch.no_grad()
    def encode_images(self, encoders: Any, pixels: torch.Tensor) -> torch.Tensor:
        vae = encoders.vae
        latents = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mode()
        return latents * vae.config.scaling_factor  # the pipeline decodes latents / scale

    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        text, mask, glyph, glyph_mask = encoders.encode_prompt(
            prompts, device=encoders.vae.device, batch_size=len(prompts))
        n = self.cfg.max_text_tokens
        if mask[:, n:].any():
            longest = int(mask.sum(1).max())
            log.warning("a prompt has %d Qwen tokens; model.max_text_tokens=%d keeps the first %d",
                        longest, n, n)
        return {"text": text[:, :n], "text_mask": mask[:, :n], "glyph": glyph,
                "glyph_mask": glyph_mask}

    # ---- training ----------------------------------------------------------------------------
    def pipeline_layers(self, denoiser: nn.Module):
        return hunyuan_image_layers(denoiser, self.cfg.attention)  # the kernel is configured

    def make_inputs(self, batch: NoisedBatch):
        b = batch.latents.shape[0]
        guidance = getattr(batch, "guidance", None)  # set when sampling a distilled model
        if guidance is None:
            guidance = torch.full((b,), float(self.cfg.guidance) * 1000.0)
        else:  # the scale times 1000, as HunyuanImagePipeline passes it
            guidance = guidance.float() * 1000.0
        # Each text stream cut after its longest prompt (no glyph stream without quoted text), and
        # the joint text's mask, on the CPU (dpipe.models.attention_mask): at one prompt per
        # micro-batch nothing is left to mask.
        qwen, qwen_mask = trim_text_padding(batch.text["text"], batch.text["text_mask"])
        glyph, glyph_mask = trim_or_drop(batch.text["glyph"], batch.text["glyph_mask"])
        joint = joint_padding_mask((glyph, glyph_mask), (qwen, qwen_mask))
        inputs = (batch.noisy, batch.timesteps * 1000.0, qwen, qwen_mask.long(), glyph,
                  glyph_mask.long(), guidance, joint)
        return inputs, weighted_labels(batch)

    # ---- export ------------------------------------------------------------------------------
    def lora_formats(self, weights, metadata) -> list[LoraFormat]:
        return [LoraFormat(COMFYUI_LORA, lambda: comfyui_lora(
            weights, lora_scale(metadata), self.part_config("transformer")), {"format": "comfyui"})]

    def export_single_file(self, folder: Path, out_dir: Path) -> Path:
        # Back in the form of the source file (fused, split or ComfyUI's), so the tool that
        # loaded the source loads the fine-tune.
        return export_like_source(
            folder, self.single_file, lambda weights: to_original(
                weights, self.part_config("transformer"), self._source_form()), out_dir)

    def _source_form(self) -> str:
        from safetensors import safe_open

        with safe_open(self.single_file, "pt") as source:
            return file_form(k.removeprefix("model.").removeprefix(COMFY_PREFIX)
                             for k in source.keys())

    # ---- using exported weights ----------------------------------------------------------------
    def denoiser_forward(self, denoiser: nn.Module, inputs) -> torch.Tensor:
        latents, timestep, text, mask, glyph, glyph_mask, guidance, _joint = inputs[:8]
        timestep_r = inputs[8] if len(inputs) > 8 else timestep  # sampling's meanflow interval
        # diffusers takes masks of the texts' lengths.
        mask, glyph_mask = real_tokens(mask, text).long(), real_tokens(glyph_mask, glyph).long()
        c = denoiser.config
        return denoiser(
            latents, timestep, encoder_hidden_states=text, encoder_attention_mask=mask,
            encoder_hidden_states_2=glyph, encoder_attention_mask_2=glyph_mask,
            guidance=guidance if c.guidance_embeds else None,
            timestep_r=timestep_r if c.use_meanflow else None, return_dict=False)[0]

    def load_denoiser_with_lora(self, lora_dir: Path) -> nn.Module:
        # The pipeline has no LoRA loader: the transformer loads it.
        transformer = self.load_denoiser(torch.float32)
        transformer.load_lora_adapter(str(lora_dir), weight_name=DIFFUSERS_LORA,
                                      prefix="transformer")
        return transformer
