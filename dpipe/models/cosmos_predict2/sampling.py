"""Cosmos-Predict2 samples as `Cosmos2TextToImagePipeline` (Text2Image checkpoints) and
`Cosmos2VideoToWorldPipeline` (Video2World checkpoints) do: an EDM sampler on the folder's
FlowMatchEulerDiscreteScheduler with the pipelines' settings registered into its config
(sigma_max 80, sigma_min 0.002, sigma_data 1, final_sigmas_type "sigma_min": Karras sigmas from
`set_timesteps(sigmas=linspace(0, 1, steps))`, the last sigma set to the one before it, so the
last step changes nothing); noise N(0, 1) * sigma_max in (C, F', h, w) (F' = 1 for Text2Image).

Each step at sigma, with t = sigma / (sigma + 1): the transformer takes x * (1 - t) at time t
(through the family's own `make_inputs`, which takes t in [0, 1] as is), its output F becomes
x0 = (1 - t) x - t F (the EDM preconditioning c_in = c_skip = 1 - t, c_out = -t), guidance is
applied to the x0 predictions as the pipelines do it: x0_cond + g (x0_cond - x0_uncond)
(guidance 7.0, classifier-free where g > 1), and the scheduler steps on (x - x0) / sigma. 35 steps.
Decoding un-normalises (x * latents_std / sigma_data + latents_mean) for the Wan VAE.

Video2World (`needs_control`): the first latent frame is the control image's latents
(`d.control`), given clean to the transformer at t = 1e-4 / (1 + 1e-4) with the condition-mask
channel set (exactly what `make_inputs` does for training clips), and its x0 prediction replaced
by them, for the prompt's and the negative prompt's predictions alike; clips of 4k+1 frames at
16 fps (the pipeline's default, which also scales the temporal rope). A 1-frame request is all
conditioning: the pipeline returns the control image's latents re-noised to sigma_min, and so does
dpipe (the transformer runs, but its prediction is replaced on every frame).

The one difference from Cosmos2VideoToWorldPipeline: it conditions on a sample of the VAE's
posterior (mean + std * eps, eps the first draw from the seed's generator, before the noise),
dpipe on its mean, as its training cache encodes control images and as `make_inputs` trains the
given frame. dpipe draws (and drops) that eps too, so the noise is the pipeline's.
`diffusers_sample` runs the real pipeline with that one change (its VAE's posterior sample
returns the mean after drawing the same eps): with it the two are equal.
"""

from __future__ import annotations

import dataclasses

import torch

from dpipe.models.common.cosmos import PromptsPass, wan_vae_images
from dpipe.models.sampling import Denoising, FamilySampling, SampleRequest

SIGMA_MAX, SIGMA_MIN, SIGMA_DATA = 80.0, 0.002, 1.0  # set by both Cosmos2 pipelines' __init__
FINAL_SIGMAS_TYPE = "sigma_min"


