"""HunyuanVideo samples as `HunyuanVideoPipeline` does: noise in (C, (F-1)/4 + 1, H/8, W/8) from
the seed (C = the transformer's in_channels), sigmas linspace(1, 0, steps + 1)[:-1] shifted by the
scheduler's fixed shift (7 for HunyuanVideo; no resolution-dependent mu), Euler steps, and the
guidance-distilled scale (6.0 by default) as the model's embedded input. The pipeline's "true CFG"
(`true_cfg_scale`, off by default at 1.0) is not used: no negative prompt. The VAE decodes
latents / scaling_factor (no shift). 50 steps; clips of 4k+1 frames, written at 24 fps (the
model's native rate, as Tencent's sample script writes them; diffusers' example uses 15).
"""

from __future__ import annotations

import torch

from dpipe.models.diffusers_folder import read_json
from dpipe.models.hunyuan_video.spec import prompt_template
from dpipe.models.sampling import FamilySampling, SampleRequest


class HunyuanVideoSampling(FamilySampling):
    decode_shift = False  # the pipeline divides by the VAE's scale alone
    default_steps = 50
    default_guidance = 6.0
    video = True
    fps = 24.0

    @property
    def guidance_kind(self) -> str:  # the released model embeds it; a model without takes none
        return "embedded" if self.transformer_config().get("guidance_embeds") else "none"

    @property
    def frame_step(self) -> int:
        return self.vae_config()["temporal_compression_ratio"]

    def transformer_config(self) -> dict:
        return read_json(self.path / "transformer" / "config.json")

    def latent_channels(self) -> int:
        return self.transformer_config()["in_channels"]  # as HunyuanVideoPipeline draws them

    def latent_shape(self, request: SampleRequest) -> tuple[int, ...]:
        vae = self.vae_config()
        s, t = vae["spatial_compression_ratio"], vae["temporal_compression_ratio"]
        return (self.latent_channels(), (request.frames - 1) // t + 1,
                request.height // s, request.width // s)

    def set_timesteps(self, scheduler, steps: int, latents: torch.Tensor) -> torch.Tensor:
        import numpy as np

        sigmas = np.linspace(1.0, 0.0, steps + 1)[:-1]
        scheduler.set_timesteps(sigmas=sigmas, device=latents.device)
        return scheduler.timesteps

    # ---- the reference -----------------------------------------------------------------------
    def diffusers_sample(self, denoiser, request: SampleRequest, steps: int,
                         guidance: float) -> torch.Tensor:
        from diffusers import HunyuanVideoPipeline

        from dpipe.models.common.tiny_llama3_tokenizer import load_byte_level_tokenizer

        # The tokenizer as dpipe loads it (transformers 5 would drop its byte-level
        # pre-tokenizer: tokenizers.py), and the template cropped where the prompt starts with
        # that tokenizer (the pipeline's default 95 is the real Llama-3 tokenizer's count).
        tokenizer = load_byte_level_tokenizer(self.path / "tokenizer", padding_side="right")
        pipe = HunyuanVideoPipeline.from_pretrained(self.path, transformer=denoiser,
                                                    tokenizer=tokenizer, dtype=torch.float32)
        return pipe(request.prompt, height=request.height, width=request.width,
                    num_frames=request.frames, num_inference_steps=steps,
                    guidance_scale=guidance, prompt_template=prompt_template(tokenizer),
                    max_sequence_length=self.spec.cfg.max_text_tokens,
                    generator=torch.Generator().manual_seed(request.seed),
                    output_type="latent").frames
