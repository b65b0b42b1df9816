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

from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpipe.diffusion.loss import weighted_mean
from dpipe.models.auraflow.comfyui import comfyui_lora, from_original, native_state_dict
from dpipe.models.auraflow.layers import AuraFlowJointBlock, AuraFlowSingleBlock, auraflow_layers
from dpipe.models.diffusers_folder import (
    check_folder, kl_image_fingerprint, kl_latents, load_denoiser, load_encoders, read_json)
from dpipe.models.fingerprint import folder_fingerprint
from dpipe.models.lora_files import (
    DIFFUSERS_LORA, lora_scale, LoraFormat, peft_to_diffusers, save_diffusers_lora,
    write_lora_files)
from dpipe.models.single_file import check_single_file, split_path
from dpipe.models.spec import ModelSpec, NoisedBatch, PipelineLayer, denoiser_config, block_costs

REQUIRED_PARTS = ("model_index.json", "transformer", "vae", "text_encoder", "tokenizer",
                  "scheduler")

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


class AuraFlowSpec(ModelSpec):
    family = "auraflow"

    def __init__(self, cfg):
        super().__init__(cfg)
        # model.path: the diffusers folder, or a single-file transformer (original names) with
        # model.single_file_config naming the diffusers folder for the rest.
        self.path, self.single_file = split_path(cfg)

    def ensure_available(self) -> None:
        if self.cfg.tiny and not self.path.exists():
            from dpipe.models.auraflow.tiny import make_tiny_auraflow

            make_tiny_auraflow(self.path)
        check_folder(self.path, REQUIRED_PARTS, "AuraFlow", "fal/AuraFlow-v0.3")
        check_single_file(self.single_file)
        self._config("vae")
        self._config("transformer")

    def _config(self, part: str) -> dict[str, Any]:
        return read_json(self.path / part / "config.json")

    @property
    def pixel_multiple(self) -> int:
        vae_scale = 2 ** (len(self._config("vae")["block_out_channels"]) - 1)
        return vae_scale * int(self._config("transformer").get("patch_size", 2))

    # ---- components -------------------------------------------------------------------------
    def load_encoders(self, device: torch.device, dtype: torch.dtype) -> Any:
        from diffusers import AuraFlowPipeline

        return load_encoders(AuraFlowPipeline, self.path, device, dtype,
                             frozen=("vae", "text_encoder"))

    def load_denoiser(self, dtype: torch.dtype) -> nn.Module:
        from diffusers import AuraFlowTransformer2DModel

        # A single file: original names; the config from the folder
        return load_denoiser(AuraFlowTransformer2DModel, self.path, self.single_file, dtype,
                             convert=from_original)

    def encoder_fingerprint(self, kind: str) -> dict[str, Any]:
        if kind == "image":
            return kl_image_fingerprint(self.family, self.path)
        return {"family": self.family, "t5": folder_fingerprint(self.path / "text_encoder"),
                "tokenizer": folder_fingerprint(self.path / "tokenizer"),
                "max_text_tokens": self.cfg.max_text_tokens}

    # ---- caching -----------------------------------------------------------------------------
    def encode_images(self, encoders: Any, pixels: torch.Tensor) -> torch.Tensor:
        return kl_latents(encoders.vae, pixels)

    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, _mask, _neg, _neg_mask = encoders.encode_prompt(
            prompts, do_classifier_free_guidance=False, device=encoders.vae.device,
            max_sequence_length=self.cfg.max_text_tokens)
        return {"t5": embeds}

    # ---- training ----------------------------------------------------------------------------
    def lora_targets(self) -> str:
        return LORA_TARGETS

    def pipeline_layers(self, denoiser: nn.Module) -> list[PipelineLayer]:
        return auraflow_layers(denoiser)

    def pipeline_layer_count(self) -> int:
        """auraflow_layers: the embedding, every joint and single block, the head."""
        joint, single = denoiser_config(
            self.path / "transformer", "AuraFlowTransformer2DModel", "num_mmdit_layers",
            "num_single_dit_layers")
        return 2 + joint + single

    def layer_costs(self, layers: list[PipelineLayer]) -> list[float]:
        return block_costs(layers, (AuraFlowJointBlock, AuraFlowSingleBlock))

    def make_inputs(self, batch: NoisedBatch):
        inputs = (batch.noisy, batch.timesteps, batch.text["t5"])
        weight = getattr(batch, "loss_weight", None)  # (B, 1, h, w) from masks, or None
        return inputs, (batch.target,) if weight is None else (batch.target, weight)

    def loss(self, outputs, labels) -> torch.Tensor:
        # labels: (target,) or (target, weight) with per-pixel loss weights (masks), broadcast over channels
        return weighted_mean(self.element_error(outputs, labels[0]), *labels[1:])

    # ---- export ------------------------------------------------------------------------------
    def export_lora(self, state_dict: dict[str, torch.Tensor], metadata: dict[str, Any],
                    out_dir: Path) -> list[Path]:
        from diffusers import AuraFlowPipeline

        weights = peft_to_diffusers(state_dict)
        return write_lora_files(
            out_dir, lambda: save_diffusers_lora(AuraFlowPipeline, weights, metadata, out_dir),
            [LoraFormat(COMFYUI_LORA, lambda: comfyui_lora(weights, lora_scale(metadata)),
                        {"format": "comfyui"})])

    def export_full(self, shards: list[Path], out_dir: Path) -> Path:
        from dpipe.models.diffusers_folder import write_transformer_folder

        return write_transformer_folder(shards, out_dir, self.path, self.single_file,
                                        native_state_dict)

    # ---- using exported weights ----------------------------------------------------------------
    def denoiser_forward(self, denoiser: nn.Module, inputs) -> torch.Tensor:
        latents, t, text = inputs
        return denoiser(latents, encoder_hidden_states=text, timestep=t, return_dict=False)[0]

    def load_denoiser_with_lora(self, lora_dir: Path) -> nn.Module:
        from diffusers import AuraFlowPipeline

        base = {"transformer": self.load_denoiser(torch.float32)} if self.single_file else {}
        pipe = AuraFlowPipeline.from_pretrained(
            self.path, text_encoder=None, vae=None, tokenizer=None, **base)
        pipe.load_lora_weights(str(lora_dir), weight_name=DIFFUSERS_LORA)
        return pipe.transformer

    def load_exported_full(self, export_dir: Path) -> nn.Module:
        from diffusers import AuraFlowTransformer2DModel

        return AuraFlowTransformer2DModel.from_pretrained(export_dir / "transformer")

    def sampling(self):
        from dpipe.models.auraflow.sampling import AuraFlowSampling

        return AuraFlowSampling(self)
