"""Lumina-Image 2.0: Lumina2Transformer2DModel + AutoencoderKL (FLUX's VAE) + Gemma-2 2B.

Loads the diffusers folder layout of Alpha-VLLM/Lumina-Image-2.0. Prompts go through diffusers'
own `Lumina2Pipeline.encode_prompt`: the system prompt, " <Prompt Start> ", the caption; Gemma's
second-to-last hidden state padded to `model.max_text_tokens` (256 in the pipeline) with its mask.

Conventions of the family, from `Lumina2Pipeline.__call__`: the transformer gets
t_model = 1 - sigma (1 = clean image) and predicts x0 - noise (the pipeline steps with -output).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpipe.models.common.lumina import LuminaFamily
from dpipe.models.family import SINGLE_FILE_SUFFIXES
from dpipe.models.lumina2.comfyui import comfy_lora_pairs, from_native
from dpipe.models.lumina2.layers import lumina2_layers
from dpipe.models.lumina2.sizes import SAMPLE_SHAPES, SIZES
from dpipe.models.refined_joint import refined_joint_train_flops


class Lumina2Spec(LuminaFamily):
    family = "lumina2"
    title, example = "Lumina-Image 2.0", "Alpha-VLLM/Lumina-Image-2.0"
    pipeline_class, denoiser_class = "Lumina2Pipeline", "Lumina2Transformer2DModel"
    required_parts = ("model_index.json", "transformer", "vae", "text_encoder", "tokenizer")
    text_notes = {"layout": "pipeline system prompt, hidden_states[-2], padded + mask"}
    tiny_writer = "dpipe.models.lumina2.tiny:make_tiny_lumina2"
    layers = lumina2_layers
    sampler = "dpipe.models.lumina2.sampling:Lumina2Sampling"
    # A single file (ComfyUI's / the original layout): not read by diffusers' from_single_file,
    # whose converter splits qkv at the 2B model's sizes only.
    single_file_suffixes = SINGLE_FILE_SUFFIXES
    gguf_architectures = ("lumina2",)
    from_single_file = from_native
    comfy_lora_pairs = comfy_lora_pairs

    @property
    def pixel_multiple(self) -> int:
        # Lumina2Pipeline assumes an 8x VAE whatever the VAE says; then 2x2 patches.
        return 8 * self.part_config("transformer").get("patch_size", 2)

    # ---- caching -----------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, mask, _, _ = encoders.encode_prompt(
            list(prompts), do_classifier_free_guidance=False, device=encoders.vae.device,
            max_sequence_length=self.cfg.max_text_tokens)
        return {"cap": embeds, "cap_mask": mask.float()}

    # Lumina2Pipeline puts its system prompt before the prompt, not before the negative prompt.
    negative_prompts_differ = True

    @torch.no_grad()
    def encode_negative_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        _, _, embeds, mask = encoders.encode_prompt(
            list(prompts), negative_prompt=list(prompts), do_classifier_free_guidance=True,
            device=encoders.vae.device, max_sequence_length=self.cfg.max_text_tokens)
        return {"cap": embeds, "cap_mask": mask.float()}

    # ---- benchmarks -------------------------------------------------------------------------
    bench_configs, sample_shapes = SIZES, SAMPLE_SHAPES

    def train_flops(self, denoiser: nn.Module, inputs: tuple, full: bool) -> float:
        latents, _t, cap = inputs[:3]
        b, _, h, w = latents.shape
        p = denoiser.config.patch_size
        return refined_joint_train_flops(denoiser, b, (h // p) * (w // p), cap.shape[1],
                                         denoiser.config.hidden_size,
                                         denoiser.time_caption_embed.timestep_embedder, full)
