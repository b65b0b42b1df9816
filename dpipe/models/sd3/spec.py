"""Stable Diffusion 3 / 3.5 (medium, large, large-turbo): SD3Transformer2DModel (MMDiT) +
AutoencoderKL (16 ch, shift and scale) + CLIP-L + CLIP-G + T5-XXL.

Loads the diffusers folder layout users download (stabilityai/stable-diffusion-3.5-large, ...).
Prompts are embedded by diffusers' own `StableDiffusion3Pipeline.encode_prompt`, exactly as at
inference: the penultimate hidden states of both CLIPs, concatenated and zero-padded to the T5
width, followed by T5's tokens along the sequence; the pooled input is both CLIPs' projections.
Objective: rectified flow (x_t = (1 - t) x0 + t noise, predict noise - x0), the model seeing the
timestep as t * 1000, as the SD3 paper trains it and the pipeline samples it.

The transformer may instead come from one file in Stability AI's layout (`sd3.5_large.safetensors`,
with or without `model.diffusion_model.`): model.path names the file and model.single_file_config
the diffusers folder that gives the VAE, text encoders and configs (see original.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpipe.models.family import SINGLE_FILE_SUFFIXES, DiffusersFamily
from dpipe.models.lora_files import LoraFormat, lora_scale
from dpipe.models.sd3.comfyui import comfyui_lora
from dpipe.models.sd3.layers import sd3_layers
from dpipe.models.sd3.original import from_original, original_state_dict
from dpipe.models.spec import NoisedBatch

TEXT_PARTS = ("text_encoder", "text_encoder_2", "text_encoder_3",
              "tokenizer", "tokenizer_2", "tokenizer_3")

# Every Linear of the joint blocks: attention (and SD3.5-medium's second attention, attn2), both
# MLPs and the adaLN modulations; nothing outside the blocks. The last block has no text output
# projections (context_pre_only): the regex simply matches fewer modules there.
_BLOCK_LINEARS = [
    r"attn2?\.to_q", r"attn2?\.to_k", r"attn2?\.to_v", r"attn2?\.to_out\.0",
    r"attn\.add_q_proj", r"attn\.add_k_proj", r"attn\.add_v_proj", r"attn\.to_add_out",
    r"ff\.net\.0\.proj", r"ff\.net\.2", r"ff_context\.net\.0\.proj", r"ff_context\.net\.2",
    r"norm1\.linear", r"norm1_context\.linear",
]
LORA_TARGETS = r"transformer_blocks\.\d+\.(?:" + "|".join(_BLOCK_LINEARS) + ")"
# The LoRA in the original MMDiT key names, which ComfyUI loads (see comfyui.py).
COMFYUI_LORA = "sd3_lora_comfyui.safetensors"


class SD3Spec(DiffusersFamily):
    family = "sd3"
    title, example = "Stable Diffusion 3", "stabilityai/stable-diffusion-3.5-large"
    pipeline_class, denoiser_class = "StableDiffusion3Pipeline", "SD3Transformer2DModel"
    required_parts = ("model_index.json", "transformer", "vae", *TEXT_PARTS)
    frozen_parts = ("vae", "text_encoder", "text_encoder_2", "text_encoder_3")
    text_fingerprint = {part: part for part in TEXT_PARTS}
    text_notes = {"clip_layer": "penultimate"}
    latent_patch = None  # the transformer's patch_size
    tiny_writer = "dpipe.models.sd3.tiny:make_tiny_sd3"
    lora_modules = LORA_TARGETS
    layers = sd3_layers
    sampler = "dpipe.models.sd3.sampling:SD3Sampling"
    # A single file: original MMDiT names; the config from the folder.
    single_file_suffixes = SINGLE_FILE_SUFFIXES
    gguf_architectures = ("sd3",)
    from_single_file, to_original = from_original, original_state_dict

    # ---- caching -----------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        text, _neg, pooled, _neg_pooled = encoders.encode_prompt(
            prompts, None, None, device=encoders.vae.device, do_classifier_free_guidance=False,
            max_sequence_length=self.cfg.max_text_tokens)
        return {"text": text, "pooled": pooled}

    # ---- training ----------------------------------------------------------------------------
    def make_inputs(self, batch: NoisedBatch):
        # SD3 patchifies inside its embedding: the first layer takes (B, C, H, W) latents.
        inputs = (batch.noisy, batch.timesteps, batch.text["text"], batch.text["pooled"])
        weight = getattr(batch, "loss_weight", None)  # (B, 1, h, w) from masks, or None
        if weight is None:
            return inputs, (batch.target,)
        return inputs, (batch.target, weight)

    # ---- export ------------------------------------------------------------------------------
    def lora_formats(self, weights, metadata) -> list[LoraFormat]:
        return [LoraFormat(COMFYUI_LORA, lambda: comfyui_lora(
            weights, lora_scale(metadata), self.part_config("transformer")["num_layers"]))]

    # ---- using exported weights ----------------------------------------------------------------
    def denoiser_forward(self, denoiser: nn.Module, inputs) -> torch.Tensor:
        latents, t, text, pooled = inputs
        return denoiser(hidden_states=latents, encoder_hidden_states=text,
                        pooled_projections=pooled, timestep=t * 1000, return_dict=False)[0]
