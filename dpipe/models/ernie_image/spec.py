"""ERNIE-Image: ErnieImageTransformer2DModel + AutoencoderKLFlux2 + Mistral3 text encoder.

Loads the diffusers folder layout of baidu/ERNIE-Image (`ErnieImagePipeline`). Prompts go through
the pipeline's own `encode_prompt`: each prompt alone, <s> first, no template, the text encoder's
hidden_states[-2] for every token; the cache keeps them zero-padded to max_text_tokens with each
length, and a batch is cut after its longest prompt (the transformer masks by length, so the
padding changes nothing). The prompt enhancer (`pe`) is not run: prompts are trained as given.

Conventions, from `ErnieImagePipeline.__call__`: latents are the VAE's, 2x2-patchified and
normalised with its BatchNorm running statistics (the pipeline decodes `x * sqrt(var + 1e-5) +
mean`, then unpatchifies); the transformer gets the scheduler's timestep, sigma * 1000, and
predicts the flow velocity noise - x0 that the Euler flow-matching scheduler steps with (dpipe's
default objective).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from dpipe.models.comfyui import diffusers_named
from dpipe.models.common.vae_batch_norm import normalised_patches
from dpipe.models.ernie_image.layers import ErnieImageBlock, ernie_image_layers
from dpipe.models.ernie_image.sizes import SAMPLE_SHAPES, SIZES
from dpipe.models.family import DiffusersFamily
from dpipe.models.lora_files import LoraFormat
from dpipe.models.spec import NoisedBatch, attention_train_flops, model_params

# Every Linear of every ErnieImageSharedAdaLNBlock: attention projections and the gated MLP.
LORA_TARGETS = (r"layers\.\d+\.(?:self_attention\.(?:to_q|to_k|to_v|to_out\.0)"
                r"|mlp\.(?:gate_proj|up_proj|linear_fc2))")
COMFYUI_LORA = "ernie_image_lora_comfyui.safetensors"
BN_EPS = 1e-5  # the pipeline's decode hard-codes it (its TODO: the trained value)


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """ErnieImagePipeline._patchify_latents: (B, C, H, W) -> (B, 4C, H/2, W/2)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return x.reshape(b, c * 4, h // 2, w // 2)


class ErnieImageSpec(DiffusersFamily):
    family = "ernie_image"
    title, example = "ERNIE-Image", "baidu/ERNIE-Image"
    pipeline_class, denoiser_class = "ErnieImagePipeline", "ErnieImageTransformer2DModel"
    required_parts = ("model_index.json", "transformer", "vae", "text_encoder", "tokenizer",
                      "scheduler")
    # The prompt enhancer (an LLM that rewrites prompts) is never run: not loaded.
    unused_parts = ("pe", "pe_tokenizer")
    text_notes = {"layout": "pipeline encode_prompt: hidden_states[-2], zero-padded + length"}
    image_latents = partial(normalised_patches, patchify=patchify, eps=BN_EPS)
    vae_config_keys = ()
    image_notes = {"latent": "mode, 2x2 patchified, batch-norm normalised (eps 1e-5)"}
    latent_patch = 2
    tiny_writer = "dpipe.models.ernie_image.tiny:make_tiny_ernie_image"
    lora_modules = LORA_TARGETS
    # The embedding is two projections and the timestep MLP, the head one projection: each far
    # below a block, so every stage gets blocks.
    layers, block_types = ernie_image_layers, (ErnieImageBlock,)
    sampler = "dpipe.models.ernie_image.sampling:ErnieImageSampling"
    # ---- caching -----------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        # The pipeline truncates at the tokenizer's model_max_length: here max_text_tokens, so
        # every prompt fits the cache's fixed length.
        tokenizer, length = encoders.tokenizer, self.cfg.max_text_tokens
        saved, tokenizer.model_max_length = tokenizer.model_max_length, length
        try:
            hiddens = encoders.encode_prompt(list(prompts), device=encoders.vae.device)
        finally:
            tokenizer.model_max_length = saved
        padded = hiddens[0].new_zeros(len(hiddens), length, hiddens[0].shape[-1])
        for i, h in enumerate(hiddens):
            padded[i, :h.shape[0]] = h
        lengths = torch.tensor([[h.shape[0]] for h in hiddens], dtype=torch.float32)
        return {"text": padded, "text_len": lengths}

    # ---- training ----------------------------------------------------------------------------
    def make_inputs(self, batch: NoisedBatch):
        b, c, h, w = batch.latents.shape
        lens = batch.text["text_len"].reshape(-1).round().long()
        # Cut after the longest prompt, on the CPU where batches are made (no device sync).
        text = batch.text["text"][:, :max(int(lens.max()), 1)]
        inputs = (batch.noisy, batch.timesteps, text, lens)
        weight = getattr(batch, "loss_weight", None)  # (B, 1, h, w) from masks, or None
        if weight is None:
            return inputs, (batch.target,)
        return inputs, (batch.target, weight.expand(b, c, h, w))

    def lora_formats(self, weights, metadata) -> list[LoraFormat]:
        # ComfyUI 0.33.0's ERNIE-Image keeps diffusers' names (comfy/ldm/ernie/model.py) and
        # maps LoRAs under `diffusion_model.` or `transformer.` (comfy/lora.py).
        return [LoraFormat(COMFYUI_LORA, lambda: diffusers_named(weights, metadata["lora_alpha"]),
                           {"format": "comfyui"})]

    # ---- using exported weights ----------------------------------------------------------------
    def denoiser_forward(self, denoiser: nn.Module, inputs) -> torch.Tensor:
        image, t, text, text_lens = inputs
        return denoiser(hidden_states=image, timestep=(t * 1000).to(image.dtype),
                        text_bth=text.to(image.dtype), text_lens=text_lens,
                        return_dict=False)[0]

    # ---- benchmarks -------------------------------------------------------------------------
    bench_configs = SIZES

    def random_sample(self, size: str):
        shapes = SAMPLE_SHAPES[size]
        return torch.randn(shapes["latents"]), {
            "text": torch.randn(shapes["text"]),
            "text_len": torch.tensor([float(shapes["valid"])])}

    def train_flops(self, denoiser: nn.Module, inputs: tuple, full: bool) -> float:
        """6 (full) or 4 (LoRA) x parameters x joint tokens, plus the blocks' attention."""
        image, _t, text = inputs[:3]
        c = denoiser.config
        seq = image.shape[-2] * image.shape[-1] // c.patch_size ** 2 + text.shape[1]
        attention = attention_train_flops(seq, c.hidden_size) * c.num_layers
        return image.shape[0] * ((6 if full else 4) * model_params(denoiser) * seq + attention)
