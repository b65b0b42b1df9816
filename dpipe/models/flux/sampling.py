"""FLUX.1 samples as `FluxPipeline` does: noise in (C, h, w), sigmas 1 -> 1/steps shifted by the
image's token count, the guidance-distilled scale as the model's input (3.5 for FLUX.1-dev), no
negative prompt; latents unpacked from 2x2 patches, then un-scaled and decoded by the KL VAE.
FLUX.1 Kontext samples edits the same way (`FluxKontextSampling`)."""

from __future__ import annotations

from dpipe.models.sampling import FamilySampling, SampleRequest


class FluxSampling(FamilySampling):
    default_steps = 28
    default_guidance = 3.5
    packed = True
    reference_pipeline = "FluxPipeline"  # its true CFG is off (true_cfg_scale 1)

    @property
    def guidance_kind(self) -> str:  # FLUX.1-dev embeds it; schnell takes none
        config = self.spec.part_config("transformer")
        return "embedded" if config.get("guidance_embeds") else "none"


class FluxKontextSampling(FluxSampling):
    """FLUX.1 Kontext samples edits as `FluxKontextPipeline` does: FLUX.1's noise, sigmas (shifted
    by the target's token count, the reference's not counted), embedded guidance (3.5) and
    decode; the reference image's clean latents (`d.control`, encoded as the training cache
    encodes control images) are packed and appended after the noisy target's tokens with ids
    (1, row, column) by the family's own `make_inputs`, and the prediction for them is dropped.

    Two of the pipeline's defaults change the size it works at, and dpipe keeps the request's: it
    rescales the output to `max_area` (1024x1024 pixels) and, with `_auto_resize`, the reference
    image to the closest of Kontext's preferred resolutions. dpipe samples at the request's size
    with the reference fitted to that size (as training sees it); the reference run passes
    `max_area=width*height` and `_auto_resize=False` so that it does the same."""

    default_steps = 28
    default_guidance = 3.5  # FluxKontextPipeline's guidance_scale (embedded); true CFG is off
    needs_control = True
    reference_pipeline = "FluxKontextPipeline"

    def reference_arguments(self, pipe, request: SampleRequest, steps: int,
                            guidance: float) -> dict:
        # The reference image as training and dpipe's sampler see it: fitted to the request's
        # size.
        return {**super().reference_arguments(pipe, request, steps, guidance),
                "image": self.fitted(request.control, request), "_auto_resize": False,
                "max_area": request.width * request.height}
