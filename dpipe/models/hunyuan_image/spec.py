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

from dpipe.diffusion.loss import weighted_mean
from dpipe.models.attention_mask import (
    joint_padding_mask, real_tokens, trim_or_drop, trim_text_padding)
from dpipe.models.diffusers_folder import check_folder, load_denoiser, load_encoders, read_json
from dpipe.models.fingerprint import folder_fingerprint
from dpipe.models.hunyuan_image.comfyui import comfyui_lora
from dpipe.models.hunyuan_image.layers import HunyuanImageBlock, hunyuan_image_layers
from dpipe.models.hunyuan_image.original import file_form, from_original, to_original
from dpipe.models.lora_files import (
    DIFFUSERS_LORA, lora_scale, LoraFormat, peft_to_diffusers, write_lora_files)
from dpipe.models.single_file import check_single_file, split_path
from dpipe.models.spec import ModelSpec, NoisedBatch, PipelineLayer, denoiser_config, block_costs

log = logging.getLogger(__name__)

REQUIRED_PARTS = ("model_index.json", "transformer", "vae", "text_encoder", "text_encoder_2",
                  "tokenizer", "tokenizer_2", "scheduler")
COMFYUI_LORA = "hunyuan_image_lora_comfyui.safetensors"

# Every Linear of both kinds of blocks (attention incl. the text stream's, MLPs, AdaLN
# modulations), none outside them: the token refiner, embedders and head stay frozen.
_BLOCK_LINEARS = [
    r"attn\.to_q", r"attn\.to_k", r"attn\.to_v", r"attn\.to_out\.0",
    r"attn\.add_q_proj", r"attn\.add_k_proj", r"attn\.add_v_proj", r"attn\.to_add_out",
    r"ff\.net\.0\.proj", r"ff\.net\.2", r"ff_context\.net\.0\.proj", r"ff_context\.net\.2",
    r"norm1\.linear", r"norm1_context\.linear", r"norm\.linear", r"proj_mlp", r"proj_out",
]
LORA_TARGETS = r"(?:single_)?transformer_blocks\.\d+\.(?:" + "|".join(_BLOCK_LINEARS) + ")"


class HunyuanImageSpec(ModelSpec):
    family = "hunyuan_image"

    def __init__(self, cfg):
        super().__init__(cfg)
        # model.path: the diffusers folder, or a single-file transformer (Tencent's names) with
        # model.single_file_config naming the diffusers folder for the rest.
        self.path, self.single_file = split_path(cfg)

    def ensure_available(self) -> None:
        if self.cfg.tiny and not self.path.exists():
            from dpipe.models.hunyuan_image.tiny import make_tiny_hunyuan_image

            make_tiny_hunyuan_image(self.path)
        check_folder(self.path, REQUIRED_PARTS, "HunyuanImage 2.1",
                     "hunyuanvideo-community/HunyuanImage-2.1-Diffusers")
        check_single_file(self.single_file)
        self._config("vae")
        self._config("transformer")

    def _config(self, part: str) -> dict[str, Any]:
        return read_json(self.path / part / "config.json")

    @property
    def pixel_multiple(self) -> int:
        patch = self._config("transformer").get("patch_size", [1, 1])
        return int(self._config("vae")["spatial_compression_ratio"]) * int(max(patch))

    # ---- components -------------------------------------------------------------------------
    def load_encoders(self, device: torch.device, dtype: torch.dtype) -> Any:
        from diffusers import HunyuanImagePipeline

        return load_encoders(HunyuanImagePipeline, self.path, device, dtype,
                             frozen=("vae", "text_encoder", "text_encoder_2"),
                             guider=None, ocr_guider=None)

    def load_denoiser(self, dtype: torch.dtype) -> nn.Module:
        from diffusers import HunyuanImageTransformer2DModel

        # A single file: original names; fused weights split at the config's
        return load_denoiser(HunyuanImageTransformer2DModel, self.path, self.single_file, dtype,
                             convert=from_original)

    def encoder_fingerprint(self, kind: str) -> dict[str, Any]:
        if kind == "image":
            vae = self._config("vae")
            return {"family": self.family, "vae": folder_fingerprint(self.path / "vae"),
                    "scaling_factor": vae.get("scaling_factor"), "latent": "mode"}
        return {"family": self.family,
                **{p: folder_fingerprint(self.path / p) for p in
                   ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")},
                "max_text_tokens": self.cfg.max_text_tokens}

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
    def lora_targets(self) -> str:
        return LORA_TARGETS

    def pipeline_layers(self, denoiser: nn.Module) -> list[PipelineLayer]:
        return hunyuan_image_layers(denoiser, self.cfg.attention)

    def pipeline_layer_count(self) -> int:
        """hunyuan_image_layers: the embedding (which runs the first double-stream block), the
        other double- and every single-stream block, the head."""
        double, single = denoiser_config(
            self.path / "transformer", "HunyuanImageTransformer2DModel", "num_layers",
            "num_single_layers")
        return 1 + double + single

    def layer_costs(self, layers: list[PipelineLayer]) -> list[float]:
        return block_costs(layers, HunyuanImageBlock)

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
        weight = getattr(batch, "loss_weight", None)  # (B, 1, h, w) from masks, or None
        return inputs, (batch.target,) if weight is None else (batch.target, weight)

    def loss(self, outputs, labels) -> torch.Tensor:
        # labels: (target,) or (target, weight) with per-pixel loss weights (masks), broadcast over channels
        return weighted_mean(self.element_error(outputs, labels[0]), *labels[1:])

    # ---- export ------------------------------------------------------------------------------
    def export_lora(self, state_dict: dict[str, torch.Tensor], metadata: dict[str, Any],
                    out_dir: Path) -> list[Path]:
        # diffusers 0.42 gives HunyuanImagePipeline no LoRA loader mixin; the file is written in
        # the diffusers format all pipelines share (`transformer.`-prefixed peft keys + adapter
        # metadata), which the transformer's own `load_lora_adapter` reads.
        from diffusers.loaders.lora_base import LoraBaseMixin

        weights = peft_to_diffusers(state_dict)

        def write_diffusers() -> Path:
            LoraBaseMixin._save_lora_weights(
                out_dir, lora_layers={"transformer": weights},
                lora_metadata={"transformer": metadata}, weight_name=DIFFUSERS_LORA)
            return out_dir / DIFFUSERS_LORA

        return write_lora_files(out_dir, write_diffusers, [LoraFormat(
            COMFYUI_LORA, lambda: comfyui_lora(weights, lora_scale(metadata),
                                               self._config("transformer")),
            {"format": "comfyui"})])

    def export_full(self, shards: list[Path], out_dir: Path) -> Path:
        from dpipe.models.diffusers_folder import write_transformer_folder

        return write_transformer_folder(
            shards, out_dir, self.path, self.single_file,
            lambda weights: to_original(weights, self._config("transformer"), self._source_form()))

    def _source_form(self) -> str:
        from safetensors import safe_open

        with safe_open(self.single_file, "pt") as source:
            return file_form(k.removeprefix("model.").removeprefix("diffusion_model.")
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
        transformer = self.load_denoiser(torch.float32)
        transformer.load_lora_adapter(str(lora_dir), weight_name=DIFFUSERS_LORA, prefix="transformer")
        return transformer

    def load_exported_full(self, export_dir: Path) -> nn.Module:
        from diffusers import HunyuanImageTransformer2DModel

        return HunyuanImageTransformer2DModel.from_pretrained(export_dir / "transformer")

    def sampling(self):
        from dpipe.models.hunyuan_image.sampling import HunyuanImageSampling

        return HunyuanImageSampling(self)
