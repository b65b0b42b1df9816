"""Lumina-Image 2.0 samples as `Lumina2Pipeline` does.

Noise in (C, h, w) with h, w = 2 * (H // 16) (the pipeline assumes an 8x VAE), sigmas
`linspace(1, 1/steps, steps)` with the scheduler's shift (the pipeline's `mu`, were the scheduler to
shift by resolution, comes from `latents.shape[1]`, the channel count: kept as it is); the
transformer gets 1 - t / 1000 and predicts x0 - noise, negated before the Euler step. The KL VAE
decodes latents / scale + shift.

Guidance with the pipeline's defaults (4.0, 30 steps): classifier-free guidance where the scale
exceeds 1, `uncond + g (cond - uncond)`, skipped (the conditional prediction alone) at the steps
past `cfg_trunc_ratio` of the schedule ((i + 1) / steps > ratio; 1.0: none), then, with
`cfg_normalization` (on), rescaled to the conditional prediction's norm over the last (width)
axis, as the pipeline does it.

The negative prompt is encoded as the pipeline encodes it, without the system prompt that goes
before every prompt (`Lumina2Spec.encode_negative_prompts`, cached apart from the captions).
"""

from __future__ import annotations

import torch

from dpipe.models.diffusers_folder import read_json
from dpipe.models.sampling import Denoising, FamilySampling, SampleRequest

VAE_FACTOR = 8  # Lumina2Pipeline.vae_scale_factor, whatever the VAE


class Lumina2Sampling(FamilySampling):
    default_steps = 30  # Lumina2Pipeline.__call__'s num_inference_steps
    default_guidance = 4.0  # its guidance_scale
    reference_pipeline = "Lumina2Pipeline"
    # Lumina2Pipeline.__call__'s defaults.
    cfg_trunc_ratio: float = 1.0
    cfg_normalization: bool = True

    # ---- latents and schedule ------------------------------------------------------------------
    def latent_shape(self, request: SampleRequest) -> tuple[int, ...]:
        channels = int(read_json(self.path / "transformer" / "config.json").get("in_channels", 16))
        return (channels, 2 * (request.height // (VAE_FACTOR * 2)),
                2 * (request.width // (VAE_FACTOR * 2)))

    def image_tokens(self, latents: torch.Tensor) -> int:
        return int(latents.shape[1])  # the pipeline's image_seq_len = latents.shape[1]

    # ---- one step ------------------------------------------------------------------------------
    def prediction(self, output: torch.Tensor, d: Denoising) -> torch.Tensor:
        return -output.reshape(d.latents.shape).float()  # the pipeline steps with -output

    def guide(self, cond: torch.Tensor, uncond: torch.Tensor, d: Denoising) -> torch.Tensor:
        if (d.index + 1) / len(d.timesteps) > self.cfg_trunc_ratio:
            return cond  # classifier-free truncation: the pipeline runs no negative prompt here
        pred = uncond + d.guidance * (cond - uncond)
        if self.cfg_normalization:  # on -output: the same numbers, negated
            pred = pred * (torch.norm(cond, dim=-1, keepdim=True)
                           / torch.norm(pred, dim=-1, keepdim=True))
        return pred

    # ---- the reference -------------------------------------------------------------------------
    def reference_arguments(self, pipe, request: SampleRequest, steps: int,
                            guidance: float) -> dict:
        return {**super().reference_arguments(pipe, request, steps, guidance),
                "cfg_trunc_ratio": self.cfg_trunc_ratio,
                "cfg_normalization": self.cfg_normalization}
