"""HunyuanVideo samples as `HunyuanVideoPipeline` does: noise in (C, (F-1)/4 + 1, H/8, W/8) from
the seed (C = the transformer's in_channels), sigmas linspace(1, 0, steps + 1)[:-1] shifted by the
scheduler's fixed shift (7 for HunyuanVideo; no resolution-dependent mu), Euler steps, and the
guidance-distilled scale (6.0 by default) as the model's embedded input. The pipeline's "true CFG"
(`true_cfg_scale`, off by default at 1.0) is not used: no negative prompt. The VAE decodes
latents / scaling_factor (no shift). 50 steps; clips of 4k+1 frames, written at 24 fps (the
model's native rate, as Tencent's sample script writes them; diffusers' example uses 15).
"""

from __future__ import annotations

from dpipe.models.diffusers_folder import read_json
from dpipe.models.hunyuan_video.spec import prompt_template
from dpipe.models.sampling import FamilySampling, SampleRequest


class HunyuanVideoSampling(FamilySampling):
    decode_shift = False  # the pipeline divides by the VAE's scale alone
    default_steps = 50
    default_guidance = 6.0
    video = True
    fps = 24.0
    schedule = "to_zero"
    reference_pipeline = "HunyuanVideoPipeline"  # its true CFG is off (true_cfg_scale 1)

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

    # ---- the reference -----------------------------------------------------------------------
    # The tokenizer as dpipe loads it (transformers 5 would drop its byte-level pre-tokenizer:
    # tokenizers.py), and the template cropped where the prompt starts with that tokenizer (the
    # pipeline's default 95 is the real Llama-3 tokenizer's count).
    def reference_parts(self, denoiser, request: SampleRequest) -> dict:
        from dpipe.models.common.tiny_llama3_tokenizer import load_byte_level_tokenizer

        return {"tokenizer": load_byte_level_tokenizer(self.path / "tokenizer",
                                                       padding_side="right")}

    def reference_arguments(self, pipe, request: SampleRequest, steps: int,
                            guidance: float) -> dict:
        return {**super().reference_arguments(pipe, request, steps, guidance),
                "prompt_template": prompt_template(pipe.tokenizer)}
