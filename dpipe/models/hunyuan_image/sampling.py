"""HunyuanImage 2.1 samples as `HunyuanImagePipeline` does.

Noise in (C, H / compression, W / compression) (no packing: the transformer's patch is 1), sigmas
`linspace(1, 0, steps + 1)[:-1]` shifted by the scheduler's fixed `shift`, the transformer's
prediction stepped by FlowMatchEulerDiscreteScheduler, latents divided by the VAE's scale before
decoding.

Guidance as the pipeline chooses it:
- The base model has a guider (`guider/`, and `ocr_guider/` for prompts with quoted text to
  render): AdaptiveProjectedMixGuidance, i.e. classifier-free guidance with a negative prompt for
  the first `adaptive_projected_guidance_start_step` steps (updating a momentum buffer), then
  adaptive projected guidance. The pipeline takes no guidance scale at run time; the request's
  guidance replaces the chosen guider's `guidance_scale` (its default is the guider's own), the
  APG settings stay the guider's. The guider object itself does the combining, so it is the
  pipeline's arithmetic exactly.
- The distilled model (`guidance_embeds`) takes the scale as an input, times 1000 (the pipeline's
  `distilled_guidance_scale`, 3.25 by default); it has meanflow embedders, and the pipeline asks
  for the mean velocity over [t_next, t] (`timestep_r` = the next timestep, 0 at the last step),
  which the sampler hands to the embed layer as a ninth input (training uses r = t). Where a
  distilled folder also has an enabled guider the pipeline runs both, and so does this.
"""

from __future__ import annotations

import math

import torch

from dpipe.models.diffusers_folder import read_json
from dpipe.models.sampling import Denoising, FamilySampling, SampleRequest

DISTILLED_GUIDANCE = 3.25  # HunyuanImagePipeline.__call__'s distilled_guidance_scale


class HunyuanImageSampling(FamilySampling):
    decode_shift = False  # the pipeline divides by the VAE's scale alone
    default_steps = 50  # HunyuanImagePipeline.__call__ (the distilled model's card uses 8)
    schedule = "to_zero"
    reference_pipeline = "HunyuanImagePipeline"

    # ---- the model folder ----------------------------------------------------------------------
    def _transformer(self) -> dict:
        return self.spec.part_config("transformer")

    def _guider_names(self) -> list[str]:
        """The guider components model_index.json names (null ones left out)."""
        index = read_json(self.path / "model_index.json")
        return [n for n in ("guider", "ocr_guider")
                if isinstance(index.get(n), (list, tuple)) and index[n][0] is not None
                and (self.path / n).is_dir()]

    def _load_guider(self, name: str | None):
        from diffusers.guiders import AdaptiveProjectedMixGuidance

        if name is None:  # the pipeline's fallback: a disabled guider, the conditional prediction
            return AdaptiveProjectedMixGuidance(enabled=False)
        import diffusers

        cls_name = read_json(self.path / "model_index.json")[name][1]
        return getattr(diffusers, cls_name).from_pretrained(self.path, subfolder=name)

    @property
    def guidance_kind(self) -> str:
        if self._transformer().get("guidance_embeds"):
            return "embedded"
        return "cfg" if self._guider_names() else "none"

    @property
    def default_guidance(self) -> float:
        if self._transformer().get("guidance_embeds"):
            return DISTILLED_GUIDANCE
        names = self._guider_names()
        if not names:
            return 1.0
        return float(read_json(self.path / names[0] / "guider_config.json").get(
            "guidance_scale", 3.5))

    def _choose_guider(self, text: dict[str, torch.Tensor], guidance: float):
        """The guider the pipeline picks for this prompt: the OCR guider where the prompt has
        glyph text (non-zero ByT5 embeddings), else the guider, else a disabled one; the request's
        scale replaces its guidance_scale (CFG models only)."""
        names = self._guider_names()
        name = None
        if "ocr_guider" in names and not torch.all(text["glyph"] == 0):
            name = "ocr_guider"
        elif "guider" in names:
            name = "guider"
        guider = self._load_guider(name)
        if name is not None and self.guidance_kind == "cfg":
            guider = guider.new(guidance_scale=float(guidance))
        return guider

    @staticmethod
    def _guider_on(guider) -> bool:
        """Whether the guider wants a negative prompt at some step (its start/stop aside)."""
        if not guider._enabled:
            return False
        c = guider.config
        off = 0.0 if c.get("use_original_formulation") else 1.0
        return not math.isclose(guider.guidance_scale, off)

    def uses_uncond(self, guidance: float) -> bool:
        """Whether the folder's guider wants a negative prompt at this scale (`start` decides per
        prompt, which may pick the OCR guider)."""
        names = self._guider_names()
        if not names or self.guidance_kind == "none":
            return False
        guider = self._load_guider(names[0])
        if self.guidance_kind == "cfg":
            guider = guider.new(guidance_scale=float(guidance))
        return self._guider_on(guider)

    # ---- latents and schedule ------------------------------------------------------------------
    def latent_shape(self, request: SampleRequest) -> tuple[int, ...]:
        factor = int(self.vae_config()["spatial_compression_ratio"])
        return (int(self._transformer()["in_channels"]), request.height // factor,
                request.width // factor)

    def start(self, request, steps, guidance, text, uncond, control, device) -> Denoising:
        d = super().start(request, steps, guidance, text, uncond, control, device)
        guider = self._choose_guider(text, guidance)
        # The negative prompt where the chosen guider combines it (with no negative prompt at
        # hand, the conditional prediction alone).
        d.uncond = uncond if uncond is not None and self._guider_on(guider) else None
        d.state["guider"] = guider
        return d

    # ---- one step ------------------------------------------------------------------------------
    def inputs(self, d: Denoising, t: torch.Tensor, text: dict[str, torch.Tensor]) -> tuple:
        inputs = super().inputs(d, t, text)
        if not self._transformer().get("use_meanflow"):
            return inputs
        # The pipeline's meanflow interval: r = the next timestep (0 after the last).
        i = int((d.timesteps == t).nonzero()[0, 0])
        r = d.timesteps[i + 1] if i + 1 < len(d.timesteps) else torch.zeros(())
        return (*inputs, r.reshape(1).to(inputs[1].device, inputs[1].dtype))

    def guide(self, cond: torch.Tensor, uncond: torch.Tensor, d: Denoising) -> torch.Tensor:
        """The pipeline's guider combines the predictions: CFG (and its momentum) before
        `adaptive_projected_guidance_start_step`, APG after; the conditional prediction alone
        at steps outside its start/stop."""
        guider, i = d.state["guider"], d.index
        guider.set_state(step=i, num_inference_steps=len(d.timesteps), timestep=d.timesteps[i])
        guider.prepare_inputs({})  # at step 0 a fresh momentum buffer, as in the pipeline
        return guider.forward(cond, uncond if guider.num_conditions > 1 else None).pred

    # ---- the reference -------------------------------------------------------------------------
    def reference_arguments(self, pipe, request: SampleRequest, steps: int,
                            guidance: float) -> dict:
        arguments = super().reference_arguments(pipe, request, steps, guidance)
        del arguments["guidance_scale"], arguments["max_sequence_length"]
        if self.guidance_kind == "embedded":
            return {**arguments, "distilled_guidance_scale": float(guidance)}
        for name in ("guider", "ocr_guider"):  # the pipeline takes no scale: it is the guiders'
            if getattr(pipe, name, None) is not None:
                setattr(pipe, name, getattr(pipe, name).new(guidance_scale=float(guidance)))
        return arguments
