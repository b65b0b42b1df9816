"""AuraFlow (fal/AuraFlow v0.1-v0.3): AuraFlowTransformer2DModel + SDXL's AutoencoderKL +
Pile-T5-XL (UMT5EncoderModel).

A rectified-flow model like SD3 and FLUX.1: x_t = (1 - t) x0 + t noise, the transformer predicts
noise - x0. `AuraFlowPipeline` hands the transformer sigma in [0, 1] (`t / 1000` of its scheduler's
timesteps) and the transformer scales it by 1000 itself, so dpipe's t goes in as it is. Its
scheduler samples with shift 1.73: set `train.timesteps.shift` to train at the same noise levels.
Prompts are encoded by `AuraFlowPipeline.encode_prompt` (padded to `max_text_tokens`, padding
zeroed), exactly as at inference. LoRAs are written for diffusers and, in the original module
names ComfyUI runs, for ComfyUI (`auraflow/comfyui.py`). The transformer may instead come from
one file in the original layout (the transformer keys of ComfyUI's `aura_flow_0.3.safetensors`,
with or without `model.diffusion_model.`): model.path names the file and model.single_file_config
the diffusers folder that gives the VAE, text encoder and configs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpipe.models.auraflow.comfyui import comfyui_lora, from_original, native_state_dict
from dpipe.models.auraflow.layers import AuraFlowJointBlock, AuraFlowSingleBlock, auraflow_layers
from dpipe.models.family import SINGLE_FILE_SUFFIXES, DiffusersFamily
from dpipe.models.lora_files import LoraFormat, lora_scale
from dpipe.models.spec import NoisedBatch

# Every Linear of both kinds of blocks (attention incl. the text stream's projections, the SwiGLU
# MLPs, the AdaLN modulations), none outside them, as AuraFlow LoRAs are trained.
_BLOCK_LINEARS = [
    r"attn\.to_q", r"attn\.to_k", r"attn\.to_v", r"attn\.to_out\.0",
    r"attn\.add_q_proj", r"attn\.add_k_proj", r"attn\.add_v_proj", r"attn\.to_add_out",
    r"ff\.linear_1", r"ff\.linear_2", r"ff\.out_projection",
    r"ff_context\.linear_1", r"ff_context\.linear_2", r"ff_context\.out_projection",
    r"norm1\.linear", r"norm1_context\.linear",
]
COMFYUI_LORA = "auraflow_lora_comfyui.safetensors"
LORA_TARGETS = r"(?:joint|single)_transformer_blocks\.\d+\.(?:" + "|".join(_BLOCK_LINEARS) + ")"


class AuraFlowSpec(DiffusersFamily):
    family = "auraflow"
    title, example = "AuraFlow", "fal/AuraFlow-v0.3"
    pipeline_class, denoiser_class = "AuraFlowPipeline", "AuraFlowTransformer2DModel"
    required_parts = ("model_index.json", "transformer", "vae", "text_encoder", "tokenizer",
                      "scheduler")
    text_fingerprint = {"t5": "text_encoder", "tokenizer": "tokenizer"}
    latent_patch = None  # the transformer's patch_size
    tiny_writer = "dpipe.models.auraflow.tiny:make_tiny_auraflow"
    lora_modules = LORA_TARGETS
    layers = auraflow_layers
    block_count_keys = ("num_mmdit_layers", "num_single_dit_layers")
    block_types = (AuraFlowJointBlock, AuraFlowSingleBlock)
    sampler = "dpipe.models.auraflow.sampling:AuraFlowSampling"
    # A single file: original names; the config from the folder.
    single_file_suffixes = SINGLE_FILE_SUFFIXES
    gguf_architectures = ("aura",)
    from_single_file, to_original = from_original, native_state_dict

    # ---- caching -----------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, _mask, _neg, _neg_mask = encoders.encode_prompt(
            prompts, do_classifier_free_guidance=False, device=encoders.vae.device,
            max_sequence_length=self.cfg.max_text_tokens)
        return {"t5": embeds}

    # ---- training ----------------------------------------------------------------------------
    def make_inputs(self, batch: NoisedBatch):
        inputs = (batch.noisy, batch.timesteps, batch.text["t5"])
        weight = getattr(batch, "loss_weight", None)  # (B, 1, h, w) from masks, or None
        return inputs, (batch.target,) if weight is None else (batch.target, weight)

    # ---- export ------------------------------------------------------------------------------
    def lora_formats(self, weights, metadata) -> list[LoraFormat]:
        return [LoraFormat(COMFYUI_LORA, lambda: comfyui_lora(weights, lora_scale(metadata)),
                           {"format": "comfyui"})]

    # ---- using exported weights ----------------------------------------------------------------
    def denoiser_forward(self, denoiser: nn.Module, inputs) -> torch.Tensor:
        latents, t, text = inputs
        return denoiser(latents, encoder_hidden_states=text, timestep=t, return_dict=False)[0]
