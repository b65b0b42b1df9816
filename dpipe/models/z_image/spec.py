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

from dpipe.diffusion.loss import weighted_labels
from dpipe.models.common.lumina import LuminaFamily
from dpipe.models.common.shapes import round_up
from dpipe.models.family import SINGLE_FILE_SUFFIXES
from dpipe.models.refined_joint import refined_joint_train_flops
from dpipe.models.spec import NoisedBatch
from dpipe.models.z_image.comfyui import comfy_lora_pairs, from_native
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


class ZImageSpec(LuminaFamily):
    """Lumina 2's design in its own transformer class: the same refiners, objective (`noise`),
    stage balancing and ComfyUI LoRA file; its own module names, caption lengths and inputs."""
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
    # A single file (ComfyUI's / the original layout), or its GGUF: city96's converter tells
    # Z-Image by Lumina 2's keys (cap_embedder, context_refiner's fused qkv), so Z-Image Turbo's
    # GGUFs carry `lumina2`.
    single_file_suffixes = SINGLE_FILE_SUFFIXES
    gguf_architectures = ("lumina2",)
    from_single_file = from_native
    comfy_lora_pairs = comfy_lora_pairs
    # layer_costs: diffusers pads each stream to a multiple of 32 tokens, attended (layers.py).
    per_sample_weights, text_weights = PER_SAMPLE_WEIGHTS, TEXT_WEIGHTS
    text_token_multiple = SEQ_MULTI_OF

    @property
    def pixel_multiple(self) -> int:
        # VAE downscale (x8 for the real model), then 2x2 patches.
        patch = self.part_config("transformer").get("all_patch_size", [2])[0]
        return super().pixel_multiple * patch

    # ---- caching -----------------------------------------------------------------------------
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
