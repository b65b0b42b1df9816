"""FLUX.1 (dev / schnell): FluxTransformer2DModel + AutoencoderKL (16 ch) + CLIP-L + T5-XXL.

Loads the diffusers folder layout users download; text and image encoding go through diffusers'
own `FluxPipeline` so prompts are tokenised and embedded exactly as at inference. The transformer
may instead come from one file in Black Forest Labs' layout (`flux1-dev.safetensors`, with or
without ComfyUI's `model.diffusion_model.` prefix): model.path names the file and
model.single_file_config the diffusers folder that gives the VAE, text encoders and configs.
LoRAs are written for diffusers and for ComfyUI (BFL layout, fused q/k/v: see `common/bfl_layout.py`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpipe.config.schema import TrainMode
from dpipe.models.common.bfl_layout import comfyui_lora, flux1_layout, from_bfl, save_like_source
from dpipe.models.common.latent_packing import image_ids, pack, packed_labels
from dpipe.models.common.lora_targets import DUAL_STREAM_LORA_TARGETS
from dpipe.models.family import SINGLE_FILE_SUFFIXES, DiffusersFamily
from dpipe.models.flux.layers import FluxBlock, flux_layers
from dpipe.models.flux.sizes import SAMPLE_SHAPES, SIZES
from dpipe.models.lora_files import LoraFormat, lora_scale
from dpipe.models.spec import (
    EDGE_LAYER_TIME, NoisedBatch, PipelineLayer, joint_attention_train_flops)



# Forward + backward time per layer relative to a single-stream block, measured on an H200 at
# FLUX.1-dev size, 1024x1024, bf16, compiled (`python -m dpipe.bench.layers`;
# docs/bench-results/h200-1gpu-stage): a double-stream block costs 1.066x in a full fine-tune
# and 1.21x with LoRA r32 (more of its Linears carry adapters); the embedder and the head ~0.18x
# (EDGE_LAYER_TIME).
DOUBLE_BLOCK_TIME = {TrainMode.full: 1.07, TrainMode.lora: 1.21}


def from_bfl_file(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """A single file's BFL names and fused Linears -> diffusers', at the model's sizes."""
    return from_bfl(state, flux1_layout(model.config))


class FluxSpec(DiffusersFamily):
    family = "flux"
    title, example = "FLUX.1", "black-forest-labs/FLUX.1-dev"
    pipeline_class, denoiser_class = "FluxPipeline", "FluxTransformer2DModel"
    required_parts = ("model_index.json", "transformer", "vae", "text_encoder", "text_encoder_2",
                      "tokenizer", "tokenizer_2")
    frozen_parts = ("vae", "text_encoder", "text_encoder_2")
    text_fingerprint = {"clip": "text_encoder", "t5": "text_encoder_2",
                        "tokenizers": ("tokenizer", "tokenizer_2")}
    latent_patch = 2
    tiny_writer = "dpipe.models.flux.tiny:make_tiny_flux"
    lora_modules = DUAL_STREAM_LORA_TARGETS
    layers, block_count_keys = flux_layers, ("num_layers", "num_single_layers")
    sampler = "dpipe.models.flux.sampling:FluxSampling"
    single_file_suffixes = SINGLE_FILE_SUFFIXES
    from_single_file = from_bfl_file
    gguf_architectures = ("flux",)  # city96's FLUX.1-dev/schnell/Kontext GGUFs

    @property
    def comfyui_lora_name(self) -> str:
        return f"{self.family}_lora_comfyui.safetensors"

    # ---- caching -----------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        text, pooled, _ids = encoders.encode_prompt(
            prompts, prompt_2=None, device=encoders.vae.device,
            max_sequence_length=self.cfg.max_text_tokens,
        )
        return {"t5": text, "pooled": pooled}

    # ---- training ----------------------------------------------------------------------------
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
        return inputs, packed_labels(batch)

    # ---- export ------------------------------------------------------------------------------
    def lora_formats(self, weights, metadata) -> list[LoraFormat]:
        return [LoraFormat(self.comfyui_lora_name, lambda: comfyui_lora(
            weights, lora_scale(metadata), flux1_layout(self.part_config("transformer"))),
            {"format": "comfyui"})]

    def export_single_file(self, folder, out_dir):
        # BFL's layout in the source's prefix and dtype, as the FLUX families always wrote it.
        return save_like_source(folder, self.single_file, out_dir)

    # ---- using exported weights ----------------------------------------------------------------
    def denoiser_forward(self, denoiser: nn.Module, inputs) -> torch.Tensor:
        packed, t, text, pooled, guidance, txt_ids, img_ids = inputs
        return denoiser(
            hidden_states=packed, encoder_hidden_states=text, pooled_projections=pooled,
            timestep=t, img_ids=img_ids.float(), txt_ids=txt_ids.float(),
            guidance=guidance if denoiser.config.guidance_embeds else None, return_dict=False,
        )[0]

    # ---- benchmarks -------------------------------------------------------------------------
    bench_configs, sample_shapes, random_text = SIZES, SAMPLE_SHAPES, ("t5", "pooled")

    def train_flops(self, denoiser: nn.Module, inputs: tuple, full: bool) -> float:
        packed, _t, text = inputs[:3]
        seq = packed.shape[1] + text.shape[1]
        return joint_attention_train_flops(denoiser, packed.shape[0], seq, full)
