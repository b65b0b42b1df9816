"""OmniGen2 samples text-to-image as the reference's `OmniGen2Pipeline` does (VectorSpaceLab/
OmniGen2 pipeline_omnigen2.py and schedulers/scheduling_flow_match_euler_discrete.py, commit
0f72fa9), with its own Euler scheduler, which diffusers has not:

- noise (C, H/8, W/8) from the seed; times t rising from 0 (noise) to 1 (clean):
  t_i = i / steps for i < steps, then, with the scheduler's `dynamic_time_shift` (on in the
  published config), t <- t / (m - m t + t), m = sqrt(latent height x width) / 40 (1 at 320x320,
  3.2 at 1024x1024); the last step ends at t = 1;
- the transformer gets t and predicts clean - noise; x <- x + (t_next - t) * prediction;
- guidance (the pipeline's `text_guidance_scale`, 4.0 by default, 28 steps): uncond + g (cond -
  uncond) where g > 1, over the whole schedule (`cfg_range` (0, 1)); the negative prompt ("" by
  default) through the same chat template;
- the KL VAE decodes latents / scale + shift.

In sigma = 1 - t this is a shift of sigma by m (sigma' = m sigma / (1 + (m - 1) sigma)): the
`train.timesteps.shift=auto` of a resolution. Not covered: the pipeline's reference images
(editing, `image_guidance_scale`), its DPM-Solver option, TeaCache and TaylorSeer.
"""

from __future__ import annotations

import math

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config

from dpipe.models.diffusers_folder import read_json
from dpipe.models.sampling import Denoising, FamilySampling, SampleRequest


class OmniGen2Euler(ConfigMixin):
    """The reference scheduler's schedule and step, with the calls the sampler makes. Its config
    speaks diffusers' words for the reference's: `use_dynamic_shifting` is its
    `dynamic_time_shift`, and it has no fixed `shift` (1.0); `sigmas` are 1 - t, ending at 0."""

    config_name = "scheduler_config.json"

    @register_to_config
    def __init__(self, num_train_timesteps: int = 1000, shift: float = 1.0,
                 use_dynamic_shifting: bool = True):
        self.timesteps = torch.zeros(0)
        self.sigmas = torch.zeros(0)
        self.step_index: int | None = None

    def set_timesteps(self, steps: int, latents: torch.Tensor) -> torch.Tensor:
        t = torch.linspace(0, 1, steps + 1, dtype=torch.float64)[:-1]
        if self.config.use_dynamic_shifting:
            m = math.sqrt(latents.shape[-2] * latents.shape[-1]) / 40
            t = t / (m - m * t + t)
        self.timesteps = t.to(torch.float32)
        self._ends = torch.cat([self.timesteps, torch.ones(1)])
        self.sigmas = torch.cat([1 - t, torch.zeros(1, dtype=torch.float64)]).float()
        return self.timesteps

    def set_begin_index(self, index: int) -> None:
        self.step_index = index

    def step(self, prediction: torch.Tensor, t: torch.Tensor, sample: torch.Tensor,
             return_dict: bool = False):
        i = self.step_index or 0
        dt = self._ends[i + 1] - self._ends[i]
        self.step_index = i + 1
        return ((sample.float() + dt * prediction).to(prediction.dtype),)


class OmniGen2Sampling(FamilySampling):
    default_steps = 28  # OmniGen2Pipeline.__call__'s num_inference_steps
    default_guidance = 4.0  # its text_guidance_scale

    def _shifts(self) -> bool:
        config = read_json(self.path / "scheduler" / "scheduler_config.json")
        return bool(config.get("dynamic_time_shift", True))

    def new_scheduler(self):
        return OmniGen2Euler(use_dynamic_shifting=self._shifts())

    def set_timesteps(self, scheduler, steps: int, latents: torch.Tensor) -> torch.Tensor:
        return scheduler.set_timesteps(steps, latents)

    def training_shift(self, latents: torch.Tensor) -> float:
        return math.sqrt(latents.shape[-2] * latents.shape[-1]) / 40 if self._shifts() else 1.0

    def model_time(self, t: torch.Tensor) -> torch.Tensor:
        # make_inputs takes sigma = 1 - t and gives the transformer 1 - sigma.
        return 1.0 - t.reshape(1).float()

    def inputs(self, d: Denoising, t: torch.Tensor, text: dict[str, torch.Tensor]) -> tuple:
        inputs = super().inputs(d, t, text)
        # The scheduler's t itself: 1 - (1 - t) rounds in float32 where t < 1/2.
        return (inputs[0], t.reshape(1).float().to(inputs[1].device), *inputs[2:])

    # ---- the reference -------------------------------------------------------------------------
    def diffusers_sample(self, denoiser, request: SampleRequest, steps: int,
                         guidance: float) -> torch.Tensor:
        """No diffusers pipeline runs OmniGen2: the reference pipeline's loop, written from it,
        on the transformer's own forward (not the pipeline layers), the prompts encoded by the
        MLLM in this process; its final latents."""
        spec = self.spec
        encoders = spec.load_encoders(torch.device("cpu"), torch.float32)
        text = spec.encode_prompts(encoders, [request.prompt])
        uncond = spec.encode_prompts(encoders, [request.negative_prompt]) if guidance > 1 else None
        latents = self.initial_latents(request)
        scheduler = self.new_scheduler()
        timesteps = scheduler.set_timesteps(steps, latents)
        scheduler.set_begin_index(0)

        def predict(t, embeds):
            mask = embeds["cap_mask"].bool()
            n = int(mask.sum())  # the reference pads to the longest prompt: one, here
            return denoiser(latents, t.expand(1), embeds["cap"][:, :n], mask[:, :n],
                            return_dict=False)[0]

        for t in timesteps:
            pred = predict(t, text)
            if uncond is not None:
                pred_uncond = predict(t, uncond)
                pred = pred_uncond + guidance * (pred - pred_uncond)
            latents = scheduler.step(pred, t, latents)[0]
        return latents
