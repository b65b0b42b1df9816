"""ERNIE-Image samples as `ErnieImagePipeline` does (with `use_pe=False`): noise drawn directly in
the patchified latent shape (in_channels, H / 16, W / 16) from the seed; sigmas linspace(1, 0,
steps + 1) without the last, shifted by the scheduler's fixed shift (the pipeline passes no mu);
the transformer gets the timestep t (sigma * 1000); the flow-matching Euler step.

Guidance is classifier-free as the pipeline's: `uncond + scale * (cond - uncond)` where scale
> 1, the negative prompt "" when none is given, 4.0 by default over 50 steps. Decoding
un-normalises with the VAE's BatchNorm statistics (eps 1e-5 as the pipeline hard-codes),
unpatchifies and decodes.
"""

from __future__ import annotations

import torch

from dpipe.models.common.vae_batch_norm import decoded_patches
from dpipe.models.ernie_image.spec import BN_EPS
from dpipe.models.sampling import FamilySampling, SampleRequest


def unpatchify(latents: torch.Tensor) -> torch.Tensor:
    """ErnieImagePipeline._unpatchify_latents: (B, 4C, h, w) -> (B, C, 2h, 2w)."""
    b, c, h, w = latents.shape
    x = latents.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
    return x.reshape(b, c // 4, h * 2, w * 2)


class ErnieImageSampling(FamilySampling):
    default_steps = 50  # num_inference_steps
    default_guidance = 4.0  # guidance_scale
    reference_pipeline = "ErnieImagePipeline"

    def latent_shape(self, request: SampleRequest) -> tuple[int, ...]:
        factor = self.spec.pixel_multiple  # the pipeline's vae_scale_factor
        channels = 4 * self.vae_config()["latent_channels"]  # the transformer's in_channels
        return (channels, request.height // factor, request.width // factor)

    def set_timesteps(self, scheduler, steps: int, latents: torch.Tensor) -> torch.Tensor:
        sigmas = torch.linspace(1.0, 0.0, steps + 1)
        scheduler.set_timesteps(sigmas=sigmas[:-1], device=latents.device)
        return scheduler.timesteps

    def decode(self, vae, latents: torch.Tensor) -> torch.Tensor:
        return decoded_patches(vae, latents, unpatchify, BN_EPS)

    def load_reference(self, denoiser, request: SampleRequest):
        pipe = super().load_reference(denoiser, request)
        # The pipeline has no max_sequence_length: its tokenizer truncates at model_max_length,
        # set to the run's max_text_tokens as encode_prompts does.
        pipe.tokenizer.model_max_length = self.spec.cfg.max_text_tokens
        return pipe

    def reference_arguments(self, pipe, request: SampleRequest, steps: int,
                            guidance: float) -> dict:
        arguments = super().reference_arguments(pipe, request, steps, guidance)
        del arguments["max_sequence_length"]
        return {**arguments, "use_pe": False}
