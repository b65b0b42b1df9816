"""Ideogram 4 samples as `Ideogram4Pipeline` does: noise drawn from the seed in the packed token
shape (N, 4C); the pipeline's resolution-aware logit-normal sigmas (mu 0 + log(pixels / 512^2)
/ 2, std 1.5) set on the scheduler; the transformer gets model time 1 - sigma; the Euler step
with the negated velocity.

Guidance is the pipeline's asymmetric CFG: `v = g * v_cond + (1 - g) * v_uncond`, v_uncond from
the separate `unconditional_transformer` on the image tokens alone with zero text features. dpipe
runs the conditional model through the pipeline stages and the unconditional one on the last
stage (loaded there on first use, base weights: a LoRA trains the conditional model alone), so
no negative-prompt pass goes through the stages. `g` is constant over the steps (the pipeline's
`guidance_scale`), 7.0 by default, the pipeline's recommended schedule's main value; at g = 1 the
unconditional model is not loaded. Decoding un-normalises with the VAE's BatchNorm statistics,
unpatches and decodes.
"""

from __future__ import annotations

import math

import torch

from dpipe.models.common.vae_batch_norm import decoded_patches
from dpipe.models.ideogram4.spec import from_tokens, to_tokens, unpatchify
from dpipe.models.sampling import Denoising, FamilySampling, SampleRequest


class Ideogram4Sampling(FamilySampling):
    default_steps = 48  # num_inference_steps
    default_guidance = 7.0  # the recommended schedule's value for all but the last 3 steps
    reference_pipeline = "Ideogram4Pipeline"

    def __init__(self, spec):
        super().__init__(spec)
        self._unconditional = None

    def uses_uncond(self, guidance: float) -> bool:
        return False  # the unconditional branch is another model: see `step`

    def check(self, request: SampleRequest) -> str | None:
        if request.negative_prompt:
            return (f"negative_prompt={request.negative_prompt!r} (or sample.negative_prompt): "
                    "Ideogram 4 guides with its unconditional model, which takes no prompt; "
                    "leave negative_prompt empty")
        return super().check(request)

    # ---- latents and schedule ----------------------------------------------------------------
    def latent_shape(self, request: SampleRequest) -> tuple[int, ...]:
        factor = self.spec.pixel_multiple  # vae_scale_factor x patch 2
        return (4 * self.vae_config()["latent_channels"], request.height // factor,
                request.width // factor)

    def initial_latents(self, request: SampleRequest) -> torch.Tensor:
        c, h, w = self.latent_shape(request)
        generator = torch.Generator().manual_seed(request.seed)
        return from_tokens(torch.randn((1, h * w, c), generator=generator), h, w)

    def set_timesteps(self, scheduler, steps: int, latents: torch.Tensor) -> torch.Tensor:
        from diffusers.pipelines.ideogram4.pipeline_ideogram4 import _logit_normal_sigmas

        sigmas = _logit_normal_sigmas(steps, self.resolution_mu(latents), std=1.5)
        scheduler.set_timesteps(sigmas=sigmas.tolist(), device=latents.device)
        return scheduler.timesteps

    def resolution_mu(self, latents: torch.Tensor) -> float:
        """The pipeline's mean of logit(sigma) at `latents`' image size: log(pixels / 512^2) / 2."""
        from diffusers.pipelines.ideogram4.pipeline_ideogram4 import _resolution_aware_mu

        f = self.spec.pixel_multiple
        return _resolution_aware_mu(latents.shape[-2] * f, latents.shape[-1] * f, base_mu=0.0)

    def training_shift(self, latents: torch.Tensor) -> float:
        """Sigmas logit-normal about mu are those about 0 shifted by exp(mu) (the shift moves
        logit(sigma) by log(shift)); the scheduler's own shift then applies to them too."""
        return math.exp(self.resolution_mu(latents)) * super().training_shift(latents)

    # ---- one step ----------------------------------------------------------------------------
    def prediction(self, output: torch.Tensor, d: Denoising) -> torch.Tensor:
        # The scheduler steps with -v (the pipeline's scheduler.step(-v, ...)).
        return -from_tokens(output.float(), *d.latents.shape[-2:])

    def step(self, d: Denoising, t: torch.Tensor, prediction: torch.Tensor) -> None:
        if d.guidance != 1.0:
            uncond = -self.unconditional_velocity(d.latents, t)
            prediction = d.guidance * prediction + (1.0 - d.guidance) * uncond
        d.latents = d.scheduler.step(prediction, t, d.latents, return_dict=False)[0]

    @torch.no_grad()
    def unconditional_velocity(self, latents: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The pipeline's negative pass: image tokens only, zero text features, float32 out."""
        from diffusers import Ideogram4Transformer2DModel

        model = self._unconditional
        if model is None or model.device != latents.device:
            dtype = torch.bfloat16 if latents.device.type == "cuda" else torch.float32
            model = Ideogram4Transformer2DModel.from_pretrained(
                self.path, subfolder="unconditional_transformer", dtype=dtype)
            self._unconditional = model = model.to(latents.device).eval()
        h, w = latents.shape[-2:]
        tokens = to_tokens(latents)
        device = latents.device
        ys, xs = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device),
                                indexing="ij")
        ids = torch.stack([torch.zeros_like(ys), ys, xs], -1).reshape(1, h * w, 3) + 65536
        ones = torch.ones((1, h * w), dtype=torch.long, device=device)
        t_model = (1.0 - t.float() / 1000).reshape(1).to(device, model.dtype)
        out = model(hidden_states=tokens.to(model.dtype), timestep=t_model,
                    encoder_hidden_states=tokens.new_zeros(
                        1, h * w, model.config.llm_features_dim, dtype=model.dtype),
                    position_ids=ids, segment_ids=ones, indicator=ones * 2,
                    return_dict=False)[0]
        return from_tokens(out.float(), h, w)

    # ---- decoding ----------------------------------------------------------------------------
    def decode(self, vae, latents: torch.Tensor) -> torch.Tensor:
        return decoded_patches(vae, latents, unpatchify)

    # ---- the reference -----------------------------------------------------------------------
    def reference_arguments(self, pipe, request: SampleRequest, steps: int,
                            guidance: float) -> dict:
        arguments = super().reference_arguments(pipe, request, steps, guidance)
        del arguments["negative_prompt"]  # the unconditional model takes none
        return {**arguments, "guidance_schedule": None}

    def reference_latents(self, pipe, latents: torch.Tensor,
                          request: SampleRequest) -> torch.Tensor:
        return from_tokens(latents.float(), *self.latent_shape(request)[1:])