class CosmosPredict2Sampling(FamilySampling):
    default_steps = 35
    default_guidance = 7.0
    fps = 16.0  # Cosmos2VideoToWorldPipeline's fps (the rotary embedding assumes it)

    @property
    def video(self) -> bool:
        return self.spec.variant.video2world

    @property
    def needs_control(self) -> bool:
        return self.spec.variant.video2world

    @property
    def frame_step(self) -> int:
        return self.spec.variant.temporal

    # ---- latents -----------------------------------------------------------------------------
    def latent_shape(self, request: SampleRequest) -> tuple[int, ...]:
        v = self.spec.variant
        return (v.z_dim, (request.frames - 1) // v.temporal + 1, request.height // v.spatial,
                request.width // v.spatial)

    def initial_latents(self, request: SampleRequest) -> torch.Tensor:
        generator = torch.Generator().manual_seed(request.seed)
        shape = (1, *self.latent_shape(request))
        if self.spec.variant.video2world:
            # The pipeline's VAE posterior sample of the conditioning clip draws first.
            torch.randn(shape, generator=generator)
        return torch.randn(shape, generator=generator) * SIGMA_MAX

    # ---- the schedule ------------------------------------------------------------------------
    def new_scheduler(self):
        scheduler = super().new_scheduler()
        scheduler.register_to_config(sigma_max=SIGMA_MAX, sigma_min=SIGMA_MIN,
                                     sigma_data=SIGMA_DATA, final_sigmas_type=FINAL_SIGMAS_TYPE)
        return scheduler

    def set_timesteps(self, scheduler, steps: int, latents: torch.Tensor) -> torch.Tensor:
        sigmas = torch.linspace(0, 1, steps, dtype=torch.float64)
        scheduler.set_timesteps(sigmas=sigmas, device=latents.device)
        if scheduler.config.get("final_sigmas_type", "zero") == "sigma_min":
            scheduler.sigmas[-1] = scheduler.sigmas[-2]
        return scheduler.timesteps

    @staticmethod
    def _time(d: Denoising, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """sigma and t = sigma / (sigma + 1) of step `index`, as the pipelines compute them."""
        sigma = d.scheduler.sigmas[index]
        return sigma, sigma / (sigma + 1)

    def _conditioned(self, x: torch.Tensor, d: Denoising) -> torch.Tensor:
        """x with its first latent frame replaced by the control latents (Video2World)."""
        if not self.spec.variant.video2world:
            return x
        x = x.clone()
        x[:, :, :1] = d.control.to(x)
        return x

    # ---- one step ----------------------------------------------------------------------------
    def batch(self, d: Denoising, t: torch.Tensor, text: dict[str, torch.Tensor]):
        index = int((d.timesteps == t).nonzero()[0, 0])
        _, current_t = self._time(d, index)
        batch = super().batch(d, t, text)
        # make_inputs takes x * c_in as the noisy latents and reads the given frame from
        # `latents` (Video2World clips); t in [0, 1] as is.
        return dataclasses.replace(
            batch, noisy=d.latents * (1 - current_t), latents=self._conditioned(d.latents, d),
            timesteps=current_t.reshape(1).to(d.latents.device, torch.float32))

    def prediction(self, output: torch.Tensor, d: Denoising) -> torch.Tensor:
        """The transformer's output -> x0 = c_skip x + c_out F, the given frame replaced."""
        _, current_t = self._time(d, d.index)
        x0 = (1 - current_t) * d.latents + (-current_t) * output.reshape(d.latents.shape).float()
        return self._conditioned(x0, d)

    def guide(self, cond: torch.Tensor, uncond: torch.Tensor, d: Denoising) -> torch.Tensor:
        return cond + d.guidance * (cond - uncond)  # the Cosmos2 pipelines' form

    def step(self, d: Denoising, t: torch.Tensor, prediction: torch.Tensor) -> None:
        sigma, _ = self._time(d, d.index)
        velocity = (d.latents - prediction) / sigma
        d.latents = d.scheduler.step(velocity, t, d.latents, return_dict=False)[0]

    # ---- decoding ----------------------------------------------------------------------------
    def decode(self, vae, latents: torch.Tensor) -> torch.Tensor:
        return wan_vae_images(vae, latents)

    # ---- the reference -----------------------------------------------------------------------
    def reference_class(self, request: SampleRequest) -> str:
        return self.spec.variant.pipeline

    def reference_parts(self, denoiser, request: SampleRequest) -> dict:
        return {"safety_checker": PromptsPass()}

    def load_reference(self, denoiser, request: SampleRequest):
        pipe = super().load_reference(denoiser, request)
        if self.spec.variant.video2world:
            _posterior_mean(pipe.vae)
        return pipe

    def reference_arguments(self, pipe, request: SampleRequest, steps: int,
                            guidance: float) -> dict:
        arguments = super().reference_arguments(pipe, request, steps, guidance)
        if self.spec.variant.video2world:
            arguments.update(image=self.fitted(request.control, request), fps=int(self.fps))
        return arguments

    def diffusers_sample(self, denoiser, request: SampleRequest, steps: int,
                         guidance: float) -> torch.Tensor:
        from dpipe.models.common.cosmos_padding import nearest_resize_without_torchvision

        with nearest_resize_without_torchvision():
            return super().diffusers_sample(denoiser, request, steps, guidance)

    def reference_latents(self, pipe, latents: torch.Tensor,
                          request: SampleRequest) -> torch.Tensor:
        # Text2Image's (1, C, h, w) -> (1, C, 1, h, w)
        return latents if self.video else latents.unsqueeze(2)


def _posterior_mean(vae) -> None:
    """Makes `vae.encode(...).latent_dist.sample(generator)` return the posterior's mean, after
    drawing its eps from the generator as before (so the draws after it are unchanged)."""
    encode = vae.encode

    def deterministic_encode(x, return_dict: bool = True):
        from diffusers.utils.torch_utils import randn_tensor

        posterior = encode(x, return_dict=True).latent_dist

        def sample(generator=None):
            randn_tensor(posterior.mean.shape, generator=generator,
                         device=posterior.parameters.device, dtype=posterior.parameters.dtype)
            return posterior.mean

        posterior.sample = sample
        from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKLOutput

        return AutoencoderKLOutput(latent_dist=posterior) if return_dict else (posterior,)

    vae.encode = deterministic_encode
