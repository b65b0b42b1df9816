"""Stable Diffusion 3 / 3.5 samples as `StableDiffusion3Pipeline` does: noise in (C, h, w), the
scheduler's own timesteps for `num_inference_steps` (`set_timesteps(steps)`: no custom sigmas;
SD3.5's static shift 3.0 from the scheduler config, or mu from the token count where the config
shifts dynamically), classifier-free guidance with the negative prompt (7.0 by default, no
skip-layer guidance, as the pipeline's defaults), and the KL VAE's scale and shift undone before
decoding. The transformer takes (B, C, h, w) latents and returns them in that layout."""

from __future__ import annotations

import torch

from dpipe.models.sampling import FamilySampling


class SD3Sampling(FamilySampling):
    default_steps = 28
    default_guidance = 7.0
    default_max_shift = 1.16  # the pipeline's calculate_shift call's (FLUX's is 1.15)
    reference_pipeline = "StableDiffusion3Pipeline"

    def set_timesteps(self, scheduler, steps: int, latents: torch.Tensor) -> torch.Tensor:
        # The pipeline passes num_inference_steps and no sigmas: the scheduler spaces the
        # timesteps itself (from sigma_max to sigma_min, then shifts them).
        kwargs = {}
        if scheduler.config.get("use_dynamic_shifting"):
            kwargs["mu"] = self.shift_mu(scheduler, latents)
        scheduler.set_timesteps(steps, device=latents.device, **kwargs)
        return scheduler.timesteps

    def image_tokens(self, latents: torch.Tensor) -> int:
        patch = int(self.spec.part_config("transformer").get("patch_size", 2))
        return (latents.shape[-2] // patch) * (latents.shape[-1] // patch)
