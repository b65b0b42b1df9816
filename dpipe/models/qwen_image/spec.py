"""Qwen-Image: QwenImageTransformer2DModel + AutoencoderKLQwenImage + Qwen2.5-VL-7B text encoder.

Loads the diffusers folder layout of Qwen/Qwen-Image. Prompts go through diffusers' own
`QwenImagePipeline.encode_prompt` (its system template, whose 34 tokens are dropped; the last
hidden state of the valid tokens), so training sees what inference sees.

Conventions, from `QwenImagePipeline.__call__`: latents are normalised per channel with the VAE's
latents_mean / latents_std and packed in 2x2 patches; the transformer gets sigma in [0, 1] and
predicts the flow velocity noise - x0 (dpipe's default objective).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpipe.models.attention_mask import padding_mask
from dpipe.models.comfyui import diffusers_named
from dpipe.models.common.latent_packing import pack, packed_labels
from dpipe.models.diffusers_folder import wan_vae_image_latents
from dpipe.models.family import SINGLE_FILE_SUFFIXES, DiffusersFamily
from dpipe.models.lora_files import LoraFormat
from dpipe.models.qwen_image.layers import (
    grids, image_grids, qwen_image_layers, target_tokens, text_inputs)
from dpipe.models.qwen_image.sizes import SAMPLE_SHAPES, SIZES
from dpipe.models.spec import NoisedBatch, joint_attention_train_flops

REQUIRED_PARTS = ("model_index.json", "transformer", "vae", "text_encoder", "tokenizer")

# Every Linear of every QwenImageTransformerBlock: both streams' attention projections, MLPs and
# modulations, as the community's Qwen-Image LoRAs target them.
_BLOCK_LINEARS = [
    r"attn\.to_q", r"attn\.to_k", r"attn\.to_v", r"attn\.to_out\.0",
    r"attn\.add_q_proj", r"attn\.add_k_proj", r"attn\.add_v_proj", r"attn\.to_add_out",
    r"img_mlp\.net\.0\.proj", r"img_mlp\.net\.2", r"txt_mlp\.net\.0\.proj", r"txt_mlp\.net\.2",
    r"img_mod\.1", r"txt_mod\.1",
]
LORA_TARGETS = r"transformer_blocks\.\d+\.(?:" + "|".join(_BLOCK_LINEARS) + ")"

COMFY_LORA = "comfyui_lora.safetensors"


class QwenImageSpec(DiffusersFamily):
    family = "qwen_image"
    title, example = "Qwen-Image", "Qwen/Qwen-Image"
    pipeline_class, denoiser_class = "QwenImagePipeline", "QwenImageTransformer2DModel"
    required_parts = REQUIRED_PARTS
    text_notes = {
        "layout": "pipeline template, hidden_states[-1], template dropped, zero-padded + length"}
    image_latents = wan_vae_image_latents  # a video VAE: one frame
    vae_config_keys = ("latents_mean", "latents_std")
    latent_patch = 2
    tiny_writer = "dpipe.models.qwen_image.tiny:make_tiny_qwen_image"
    lora_modules = LORA_TARGETS
    layers = qwen_image_layers
    sampler = "dpipe.models.qwen_image.sampling:QwenImageSampling"
    # A single-file transformer: ComfyUI's layout, which has the diffusers names.
    single_file_suffixes = SINGLE_FILE_SUFFIXES
    gguf_architectures = ("qwen_image",)

    # ---- caching -----------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, mask = encoders.encode_prompt(
            list(prompts), device=encoders.vae.device,
            max_sequence_length=self.cfg.max_text_tokens)
        return self._padded(embeds, mask)

    def _padded(self, embeds: torch.Tensor, mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
        # Cached at one length for every prompt (zero-padded, with each prompt's length); the
        # pipeline's mask marks a prefix of valid tokens.
        b, n, d = embeds.shape
        length = self.cfg.max_text_tokens
        if n > length:
            from dpipe.errors import ConfigError

            raise ConfigError(
                f"a prompt encodes to {n} tokens, more than model.max_text_tokens={length}, the "
                "fixed length text is padded to in training; raise model.max_text_tokens")
        padded = embeds.new_zeros(b, length, d)
        padded[:, :n] = embeds
        lengths = mask.sum(dim=1) if mask is not None else torch.full((b,), n)
        return {"text": padded, "text_len": lengths.float().view(b, 1)}

    # ---- training ----------------------------------------------------------------------------
    def make_inputs(self, batch: NoisedBatch):
        b, c, h, w = batch.latents.shape
        shapes = image_grids((1, h // 2, w // 2))
        inputs = (pack(batch.noisy), batch.timesteps, *text_inputs(batch.text), shapes)
        return inputs, packed_labels(batch)

    # ---- export ------------------------------------------------------------------------------
    def lora_formats(self, weights, metadata) -> list[LoraFormat]:
        # ComfyUI's Qwen-Image uses the diffusers module names (its single-file checkpoints too).
        return [LoraFormat(COMFY_LORA, lambda: diffusers_named(weights, metadata["lora_alpha"]),
                           {"format": "pt"})]

    # ---- using exported weights ----------------------------------------------------------------
    def denoiser_forward(self, denoiser: nn.Module, inputs) -> torch.Tensor:
        image, t, text, text_mask, shapes = inputs[:5]
        if len(inputs) > 5:
            image = torch.cat([image, inputs[5]], dim=1)
        # As the pipeline calls it: text cut to the batch's longest prompt (make_inputs), no
        # mask if all full.
        mask = padding_mask(text_mask)
        out = denoiser(hidden_states=image, encoder_hidden_states=text,
                       encoder_hidden_states_mask=mask,
                       timestep=t, img_shapes=grids(shapes, image.shape[0]), return_dict=False)[0]
        return out[:, :target_tokens(shapes)]

    # ---- benchmarks -------------------------------------------------------------------------
    bench_configs = SIZES

    def random_sample(self, size: str):
        shapes = SAMPLE_SHAPES[size]
        text = {"text": torch.randn(shapes["text"]),
                "text_len": torch.tensor([float(shapes["text_tokens"])])}
        return torch.randn(shapes["latents"]), text

    def train_flops(self, denoiser: nn.Module, inputs: tuple, full: bool) -> float:
        packed, _t, text = inputs[:3]
        return joint_attention_train_flops(denoiser, packed.shape[0],
                                           packed.shape[1] + text.shape[1], full)
