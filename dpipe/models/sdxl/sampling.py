"""SDXL samples as `StableDiffusionXLPipeline` does, through its noise-prediction UNet.

- The scheduler is the class the model folder names (model_index.json; SDXL base:
  EulerDiscreteScheduler), from its `scheduler/` config, with dpipe's `model.prediction_type`
  where that overrides the checkpoint's; `set_timesteps(steps)` with the config's spacing.
- The noise is drawn from the seed in (C, h, w) and multiplied by the scheduler's
  `init_noise_sigma`, after the timesteps are set (as `prepare_latents` does). The same CPU
  generator then goes on to the scheduler's `step` (with eta 0 where the step takes one), as the
  pipeline's `extra_step_kwargs` pass it: ancestral / stochastic schedulers draw from it.
- Each step the UNet sees `scheduler.scale_model_input(latents, t)` and the scheduler's own
  timestep t (a float; `make_inputs` would floor t * 1000 to an integer step, which equals it only
  for integer schedules), plus SDXL's add_time_ids (original size = target size = the request's,
  crop (0, 0)) and the pooled CLIP-G embedding, all from the family's `make_inputs`.
- Classifier-free guidance (5.0, 50 steps by default) with guidance_rescale 0, the pipeline's
  default: the plain combination. An empty negative prompt is the pipeline's `negative_prompt=None`:
  with `force_zeros_for_empty_prompt` (SDXL base) the negative embeddings are zeros, not "" encoded.
- Decoding: latents * latents_std / scaling_factor + latents_mean where the VAE config has them,
  else latents / scaling_factor; a float16 VAE with `force_upcast` decodes in float32.

A single-file checkpoint samples too: configs from `model.single_file_config`'s folder (or the hub
cache), the VAE from the file.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch

from dpipe.models.diffusers_folder import read_json
from dpipe.models.sampling import Denoising, FamilySampling, SampleRequest

# SDXL base's own, for a single file whose configs come from the hub.
SDXL_VAE = {"latent_channels": 4, "block_out_channels": [128, 256, 512, 512],
            "scaling_factor": 0.13025}


class SDXLSampling(FamilySampling):
    default_steps = 50
    default_guidance = 5.0
    # The pipeline passes num_inference_steps alone: the config's timestep spacing applies.
    schedule = "steps"
    reference_pipeline = "StableDiffusionXLPipeline"  # as the spec builds it (`load_reference`)

    def __init__(self, spec):
        super().__init__(spec)
        self.folder = spec._config_dir  # the diffusers folder with the configs, if local

    def _model_index(self) -> dict[str, Any]:
        if self.folder is not None and (self.folder / "model_index.json").is_file():
            return read_json(self.folder / "model_index.json")
        return {}

    @property
    def scheduler_class(self) -> str:
        entry = self._model_index().get("scheduler")
        if entry and entry[1]:
            return entry[1]
        if self.folder is not None:
            return read_json(self.folder / "scheduler" / "scheduler_config.json")["_class_name"]
        return "EulerDiscreteScheduler"

    def vae_config(self) -> dict[str, Any]:
        return self.spec._json("vae") or SDXL_VAE

    # ---- the schedule ------------------------------------------------------------------------
    def new_scheduler(self):
        import diffusers

        cls = getattr(diffusers, self.scheduler_class)
        if self.folder is not None:
            config = cls.load_config(self.folder, subfolder="scheduler")
        else:
            config = self.spec._pipeline_scheduler_config()
        _, prediction = self.spec._objective()  # model.prediction_type, or the checkpoint's
        return cls.from_config(config, prediction_type=prediction)

    def start(self, request: SampleRequest, steps: int, guidance: float,
              text: dict[str, torch.Tensor], uncond: dict[str, torch.Tensor] | None,
              control: torch.Tensor | None, device: torch.device) -> Denoising:
        generator = torch.Generator().manual_seed(request.seed)
        noise = torch.randn((1, *self.latent_shape(request)), generator=generator).to(device)
        scheduler = self.new_scheduler()
        timesteps = self.set_timesteps(scheduler, steps, noise)
        latents = noise * scheduler.init_noise_sigma
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(0)
        if not self.uses_uncond(guidance):
            uncond = None
        elif not request.negative_prompt and self._zeros_for_empty_prompt():
            uncond = {k: torch.zeros_like(v) for k, v in uncond.items()}
        d = Denoising(request, latents, scheduler, timesteps, text, uncond, guidance, control)
        d.state["generator"] = generator
        # scale_model_input reads the scheduler's step index, which only the last stage's
        # scheduler advances (in `step`): stage 0 scales with its own copy, set to each step.
        d.state["input_scheduler"] = copy.deepcopy(scheduler)
        return d

    def _zeros_for_empty_prompt(self) -> bool:
        return bool(self._model_index().get("force_zeros_for_empty_prompt", True))

    # ---- one step ----------------------------------------------------------------------------
    def model_time(self, t: torch.Tensor) -> torch.Tensor:
        # make_inputs' t in [0, 1]: T / num_train_timesteps (T replaced by t itself in `inputs`).
        alphas, _ = self.spec._objective()
        return t.reshape(1).float() / len(alphas)

    def _scaled(self, d: Denoising, t: torch.Tensor) -> torch.Tensor:
        s = d.state["input_scheduler"]
        if hasattr(s, "_step_index"):
            at = (d.timesteps == t).nonzero()
            s._step_index = int(at[0]) if len(at) else None
        return s.scale_model_input(d.latents, t)

    def batch(self, d: Denoising, t: torch.Tensor, text: dict[str, torch.Tensor]):
        import dataclasses

        batch = super().batch(d, t, text)
        return dataclasses.replace(batch, noisy=self._scaled(d, t))

    def inputs(self, d: Denoising, t: torch.Tensor, text: dict[str, torch.Tensor]) -> tuple:
        sample, _steps, *rest = super().inputs(d, t, text)
        # The UNet gets the scheduler's timestep as the pipeline passes it (not floored).
        return (sample, t.reshape(1).to(sample.device), *rest)

    def step(self, d: Denoising, t: torch.Tensor, prediction: torch.Tensor) -> None:
        s = d.scheduler
        accepts = set(inspect.signature(s.step).parameters)
        kwargs = {}
        if "eta" in accepts:
            kwargs["eta"] = 0.0
        if "generator" in accepts:
            kwargs["generator"] = d.state["generator"]
        if hasattr(s, "is_scale_input_called"):
            s.is_scale_input_called = True  # stage 0 scaled the input (see `_scaled`)
        d.latents = s.step(prediction, t, d.latents, **kwargs, return_dict=False)[0]

    # ---- decoding ----------------------------------------------------------------------------
    def load_vae(self, device: torch.device, dtype: torch.dtype):
        upcast = dtype == torch.float16 and self.vae_config().get("force_upcast", True)
        dtype = torch.float32 if upcast else dtype  # as the pipeline upcasts the SDXL VAE
        if not self.spec.single_file:
            return super().load_vae(device, dtype)
        pipe = self.spec._pipeline(dtype, unet=None, text_encoder=None, text_encoder_2=None,
                                   tokenizer=None, tokenizer_2=None)
        return pipe.vae.to(device).requires_grad_(False).eval()

    @torch.no_grad()
    def decode(self, vae, latents: torch.Tensor) -> torch.Tensor:
        c = vae.config
        x = latents.to(vae.device, vae.dtype)
        mean, std = getattr(c, "latents_mean", None), getattr(c, "latents_std", None)
        if mean is not None and std is not None:
            shape = (1, -1, 1, 1)
            mean = torch.tensor(mean).view(shape).to(x.device, x.dtype)
            std = torch.tensor(std).view(shape).to(x.device, x.dtype)
            x = x * std / c.scaling_factor + mean
        else:
            x = x / c.scaling_factor
        return vae.decode(x, return_dict=False)[0][0].float()

    # ---- the reference -----------------------------------------------------------------------
    def load_reference(self, denoiser, request: SampleRequest):
        return self.spec._pipeline(torch.float32, unet=denoiser, scheduler=self.new_scheduler())

    def reference_arguments(self, pipe, request: SampleRequest, steps: int,
                            guidance: float) -> dict:
        arguments = super().reference_arguments(pipe, request, steps, guidance)
        del arguments["max_sequence_length"]
        return {**arguments, "negative_prompt": request.negative_prompt or None}
