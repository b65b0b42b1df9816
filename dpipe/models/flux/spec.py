"""FLUX.1 (dev / schnell): FluxTransformer2DModel + AutoencoderKL (16 ch) + CLIP-L + T5-XXL.

Loads the diffusers folder layout users download; text and image encoding go through diffusers'
own `FluxPipeline` so prompts are tokenised and embedded exactly as at inference. The transformer
may instead come from one file in Black Forest Labs' layout (`flux1-dev.safetensors`, with or
without ComfyUI's `model.diffusion_model.` prefix): model.path names the file and
model.single_file_config the diffusers folder that gives the VAE, text encoders and configs.
LoRAs are written for diffusers and for ComfyUI (BFL layout, fused q/k/v: see `common/bfl_layout.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpipe.config.schema import TrainMode
from dpipe.diffusion.loss import weighted_mean
from dpipe.models.common.bfl_layout import comfyui_lora, flux1_layout, from_bfl, save_bfl_file, source_format
from dpipe.models.common.latent_packing import image_ids, pack
from dpipe.models.diffusers_folder import (
    check_folder, kl_image_fingerprint, kl_latents, load_denoiser, load_encoders, read_json)
from dpipe.models.fingerprint import folder_fingerprint
from dpipe.models.flux.layers import FluxBlock, flux_layers
from dpipe.models.flux.sizes import SAMPLE_SHAPES, SIZES
from dpipe.models.lora_files import (
    DIFFUSERS_LORA, lora_scale, LoraFormat, peft_to_diffusers, save_diffusers_lora,
    write_lora_files)
from dpipe.models.single_file import check_single_file, split_path
from dpipe.models.spec import (
    EDGE_LAYER_TIME, ModelSpec, NoisedBatch, PipelineLayer, denoiser_config,
    joint_attention_train_flops)

REQUIRED_PARTS = ("model_index.json", "transformer", "vae", "text_encoder", "text_encoder_2",
                  "tokenizer", "tokenizer_2")

# What the community trains for FLUX LoRAs: every Linear of both kinds of blocks (attention,
# MLPs, modulation), none outside them. A peft regex over diffusers' module names.
_BLOCK_LINEARS = [
    r"attn\.to_q", r"attn\.to_k", r"attn\.to_v", r"attn\.to_out\.0",
    r"attn\.add_q_proj", r"attn\.add_k_proj", r"attn\.add_v_proj", r"attn\.to_add_out",
    r"ff\.net\.0\.proj", r"ff\.net\.2", r"ff_context\.net\.0\.proj", r"ff_context\.net\.2",
    r"norm1\.linear", r"norm1_context\.linear", r"norm\.linear", r"proj_mlp", r"proj_out",
]
LORA_TARGETS = r"(?:single_)?transformer_blocks\.\d+\.(?:" + "|".join(_BLOCK_LINEARS) + ")"


# Forward + backward time per layer relative to a single-stream block, measured on an H200 at
# FLUX.1-dev size, 1024x1024, bf16, compiled (`python -m dpipe.bench.layers`;
# docs/bench-results/h200-1gpu-stage): a double-stream block costs 1.066x in a full fine-tune
# and 1.21x with LoRA r32 (more of its Linears carry adapters); the embedder and the head ~0.18x
# (EDGE_LAYER_TIME).
DOUBLE_BLOCK_TIME = {TrainMode.full: 1.07, TrainMode.lora: 1.21}


class FluxSpec(ModelSpec):
    family = "flux"

    def __init__(self, cfg):
        super().__init__(cfg)
        # model.path: the diffusers folder, or a single-file transformer in BFL's layout with
        # model.single_file_config naming the diffusers folder for the rest.
        self.path, self.single_file = split_path(cfg)

    @property
    def comfyui_lora_name(self) -> str:
        return f"{self.family}_lora_comfyui.safetensors"

    def ensure_available(self) -> None:
        if self.cfg.tiny and not self.path.exists():
            from dpipe.models.flux.tiny import make_tiny_flux

            make_tiny_flux(self.path)
        check_folder(self.path, REQUIRED_PARTS, "FLUX.1", "black-forest-labs/FLUX.1-dev")
        check_single_file(self.single_file)
        self._vae_config()  # reads the VAE's scale now, so a broken folder fails before training

    def _read_config(self, part: str) -> dict[str, Any]:
        return read_json(self.path / part / "config.json")

    def _vae_config(self) -> dict[str, Any]:
        return self._read_config("vae")

    def pipeline_layer_count(self) -> int:
        """flux_layers: the embedding, every double- and single-stream block, the head."""
        double, single = denoiser_config(self.path / "transformer", "FluxTransformer2DModel",
                                         "num_layers", "num_single_layers")
        return 2 + double + single

    @property
    def pixel_multiple(self) -> int:
        # VAE downscale (x8 for FLUX.1), then 2x2 patch packing.
        return 2 ** (len(self._vae_config()["block_out_channels"]) - 1) * 2

    # ---- components -------------------------------------------------------------------------
    def load_encoders(self, device: torch.device, dtype: torch.dtype) -> Any:
        from diffusers import FluxPipeline

        return load_encoders(FluxPipeline, self.path, device, dtype,
                             frozen=("vae", "text_encoder", "text_encoder_2"))

    def load_denoiser(self, dtype: torch.dtype) -> nn.Module:
        from diffusers import FluxTransformer2DModel

        def from_file(state, model):  # a single file has BFL's names and fused Linears
            return from_bfl(state, flux1_layout(model.config))

        return load_denoiser(FluxTransformer2DModel, self.path, self.single_file, dtype,
                             convert=from_file)

    def encoder_fingerprint(self, kind: str) -> dict[str, Any]:
        if kind == "image":
            return kl_image_fingerprint(self.family, self.path)
        return {
            "family": self.family,
            "clip": folder_fingerprint(self.path / "text_encoder"),
            "t5": folder_fingerprint(self.path / "text_encoder_2"),
            "tokenizers": [folder_fingerprint(self.path / f) for f in ("tokenizer", "tokenizer_2")],
            "max_text_tokens": self.cfg.max_text_tokens,
        }

    # ---- caching -----------------------------------------------------------------------------
    def encode_images(self, encoders: Any, pixels: torch.Tensor) -> torch.Tensor:
        return kl_latents(encoders.vae, pixels)

    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        text, pooled, _ids = encoders.encode_prompt(
            prompts, prompt_2=None, device=encoders.vae.device,
            max_sequence_length=self.cfg.max_text_tokens,
        )
        return {"t5": text, "pooled": pooled}

    # ---- training ----------------------------------------------------------------------------
    def lora_targets(self) -> str:
        return LORA_TARGETS

    def pipeline_layers(self, denoiser: nn.Module) -> list[PipelineLayer]:
        return flux_layers(denoiser)

    def layer_costs(self, layers: list[PipelineLayer]) -> list[float]:
        """Measured time per layer (DOUBLE_BLOCK_TIME). A double-stream block holds 2.4x the
        parameters of a single-stream one but takes about the same time: balancing parameters
        would give the first stage far too few blocks."""
        double_time = DOUBLE_BLOCK_TIME[self.cfg.mode]
        costs = []
        for layer in layers:
            if isinstance(layer, FluxBlock):
                double = any(n.endswith("ff_context") for n, _ in layer.named_modules())
                costs.append(double_time if double else 1.0)
            else:
                costs.append(EDGE_LAYER_TIME)
        return costs

    def make_inputs(self, batch: NoisedBatch):
        b, c, h, w = batch.latents.shape
        packed = pack(batch.noisy)
        text = batch.text["t5"]
        txt_ids = torch.zeros(text.shape[1], 3, dtype=torch.long)
        img_ids = image_ids(h // 2, w // 2)
        guidance = getattr(batch, "guidance", None)  # set when sampling
        if guidance is None:
            guidance = torch.full((b,), float(self.cfg.guidance))
        inputs = (packed, batch.timesteps, text, batch.text["pooled"], guidance, txt_ids, img_ids)
        weight = getattr(batch, "loss_weight", None)  # (B, 1, h, w) from masks, or None
        if weight is None:
            return inputs, (pack(batch.target),)
        # Packed as the target: channel-major groups of the 2x2 patch, so repeat over channels.
        return inputs, (pack(batch.target), pack(weight.expand(b, 1, h, w)).repeat(1, 1, c))

    def loss(self, outputs, labels) -> torch.Tensor:
        # labels: (target,) or (target, weight) with per-element loss weights (masks)
        return weighted_mean(self.element_error(outputs, labels[0]), *labels[1:])

    # ---- export ------------------------------------------------------------------------------
    def export_lora(self, state_dict: dict[str, torch.Tensor], metadata: dict[str, Any],
                    out_dir: Path) -> list[Path]:
        from diffusers import FluxPipeline

        weights = peft_to_diffusers(state_dict)
        return write_lora_files(
            out_dir, lambda: save_diffusers_lora(FluxPipeline, weights, metadata, out_dir),
            [LoraFormat(self.comfyui_lora_name, lambda: comfyui_lora(
                weights, lora_scale(metadata), flux1_layout(self._read_config("transformer"))),
                {"format": "comfyui"})])

    def export_full(self, shards: list[Path], out_dir: Path) -> Path:
        from dpipe.models.diffusers_folder import write_denoiser_folder

        folder = write_denoiser_folder(
            shards, out_dir / "transformer", self.path / "transformer" / "config.json")
        if self.single_file is not None:  # also in the layout it came in, named, typed and
            # prefixed as the source, so tools that loaded that file load the fine-tune the same way
            prefix, dtype = source_format(self.single_file)
            save_bfl_file(folder, out_dir / self.single_file.name, prefix, dtype)
        return folder

    # ---- using exported weights ----------------------------------------------------------------
    def denoiser_forward(self, denoiser: nn.Module, inputs) -> torch.Tensor:
        packed, t, text, pooled, guidance, txt_ids, img_ids = inputs
        return denoiser(
            hidden_states=packed, encoder_hidden_states=text, pooled_projections=pooled,
            timestep=t, img_ids=img_ids.float(), txt_ids=txt_ids.float(),
            guidance=guidance if denoiser.config.guidance_embeds else None, return_dict=False,
        )[0]

    def load_denoiser_with_lora(self, lora_dir: Path) -> nn.Module:
        from diffusers import FluxPipeline

        pipe = FluxPipeline.from_pretrained(self.path, text_encoder=None, text_encoder_2=None,
                                            vae=None, tokenizer=None, tokenizer_2=None,
                                            transformer=self.load_denoiser(torch.float32))
        pipe.load_lora_weights(str(lora_dir), weight_name=DIFFUSERS_LORA)
        return pipe.transformer

    def load_exported_full(self, export_dir: Path) -> nn.Module:
        from diffusers import FluxTransformer2DModel

        return FluxTransformer2DModel.from_pretrained(export_dir / "transformer")

    def sampling(self):
        from dpipe.models.flux.sampling import FluxSampling

        return FluxSampling(self)

    # ---- benchmarks -------------------------------------------------------------------------
    bench_configs = SIZES

    def random_sample(self, size: str):
        shapes = SAMPLE_SHAPES[size]
        latents = torch.randn(shapes["latents"])
        text = {"t5": torch.randn(shapes["t5"]), "pooled": torch.randn(shapes["pooled"])}
        return latents, text

    def train_flops(self, denoiser: nn.Module, inputs: tuple, full: bool) -> float:
        packed, _t, text = inputs[:3]
        seq = packed.shape[1] + text.shape[1]
        return joint_attention_train_flops(denoiser, packed.shape[0], seq, full)
