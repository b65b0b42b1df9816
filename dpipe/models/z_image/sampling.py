"""Z-Image (Turbo and base) samples as `ZImagePipeline` does.

Noise in (C, h, w) with h, w = 2 * (H // (2 * VAE factor)) (the transformer's in_channels), sigmas
`torch.linspace(1, 1/steps, steps)` with the scheduler's shift (and `mu` from the 2x2-patch token
count where the scheduler shifts by resolution); the transformer gets (1000 - t) / 1000 and
predicts x0 - noise, which the pipeline negates before the Euler step.

Guidance is the pipeline's form, `cond + g * (cond - uncond)` (so g = 0 is no guidance and any
g > 0 runs the negative prompt), with its defaults: 5.0 and 50 steps (Z-Image-Turbo's card
samples with guidance 0 and 8-9 steps: set `sample.guidance` / `sample.steps`). Its
`cfg_truncation` (1.0: never) and `cfg_normalization` (off) are kept as `cfg_truncation` /
`cfg_normalization` below and applied as the pipeline applies them. The KL VAE decodes
latents / scale + shift.
"""

from __future__ import annotations

import torch

from dpipe.models.sampling import Denoising, FamilySampling, SampleRequest


class ZImageSampling(FamilySampling):
    default_steps = 50  # ZImagePipeline.__call__'s num_inference_steps
    default_guidance = 5.0  # its guidance_scale
    reference_pipeline = "ZImagePipeline"
    # ZImagePipeline.__call__'s defaults: no guidance where (1000 - t) / 1000 > cfg_truncation;
    # with cfg_normalization > 0 the guided prediction's norm is capped at that times the
    # conditional one's.
    cfg_truncation: float = 1.0
    cfg_normalization: float = 0.0

    def uses_uncond(self, guidance: float) -> bool:
        return guidance > 0  # the pipeline's do_classifier_free_guidance

    # ---- latents and schedule ------------------------------------------------------------------
    def latent_shape(self, request: SampleRequest) -> tuple[int, ...]:
        vae = self.vae_config()
        s = 2 * 2 ** (len(vae["block_out_channels"]) - 1)
        return (int(self.spec.part_config("transformer").get("in_channels", 16)),
                2 * (request.height // s), 2 * (request.width // s))

    def set_timesteps(self, scheduler, steps: int, latents: torch.Tensor) -> torch.Tensor:
        sigmas = torch.linspace(1.0, 1 / steps, steps).tolist()  # get_default_z_image_sigmas
        scheduler.set_timesteps(sigmas=sigmas, device=latents.device,
                                mu=self.shift_mu(scheduler, latents))
        return scheduler.timesteps

    # ---- one step ------------------------------------------------------------------------------
    def inputs(self, d: Denoising, t: torch.Tensor, text: dict[str, torch.Tensor]) -> tuple:
        latents, _t_model, *rest = super().inputs(d, t, text)
        # The pipeline's (1000 - t) / 1000 exactly (make_inputs' 1 - t/1000 may differ in the last
        # bit).
        t_model = ((1000 - t.reshape(1).float()) / 1000).to(_t_model.device, _t_model.dtype)
        return (latents, t_model, *rest)

    def prediction(self, output: torch.Tensor, d: Denoising) -> torch.Tensor:
        return -output.reshape(d.latents.shape).float()  # the pipeline steps with -output

    def guide(self, cond: torch.Tensor, uncond: torch.Tensor, d: Denoising) -> torch.Tensor:
        i = d.index
        t_norm = ((1000 - d.timesteps.float()) / 1000).tolist()[i]
        scale = 0.0 if t_norm > self.cfg_truncation else float(d.guidance)
        if scale <= 0:
            return cond
        pred = cond + scale * (cond - uncond)  # the pipeline's form (on -output: the same numbers)
        if self.cfg_normalization and float(self.cfg_normalization) > 0.0:
            cond_norm = torch.linalg.vector_norm(cond)
            new_norm = torch.linalg.vector_norm(pred)
            top = cond_norm * float(self.cfg_normalization)
            if new_norm > top:
                pred = pred * (top / new_norm)
        return pred

    # ---- the reference -------------------------------------------------------------------------
    def reference_arguments(self, pipe, request: SampleRequest, steps: int,
                            guidance: float) -> dict:
        return {**super().reference_arguments(pipe, request, steps, guidance),
                "cfg_normalization": self.cfg_normalization,
                "cfg_truncation": self.cfg_truncation}
