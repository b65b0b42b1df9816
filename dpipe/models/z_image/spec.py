"""Z-Image (Turbo / base): ZImageTransformer2DModel + AutoencoderKL (FLUX's VAE) + Qwen3 text encoder.

Loads the diffusers folder layout of Tongyi-MAI/Z-Image-Turbo; prompts go through diffusers'
own `ZImagePipeline.encode_prompt` (Qwen3 chat template, second-to-last hidden state, padding
dropped), so training sees exactly what inference sees.

Conventions of the family, from `ZImagePipeline.__call__`: the transformer is given
t_model = 1 - sigma (1 = clean image) and its output is the negated flow velocity, x0 - noise
(the pipeline steps with `-output`). `noise` below sets the target to match, so the loss is the
usual flow-matching MSE.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpipe.diffusion.flow_matching import noisy_latents, velocity_target
from dpipe.diffusion.loss import weighted_labels
from dpipe.models.comfyui import comfy_lora_tensors
from dpipe.models.common.shapes import round_up
from dpipe.models.diffusers_folder import kl_latents
from dpipe.models.family import SINGLE_FILE_SUFFIXES, DiffusersFamily
from dpipe.models.lora_files import LoraFormat
from dpipe.models.refined_joint import (
    NOMINAL_IMAGE_TOKENS, layer_forward_flops, refined_joint_train_flops)
from dpipe.models.spec import NoisedBatch
from dpipe.models.z_image.comfyui import comfy_lora_pairs
from dpipe.models.z_image.layers import SEQ_MULTI_OF, z_image_layers
from dpipe.models.z_image.sizes import SAMPLE_SHAPES, SIZES

# Every Linear of every ZImageTransformerBlock (main layers and both refiners): attention,
# SwiGLU MLP and the adaLN modulation, as the community's Z-Image LoRAs target them.
_BLOCK_LINEARS = [r"attention\.to_q", r"attention\.to_k", r"attention\.to_v", r"attention\.to_out\.0",
                  r"feed_forward\.w1", r"feed_forward\.w2", r"feed_forward\.w3", r"adaLN_modulation\.0"]
LORA_TARGETS = r"(?:layers|noise_refiner|context_refiner)\.\d+\.(?:" + "|".join(_BLOCK_LINEARS) + ")"

# Weights that see one token per sample, and the embedder's that see the caption's (layer_costs).
PER_SAMPLE_WEIGHTS = ("t_embedder", "adaLN_modulation")
TEXT_WEIGHTS = ("cap_embedder",)
COMFY_LORA = "comfyui_lora.safetensors"


class ZImageSpec(DiffusersFamily):
    family = "z_image"
    title, example = "Z-Image", "Tongyi-MAI/Z-Image-Turbo"
    pipeline_class, denoiser_class = "ZImagePipeline", "ZImageTransformer2DModel"
    required_parts = ("model_index.json", "transformer", "vae", "text_encoder", "tokenizer")
    text_notes = {"layout": "chat template, hidden_states[-2], padding dropped, zero-padded + length"}
    tiny_writer = "dpipe.models.z_image.tiny:make_tiny_z_image"
    lora_modules = LORA_TARGETS
    # z_image_layers: the embedding, the image's and the caption's refiner blocks, the join,
    # every main block, the head.
    layers, edge_layers = z_image_layers, 3
    block_count_keys = ("n_refiner_layers", "n_refiner_layers", "n_layers")
    sampler = "dpipe.models.z_image.sampling:ZImageSampling"
    # A single file (ComfyUI's / the original layout), its names mapped by diffusers' converter.
    single_file_suffixes = SINGLE_FILE_SUFFIXES

    @property
    def pixel_multiple(self) -> int:
        # VAE downscale (x8 for the real model), then 2x2 patches.
        patch = self.part_config("transformer").get("all_patch_size", [2])[0]
        return super().pixel_multiple * patch

    # ---- components -------------------------------------------------------------------------
    @staticmethod
    def from_single_file(state: dict[str, torch.Tensor], model: nn.Module
                         ) -> dict[str, torch.Tensor]:
        """The original names -> diffusers', by diffusers' own converter (which empties the
        dict it is given: a copy goes in)."""
        from diffusers.loaders.single_file_utils import (
            convert_z_image_transformer_checkpoint_to_diffusers)

        return convert_z_image_transformer_checkpoint_to_diffusers(dict(state))

    # ---- caching -----------------------------------------------------------------------------
    def encode_images(self, encoders: Any, pixels: torch.Tensor) -> torch.Tensor:
        return kl_latents(encoders.vae, pixels)

    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, _ = encoders.encode_prompt(
            list(prompts), device=encoders.vae.device, do_classifier_free_guidance=False,
            max_sequence_length=self.cfg.max_text_tokens)
        # Variable-length per prompt: cached zero-padded to max_text_tokens with the length, so
        # every entry has one shape; the layers drop the padding again.
        length = self.cfg.max_text_tokens
        padded = embeds[0].new_zeros(len(embeds), length, embeds[0].shape[-1])
        for i, e in enumerate(embeds):
            padded[i, : e.shape[0]] = e
        lengths = torch.tensor([[e.shape[0]] for e in embeds], dtype=torch.float32)
        return {"cap": padded, "cap_len": lengths}

    # ---- training ----------------------------------------------------------------------------
    def noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor):
        # Z-Image predicts x0 - noise (the pipeline negates its output before stepping).
        return noisy_latents(x0, noise, t), -velocity_target(x0, noise)

    def layer_costs(self, layers) -> list[float]:
        """Forward FLOPs per layer at a 1024x1024 image and the longest caption
        (`dpipe.models.refined_joint`): the caption refiners run a block's weights over the
        caption alone, the timestep embedder and the modulations once per sample."""
        return layer_forward_flops(layers, NOMINAL_IMAGE_TOKENS,
                                   round_up(self.cfg.max_text_tokens, SEQ_MULTI_OF),
                                   per_sample=PER_SAMPLE_WEIGHTS, text_weights=TEXT_WEIGHTS)

    def make_inputs(self, batch: NoisedBatch):
        t_model = 1.0 - batch.timesteps  # the pipeline's (1000 - t) / 1000
        cap_len = batch.text["cap_len"].reshape(-1).round().long()
        # Cut after the longest caption (the cache pads to max_text_tokens). diffusers pads each
        # caption to a multiple of 32 with its pad token, which is attended, and the batch to the
        # longest: only that batch padding needs a mask, and none is left for one item. On the
        # CPU, where batches are made: reading a GPU mask would make the host wait.
        cap = batch.text["cap"][:, :max(int(cap_len.max()), 1)]
        padded = torch.arange(round_up(cap.shape[1], SEQ_MULTI_OF))
        cap_mask = (padded[None, :] < round_up(cap_len, SEQ_MULTI_OF)[:, None]).long()
        if bool(cap_mask.all()):
            cap_mask = cap_mask[:, :0]  # nothing to mask (attention_mask.has_padding)
        return (batch.noisy, t_model, cap, cap_len, cap_mask), weighted_labels(batch)

    # ---- export ------------------------------------------------------------------------------
    def lora_formats(self, weights, metadata) -> list[LoraFormat]:
        return [LoraFormat(COMFY_LORA, lambda: comfy_lora_tensors(
            comfy_lora_pairs(weights, metadata["lora_alpha"])), {"format": "pt"})]

    # ---- using exported weights ----------------------------------------------------------------
    def denoiser_forward(self, denoiser: nn.Module, inputs) -> torch.Tensor:
        latents, t_model, cap, cap_len, _cap_mask = inputs
        x = [lat.unsqueeze(1) for lat in latents]  # (C, F=1, H, W) per item
        caps = [c[: int(n)] for c, n in zip(cap, cap_len)]
        out = denoiser(x, t_model, caps, return_dict=False)[0]
        return torch.stack(out).squeeze(2)

    # ---- benchmarks -------------------------------------------------------------------------
    bench_configs = SIZES

    def random_sample(self, size: str):
        shapes = SAMPLE_SHAPES[size]
        text = {"cap": torch.randn(shapes["cap"]),
                "cap_len": torch.tensor([float(shapes["text_tokens"])])}
        return torch.randn(shapes["latents"]), text

    def train_flops(self, denoiser: nn.Module, inputs: tuple, full: bool) -> float:
        latents, _t, cap = inputs[:3]
        b, _, h, w = latents.shape
        p = denoiser.config.all_patch_size[0]
        # diffusers pads each stream to a multiple of 32 tokens, attended (layers.py).
        image, text = (round_up(n, SEQ_MULTI_OF) for n in ((h // p) * (w // p), cap.shape[1]))
        return refined_joint_train_flops(denoiser, b, image, text, denoiser.config.dim,
                                         denoiser.t_embedder, full)
