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

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpipe.diffusion.loss import weighted_mean
from dpipe.models.diffusers_folder import (
    check_folder, kl_image_fingerprint, kl_latents, load_denoiser, load_encoders, read_json)
from dpipe.models.fingerprint import folder_fingerprint
from dpipe.models.lora_files import (
    lora_scale, LoraFormat, peft_to_diffusers, save_diffusers_lora,
    write_lora_files)
from dpipe.models.sd3.layers import sd3_layers
from dpipe.models.sd3.original import from_original, original_state_dict
from dpipe.models.single_file import check_single_file, split_path
from dpipe.models.spec import ModelSpec, NoisedBatch, PipelineLayer, denoiser_config

log = logging.getLogger(__name__)

TEXT_PARTS = ("text_encoder", "text_encoder_2", "text_encoder_3",
              "tokenizer", "tokenizer_2", "tokenizer_3")
REQUIRED_PARTS = ("model_index.json", "transformer", "vae", *TEXT_PARTS)

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


class SD3Spec(ModelSpec):
    family = "sd3"

    def __init__(self, cfg):
        super().__init__(cfg)
        # model.path: the diffusers folder, or a single-file transformer (original MMDiT names)
        # with model.single_file_config naming the diffusers folder for the rest.
        self.path, self.single_file = split_path(cfg)

    def ensure_available(self) -> None:
        if self.cfg.tiny and not self.path.exists():
            from dpipe.models.sd3.tiny import make_tiny_sd3

            make_tiny_sd3(self.path)
        check_folder(self.path, REQUIRED_PARTS, "Stable Diffusion 3",
                     "stabilityai/stable-diffusion-3.5-large")
        check_single_file(self.single_file)
        self._vae_config()

    def _vae_config(self) -> dict[str, Any]:
        return read_json(self.path / "vae" / "config.json")

    def _transformer_config(self) -> dict[str, Any]:
        return read_json(self.path / "transformer" / "config.json")

    @property
    def pixel_multiple(self) -> int:
        # VAE downscale (x8 for the real VAE), then the transformer's patch size (2).
        vae_scale = 2 ** (len(self._vae_config()["block_out_channels"]) - 1)
        return vae_scale * int(self._transformer_config().get("patch_size", 2))

    # ---- components -------------------------------------------------------------------------
    def load_encoders(self, device: torch.device, dtype: torch.dtype) -> Any:
        from diffusers import StableDiffusion3Pipeline

        return load_encoders(StableDiffusion3Pipeline, self.path, device, dtype,
                             frozen=("vae", "text_encoder", "text_encoder_2", "text_encoder_3"))

    def load_denoiser(self, dtype: torch.dtype) -> nn.Module:
        from diffusers import SD3Transformer2DModel

        # A single file: original names; the config from the folder
        return load_denoiser(SD3Transformer2DModel, self.path, self.single_file, dtype,
                             convert=from_original)

    def encoder_fingerprint(self, kind: str) -> dict[str, Any]:
        if kind == "image":
            return kl_image_fingerprint(self.family, self.path)
        return {
            "family": self.family,
            **{part: folder_fingerprint(self.path / part) for part in TEXT_PARTS},
            "max_text_tokens": self.cfg.max_text_tokens,
            "clip_layer": "penultimate",
        }

    # ---- caching -----------------------------------------------------------------------------
    def encode_images(self, encoders: Any, pixels: torch.Tensor) -> torch.Tensor:
        return kl_latents(encoders.vae, pixels)

    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        text, _neg, pooled, _neg_pooled = encoders.encode_prompt(
            prompts, None, None, device=encoders.vae.device, do_classifier_free_guidance=False,
            max_sequence_length=self.cfg.max_text_tokens)
        return {"text": text, "pooled": pooled}

    # ---- training ----------------------------------------------------------------------------
    def lora_targets(self) -> str:
        return LORA_TARGETS

    def pipeline_layers(self, denoiser: nn.Module) -> list[PipelineLayer]:
        return sd3_layers(denoiser)

    def pipeline_layer_count(self) -> int:
        """sd3_layers: the embedding, every block, the head."""
        blocks, = denoiser_config(self.path / "transformer", "SD3Transformer2DModel", "num_layers")
        return 2 + blocks

    def make_inputs(self, batch: NoisedBatch):
        # SD3 patchifies inside its embedding: the first layer takes (B, C, H, W) latents.
        inputs = (batch.noisy, batch.timesteps, batch.text["text"], batch.text["pooled"])
        weight = getattr(batch, "loss_weight", None)  # (B, 1, h, w) from masks, or None
        if weight is None:
            return inputs, (batch.target,)
        return inputs, (batch.target, weight)

    def loss(self, outputs, labels) -> torch.Tensor:
        # labels: (target,) or (target, weight) with per-pixel loss weights (masks), broadcast over channels
        return weighted_mean(self.element_error(outputs, labels[0]), *labels[1:])

    # ---- export ------------------------------------------------------------------------------
    def export_lora(self, state_dict: dict[str, torch.Tensor], metadata: dict[str, Any],
                    out_dir: Path) -> list[Path]:
        from diffusers import StableDiffusion3Pipeline

        from dpipe.models.sd3.comfyui import comfyui_lora

        weights = peft_to_diffusers(state_dict)
        return write_lora_files(
            out_dir, lambda: save_diffusers_lora(StableDiffusion3Pipeline, weights, metadata, out_dir),
            [LoraFormat(COMFYUI_LORA, lambda: comfyui_lora(
                weights, lora_scale(metadata), self._transformer_config()["num_layers"]))])

    def export_full(self, shards: list[Path], out_dir: Path) -> Path:
        from dpipe.models.diffusers_folder import write_transformer_folder

        return write_transformer_folder(shards, out_dir, self.path, self.single_file,
                                        original_state_dict)

    # ---- using exported weights ----------------------------------------------------------------
    def denoiser_forward(self, denoiser: nn.Module, inputs) -> torch.Tensor:
        latents, t, text, pooled = inputs
        return denoiser(hidden_states=latents, encoder_hidden_states=text,
                        pooled_projections=pooled, timestep=t * 1000, return_dict=False)[0]

    def load_denoiser_with_lora(self, lora_dir: Path) -> nn.Module:
        from diffusers import StableDiffusion3Pipeline

        base = {"transformer": self.load_denoiser(torch.float32)} if self.single_file else {}
        pipe = StableDiffusion3Pipeline.from_pretrained(
            self.path, text_encoder=None, text_encoder_2=None, text_encoder_3=None, vae=None,
            tokenizer=None, tokenizer_2=None, tokenizer_3=None, **base)
        pipe.load_lora_weights(str(lora_dir))
        return pipe.transformer

    def load_exported_full(self, export_dir: Path) -> nn.Module:
        from diffusers import SD3Transformer2DModel

        return SD3Transformer2DModel.from_pretrained(export_dir / "transformer")

    def sampling(self):
        from dpipe.models.sd3.sampling import SD3Sampling

        return SD3Sampling(self)
