"""Krea 2 samples as `Krea2Pipeline` does: noise in (C, h, w) from the seed, packed in 2x2
patches; sigmas 1 -> 1/steps, shifted by the scheduler with `mu` from the packed token count
(`calculate_shift` with the scheduler config's Krea 2 parameters), or the fixed mu 1.15 of the
distilled checkpoint (`is_distilled` in model_index.json); the transformer gets t / 1000; the
flow-matching Euler step.

Guidance is Krea 2's convention: `cond + scale * (cond - uncond)`, on whenever scale > 0 (the
usual CFG at scale 1 + scale), the negative prompt "" when none is given (dpipe's default), 4.5
by default; 0 turns it off (the distilled checkpoint's setting). Decoding un-normalises with the
VAE's latents_mean / latents_std and decodes one frame of the video VAE.
"""

from __future__ import annotations

import torch

from dpipe.models.diffusers_folder import read_json, wan_vae_decoded
from dpipe.models.sampling import Denoising, FamilySampling, SampleRequest

DISTILLED_MU = 1.15  # Krea2Pipeline's fixed shift for is_distilled checkpoints


class Krea2Sampling(FamilySampling):
    default_steps = 28  # num_inference_steps
    default_guidance = 4.5  # guidance_scale
    packed = True
    reference_pipeline = "Krea2Pipeline"

    def uses_uncond(self, guidance: float) -> bool:
        return guidance > 0  # the pipeline's do_classifier_free_guidance

    def guide(self, cond: torch.Tensor, uncond: torch.Tensor, d: Denoising) -> torch.Tensor:
        return cond + d.guidance * (cond - uncond)

    # ---- latents and schedule ----------------------------------------------------------------
    def vae_factor(self) -> int:
        return 2 ** len(self.vae_config()["temperal_downsample"])

    def latent_shape(self, request: SampleRequest) -> tuple[int, ...]:
        f = self.vae_factor()
        return (self.vae_config()["z_dim"], request.height // f, request.width // f)

    def shift_mu(self, scheduler, latents: torch.Tensor) -> float:
        if read_json(self.path / "model_index.json").get("is_distilled"):
            return DISTILLED_MU
        # calculate_shift with the pipeline's fallbacks (max_image_seq_len 6400)
        c = scheduler.config
        base_len, max_len = c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 6400)
        base, top = c.get("base_shift", 0.5), c.get("max_shift", 1.15)
        m = (top - base) / (max_len - base_len)
        return self.image_tokens(latents) * m + base - m * base_len

    # ---- decoding ----------------------------------------------------------------------------
    def decode(self, vae, latents: torch.Tensor) -> torch.Tensor:
        return wan_vae_decoded(vae, latents[:, :, None])[:, 0]  # a video VAE: one frame
