"""Cosmos 1.0 samples as `CosmosTextToWorldPipeline` does: EDM Euler steps on the folder's
EDMEulerScheduler (Karras sigmas from 80 to 0.002, rho 7; the final sigma repeated, so the last
step changes nothing), noise N(0, 1) * sigma_max in (16, F', h, w), F' = (frames - 1) / 8 + 1.

Each step at sigma: the transformer takes c_in x (`scale_model_input`) at c_noise = log(sigma) / 4
(the scheduler's timestep), fps 30, through the family's own `make_inputs`; its output F becomes
x0 = c_skip x + c_out F (`precondition_outputs`, sigma_data 0.5), guidance is applied to the x0
predictions as the pipeline does: x0_cond + g (x0_cond - x0_uncond) (guidance 7.0, classifier-free
where g > 1), and the scheduler steps with that x0. 36 steps. Decoding un-normalises with the VAE's
statistics per channel and latent frame (x * latents_std / sigma_data + latents_mean) for the
Cosmos VAE. The pipeline's guardrail (cosmos_guardrail) is not run.
"""

from __future__ import annotations

import dataclasses

import torch

from dpipe.diffusion.edm import t_of_sigma
from dpipe.models.common.cosmos import PromptsPass
from dpipe.models.cosmos1.latents import FPS, latent_statistics
from dpipe.models.sampling import Denoising, FamilySampling, SampleRequest


class Cosmos1Sampling(FamilySampling):
    default_steps = 36
    default_guidance = 7.0
    scheduler_class = "EDMEulerScheduler"
    schedule = "steps"
    reference_pipeline = "CosmosTextToWorldPipeline"
    video = True
    frame_step = 8
    fps = float(FPS)

    def latent_shape(self, request: SampleRequest) -> tuple[int, ...]:
        vae = self.vae_config()
        return (vae["latent_channels"], (request.frames - 1) // vae["temporal_compression_ratio"] + 1,
                request.height // vae["spatial_compression_ratio"],
                request.width // vae["spatial_compression_ratio"])

    def initial_latents(self, request: SampleRequest) -> torch.Tensor:
        generator = torch.Generator().manual_seed(request.seed)
        noise = torch.randn((1, *self.latent_shape(request)), generator=generator)
        return noise * self.new_scheduler().config.sigma_max

    def set_timesteps(self, scheduler, steps: int, latents: torch.Tensor) -> torch.Tensor:
        timesteps = super().set_timesteps(scheduler, steps, latents)
        # The step is given x0 directly (as the pipeline does): no model-input scaling warning.
        scheduler.is_scale_input_called = True
        return timesteps

    def batch(self, d: Denoising, t: torch.Tensor, text: dict[str, torch.Tensor]):
        index = int((d.timesteps == t).nonzero()[0, 0])
        sigma = d.scheduler.sigmas[index]
        batch = super().batch(d, t, text)
        # make_inputs takes c_in x as the noisy latents and t = sigma / (1 + sigma), from which
        # it recovers sigma and c_noise (in float64: the pipeline's c_noise to float32 rounding).
        return dataclasses.replace(
            batch, noisy=d.scheduler.precondition_inputs(d.latents, sigma),
            timesteps=t_of_sigma(sigma).reshape(1).to(d.latents.device))

    def prediction(self, output: torch.Tensor, d: Denoising) -> torch.Tensor:
        """The transformer's output F -> x0 = c_skip x + c_out F, as the scheduler computes it."""
        sigma = d.scheduler.sigmas[d.index]
        return d.scheduler.precondition_outputs(d.latents, output.reshape(d.latents.shape), sigma)

    def guide(self, cond: torch.Tensor, uncond: torch.Tensor, d: Denoising) -> torch.Tensor:
        return cond + d.guidance * (cond - uncond)  # the pipeline's form, on x0

    def step(self, d: Denoising, t: torch.Tensor, prediction: torch.Tensor) -> None:
        d.latents = d.scheduler.step(prediction, t, d.latents, return_dict=False,
                                     pred_original_sample=prediction)[0]

    @torch.no_grad()
    def decode(self, vae, latents: torch.Tensor) -> torch.Tensor:
        sigma_data = self.new_scheduler().config.sigma_data
        stats = latent_statistics(vae.config, latents)
        x = latents / sigma_data if stats is None else latents * stats[1] / sigma_data + stats[0]
        video = vae.decode(x.to(vae.device, vae.dtype), return_dict=False)[0][0].float()
        return video[:, 0] if video.shape[1] == 1 else video

    def reference_parts(self, denoiser, request: SampleRequest) -> dict:
        return {"safety_checker": PromptsPass()}

    def reference_arguments(self, pipe, request: SampleRequest, steps: int,
                            guidance: float) -> dict:
        return {**super().reference_arguments(pipe, request, steps, guidance), "fps": FPS}

    def diffusers_sample(self, denoiser, request: SampleRequest, steps: int,
                         guidance: float) -> torch.Tensor:
        from dpipe.models.common.cosmos_padding import nearest_resize_without_torchvision

        with nearest_resize_without_torchvision():
            return super().diffusers_sample(denoiser, request, steps, guidance)
