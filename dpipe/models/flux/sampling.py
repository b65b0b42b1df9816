"""FLUX.1 samples as `FluxPipeline` does: noise in (C, h, w), sigmas 1 -> 1/steps shifted by the
image's token count, the guidance-distilled scale as the model's input (3.5 for FLUX.1-dev), no
negative prompt; latents unpacked from 2x2 patches, then un-scaled and decoded by the KL VAE."""

from __future__ import annotations

import torch

from dpipe.models.common.latent_packing import unpack
from dpipe.models.sampling import Denoising, FamilySampling, SampleRequest


class FluxSampling(FamilySampling):
    default_steps = 28
    default_guidance = 3.5

    @property
    def guidance_kind(self) -> str:  # FLUX.1-dev embeds it; schnell takes none
        config = self.spec._read_config("transformer")
        return "embedded" if config.get("guidance_embeds") else "none"

    def prediction(self, output: torch.Tensor, d: Denoising) -> torch.Tensor:
        return unpack(output.float(), d.latents)

    def diffusers_sample(self, denoiser, request: SampleRequest, steps: int,
                         guidance: float) -> torch.Tensor:
        from diffusers import FluxPipeline

        pipe = FluxPipeline.from_pretrained(self.path, transformer=denoiser,
                                            dtype=torch.float32)
        packed = pipe(request.prompt, height=request.height, width=request.width,
                      num_inference_steps=steps, guidance_scale=guidance,
                      max_sequence_length=self.spec.cfg.max_text_tokens,
                      generator=torch.Generator().manual_seed(request.seed),
                      output_type="latent").images
        like = torch.empty(1, *self.latent_shape(request))
        return unpack(packed, like)
