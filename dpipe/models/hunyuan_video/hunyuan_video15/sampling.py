"""HunyuanVideo 1.5 (text-to-video) samples as `HunyuanVideo15Pipeline` does: noise in
(C, (F-1)/4 + 1, H/16, W/16) from the seed (C = the VAE's latent_channels), sigmas
linspace(1, 0, steps + 1)[:-1] shifted by the scheduler's fixed shift (5 for 480p), Euler steps;
the transformer takes [noisy, zero condition latents, zero mask] on its channels and all-zero
SigLIP tokens (`HunyuanVideo15Spec.make_inputs` builds them). Guidance is the model folder's
`guider/` (ClassifierFreeGuidance: scale 6.0 in the released t2v folders, with its rescale, its
start/stop window and its formulation), the negative prompt as a second prediction where the
guider runs one; the scale of a request replaces the guider's. The VAE decodes
latents / scaling_factor. 50 steps; clips of 4k+1 frames, written at 24 fps.
"""

from __future__ import annotations

import math

import torch

from dpipe.models.diffusers_folder import read_json
from dpipe.models.hunyuan_video.sampling import HunyuanVideoSampling
from dpipe.models.hunyuan_video.hunyuan_video15.spec import template_length
from dpipe.models.sampling import Denoising, SampleRequest

GUIDER_DEFAULTS = {"guidance_scale": 6.0, "guidance_rescale": 0.0,
                   "use_original_formulation": False, "start": 0.0, "stop": 1.0, "enabled": True}


class HunyuanVideo15Sampling(HunyuanVideoSampling):
    guidance_kind = "cfg"
    reference_pipeline = "HunyuanVideo15Pipeline"

    def guider_config(self) -> dict:
        path = self.path / "guider" / "config.json"
        return {**GUIDER_DEFAULTS, **(read_json(path) if path.is_file() else {})}

    @property
    def default_guidance(self) -> float:  # the folder's guider: 6.0 for the released t2v models
        return float(self.guider_config()["guidance_scale"])

    def latent_channels(self) -> int:
        return self.vae_config()["latent_channels"]  # as HunyuanVideo15Pipeline draws them

    def new_guider(self, guidance: float):
        import diffusers

        name = read_json(self.path / "model_index.json").get("guider", [None, None])[1]
        cls = getattr(diffusers, name or "ClassifierFreeGuidance")
        if (self.path / "guider").is_dir():
            return cls.from_pretrained(self.path, subfolder="guider").new(guidance_scale=guidance)
        return cls(**{**GUIDER_DEFAULTS, "guidance_scale": guidance})

    def uses_uncond(self, guidance: float) -> bool:
        """Where the pipeline's guider makes a second prediction (ClassifierFreeGuidance: unless
        it is disabled or the scale is 1, or 0 in the original formulation)."""
        c = self.guider_config()
        neutral = 0.0 if c["use_original_formulation"] else 1.0
        return bool(c["enabled"]) and not math.isclose(guidance, neutral)

    def start(self, request, steps, guidance, text, uncond, control, device) -> Denoising:
        d = super().start(request, steps, guidance, text, uncond, control, device)
        if d.uncond is not None:
            d.state["guider"] = self.new_guider(guidance)
        return d

    def guide(self, cond: torch.Tensor, uncond: torch.Tensor, d: Denoising) -> torch.Tensor:
        guider = d.state["guider"]  # the pipeline's own combination (window, rescale)
        i = d.index
        guider.set_state(step=i, num_inference_steps=len(d.timesteps), timestep=d.timesteps[i])
        return guider.forward(cond, uncond).pred

    # ---- the reference -----------------------------------------------------------------------
    def reference_parts(self, denoiser, request: SampleRequest) -> dict:
        return {}  # the folder's tokenizer

    def load_reference(self, denoiser, request: SampleRequest):
        pipe = super().load_reference(denoiser, request)
        # The prompt encoded as dpipe's cache encodes it (HunyuanVideo15Spec.load_encoders): the
        # chat template cropped where the prompt starts with the tokenizer at hand, the text
        # padded to max_text_tokens (the pipeline's equivalent of max_sequence_length).
        pipe.prompt_template_encode_start_idx = template_length(pipe.tokenizer, pipe.system_message)
        pipe.tokenizer_max_length = self.spec.cfg.max_text_tokens
        return pipe

    def reference_arguments(self, pipe, request: SampleRequest, steps: int,
                            guidance: float) -> dict:
        arguments = super().reference_arguments(pipe, request, steps, guidance)
        del arguments["guidance_scale"], arguments["max_sequence_length"]
        del arguments["prompt_template"]
        pipe.guider = pipe.guider.new(guidance_scale=guidance)  # it has no guidance_scale argument
        return arguments
