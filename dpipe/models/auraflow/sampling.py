"""AuraFlow samples as `AuraFlowPipeline` does: noise in (C, h, w), the scheduler's own timesteps
for `num_inference_steps` (`set_timesteps(steps)`, no custom sigmas, the config's static shift
1.73), the transformer given t / 1000 (it scales by 1000 itself), classifier-free guidance with
the negative prompt (3.5 and 50 steps by default), and the SDXL VAE's latents divided by its
scaling factor before decoding (no shift). The transformer takes and returns (B, C, h, w)."""

from __future__ import annotations

import torch

from dpipe.models.sampling import FamilySampling, SampleRequest


class AuraFlowSampling(FamilySampling):
    decode_shift = False  # the pipeline divides by the VAE's scale alone
    default_steps = 50
    default_guidance = 3.5

    def set_timesteps(self, scheduler, steps: int, latents: torch.Tensor) -> torch.Tensor:
        # The pipeline passes num_inference_steps alone (no sigmas, no mu).
        scheduler.set_timesteps(steps, device=latents.device)
        return scheduler.timesteps

    def diffusers_sample(self, denoiser, request: SampleRequest, steps: int,
                         guidance: float) -> torch.Tensor:
        from diffusers import AuraFlowPipeline

        return self.pipeline_latents(AuraFlowPipeline, denoiser, request, steps, guidance)
