"""HiDream-I1 samples as `HiDreamImagePipeline` does: noise in (C, h, w) from the seed, the
model folder's scheduler with the pipeline's `set_timesteps` (UniPC: the steps alone; otherwise
the steps and mu = calculate_shift(transformer.max_seq), which a scheduler without dynamic
shifting ignores), the transformer's output negated (it predicts x0 - noise), classifier-free
guidance 5.0 (HiDream-I1-Full's default; Dev and Fast are distilled: sample them with guidance
<= 1, which drops the negative prompt as the pipeline's guidance 0 does), 50 steps; the FLUX VAE
decodes latents / scaling + shift.

One difference, on purpose: the pipeline rescales every requested size to the area of
`default_sample_size * vae_scale_factor` squared (1024x1024 for the real model; 512x512 for the
tiny one) before it draws the noise, keeping only the aspect ratio. dpipe samples at the size
asked for (its samples show the training resolution), so `load_reference` sets the pipeline's
`default_sample_size` to the requested area, which makes that rescale the identity: with it, the
pipeline draws the same noise and runs the same loop as dpipe. At the pipeline's own area
(1024x1024 for HiDream-I1) the two are equal without that change.
"""

from __future__ import annotations

import math

import torch

from dpipe.models.diffusers_folder import read_json
from dpipe.models.sampling import Denoising, FamilySampling, SampleRequest


def calculate_shift(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096,
                    base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """diffusers' `calculate_shift` as pipeline_hidream_image.py defines it."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * m + base_shift - m * base_seq_len


class HiDreamSampling(FamilySampling):
    default_steps = 50
    default_guidance = 5.0
    reference_pipeline = "HiDreamImagePipeline"

    @property
    def scheduler_class(self) -> str:  # Full ships UniPC, Dev and Fast FlowMatch Euler
        return read_json(self.path / "scheduler" / "scheduler_config.json")["_class_name"]

    def max_seq(self) -> int:
        c = read_json(self.path / "transformer" / "config.json")
        res = c.get("max_resolution", (128, 128))
        return res[0] * res[1] // (c.get("patch_size", 2) ** 2)

    def set_timesteps(self, scheduler, steps: int, latents: torch.Tensor) -> torch.Tensor:
        from diffusers import UniPCMultistepScheduler

        if isinstance(scheduler, UniPCMultistepScheduler):
            scheduler.set_timesteps(steps, device=latents.device)
        else:
            scheduler.set_timesteps(steps, device=latents.device,
                                    mu=calculate_shift(self.max_seq()))
        return scheduler.timesteps

    def shift_mu(self, scheduler, latents: torch.Tensor) -> float:
        """The mu `set_timesteps` passes: from the model's largest image, at every size."""
        return calculate_shift(self.max_seq())

    def prediction(self, output: torch.Tensor, d: Denoising) -> torch.Tensor:
        return -output.reshape(d.latents.shape).float()  # the pipeline's `noise_pred = -noise_pred`

    # ---- the reference -----------------------------------------------------------------------
    def reference_parts(self, denoiser, request: SampleRequest) -> dict:
        from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

        return {"tokenizer_4": PreTrainedTokenizerFast.from_pretrained(self.path / "tokenizer_4"),
                "text_encoder_4": LlamaForCausalLM.from_pretrained(
                    self.path / "text_encoder_4", dtype=torch.float32)}

    def load_reference(self, denoiser, request: SampleRequest):
        pipe = super().load_reference(denoiser, request)
        pipe.default_sample_size = self._identity_sample_size(pipe, request)
        return pipe

    @staticmethod
    def _identity_sample_size(pipe, request: SampleRequest) -> float:
        """A `default_sample_size` under which the pipeline's area rescale keeps the request's
        width and height (checked with the pipeline's own arithmetic)."""
        f, w, h = pipe.vae_scale_factor, request.width, request.height
        division = f * 2
        for eps in (0.0, 1e-12, 1e-9, 1e-6):
            size = math.sqrt(w * h * (1 + eps)) / f
            scale = math.sqrt((size * f) ** 2 / (w * h))
            if (int(w * scale // division * division),
                    int(h * scale // division * division)) == (w, h):
                return size
        raise ValueError(f"{w}x{h}: HiDreamImagePipeline cannot be made to sample this size")
