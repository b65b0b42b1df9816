"""FLUX.1 samples as `FluxPipeline` does: noise in (C, h, w), sigmas 1 -> 1/steps shifted by the
image's token count, the guidance-distilled scale as the model's input (3.5 for FLUX.1-dev), no
negative prompt; latents unpacked from 2x2 patches, then un-scaled and decoded by the KL VAE.
FLUX.1 Kontext samples edits the same way (`FluxKontextSampling`)."""

from __future__ import annotations

import torch

from dpipe.models.common.latent_packing import unpack
from dpipe.models.sampling import Denoising, FamilySampling, SampleRequest


class FluxSampling(FamilySampling):
    default_steps = 28
    default_guidance = 3.5

    @property
    def guidance_kind(self) -> str:  # FLUX.1-dev embeds it; schnell takes none
        config = self.spec.part_config("transformer")
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


class FluxKontextSampling(FluxSampling):
    """FLUX.1 Kontext samples edits as `FluxKontextPipeline` does: FLUX.1's noise, sigmas (shifted
    by the target's token count, the reference's not counted), embedded guidance (3.5) and
    decode; the reference image's clean latents (`d.control`, encoded as the training cache
    encodes control images) are packed and appended after the noisy target's tokens with ids
    (1, row, column) by the family's own `make_inputs`, and the prediction for them is dropped.

    Two of the pipeline's defaults change the size it works at, and dpipe keeps the request's: it
    rescales the output to `max_area` (1024x1024 pixels) and, with `_auto_resize`, the reference
    image to the closest of Kontext's preferred resolutions. dpipe samples at the request's size
    with the reference fitted to that size (as training sees it); the reference run passes
    `max_area=width*height` and `_auto_resize=False` so that it does the same."""

    default_steps = 28
    default_guidance = 3.5  # FluxKontextPipeline's guidance_scale (embedded); true CFG is off
    needs_control = True

    def prediction(self, output: torch.Tensor, d: Denoising) -> torch.Tensor:
        b, c, h, w = d.latents.shape
        return unpack(output[:, : (h // 2) * (w // 2)].float(), d.latents)

    def diffusers_sample(self, denoiser, request: SampleRequest, steps: int,
                         guidance: float) -> torch.Tensor:
        from diffusers import FluxKontextPipeline

        from dpipe.images import fit, open_rgb

        # The reference image as training and dpipe's sampler see it: fitted to the request's size.
        image = fit(open_rgb(request.control), request.width, request.height)
        pipe = FluxKontextPipeline.from_pretrained(self.path, transformer=denoiser,
                                                   dtype=torch.float32)
        packed = pipe(image=image, prompt=request.prompt, height=request.height,
                      width=request.width, num_inference_steps=steps, guidance_scale=guidance,
                      max_sequence_length=self.spec.cfg.max_text_tokens,
                      generator=torch.Generator().manual_seed(request.seed),
                      max_area=request.width * request.height, _auto_resize=False,
                      output_type="latent").images
        like = torch.empty(1, *self.latent_shape(request))
        return unpack(packed, like)
