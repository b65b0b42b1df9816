"""Qwen-Image and Qwen-Image-Edit sample as `QwenImagePipeline` / `QwenImageEditPipeline` do.

Both pipelines: noise in (1, 1, C, h, w) from the seed (the same numbers as dpipe's (1, C, h, w)),
packed in 2x2 patches; sigmas 1 -> 1/steps with the resolution-dependent (exponential) shift `mu`
from the packed token count; the transformer gets t / 1000; the flow-matching Euler step.

Guidance is "true CFG" (`true_cfg_scale`, 4.0 by default), and the pipelines only run it when a
negative prompt is given AND the scale exceeds 1; without a negative prompt they make one
prediction whatever the scale. dpipe mirrors that: an empty `negative_prompt` (the config's
default) is no negative prompt, so by default no CFG runs, as with the pipeline's defaults; any
non-empty negative prompt (the model card uses " ") turns it on at 4.0. The combination is
rescaled to the norm of the conditional prediction over each packed token's channels
(`noise_pred = comb * |cond| / |comb|`, the norm over the last dim of the (B, N, 4C) packing),
as the pipelines do it.

Decoding un-normalises with the VAE's latents_mean / latents_std and decodes one frame of the
Wan-style video VAE.

Qwen-Image-Edit-2509 / 2511 (`QwenImageEditPlusSampling`) do the same with each of up to three
references, in order.

Qwen-Image-Edit additionally appends the reference image's packed latents to the image tokens (the
family's `make_inputs` does it from `d.control`) and reads the prediction from the target tokens
only (the last layer already cuts them). Its text comes from `encode_prompts_with_controls`: the
VL encoder sees the control image resized to ~1024x1024 pixels (`calculate_dimensions`), as the
pipeline's `prompt_image`. The pipeline VAE-encodes the reference at ~1 MP whatever the output
size (`calculate_dimensions(1024 * 1024, width / height)`, e.g. 1024x1024 or 1184x896), and so
does dpipe's sampler (`control_size`): the control image is fitted to that size for its latents
and for the prompt, so a sample shows the LoRA as the pipeline will use it. (Training fits
control images to the target's size, as the dataset's buckets give them.)
"""

from __future__ import annotations

import torch

from dpipe.models.diffusers_folder import wan_vae_decoded
from dpipe.models.common.latent_packing import pack, unpack
from dpipe.models.sampling import Denoising, FamilySampling, SampleRequest


class QwenImageSampling(FamilySampling):
    default_steps = 50  # num_inference_steps
    default_guidance = 4.0  # true_cfg_scale; on only with a negative prompt (see the module doc)
    guidance_kind = "cfg"
    packed = True  # the pipelines' `_unpack_latents` without their frame axis

    def reference_class(self, request: SampleRequest) -> str:
        return self.spec.pipeline_class

    # ---- guidance: the pipeline's rule -----------------------------------------------------------
    @staticmethod
    def has_negative_prompt(request: SampleRequest) -> bool:
        """The pipeline's `has_neg_prompt`: dpipe's empty default stands for none given."""
        return request.negative_prompt != ""

    def start(self, request: SampleRequest, steps: int, guidance: float,
              text: dict[str, torch.Tensor], uncond: dict[str, torch.Tensor] | None,
              control: torch.Tensor | None, device: torch.device) -> Denoising:
        d = super().start(request, steps, guidance, text, uncond, control, device)
        if not self.has_negative_prompt(request):  # do_true_cfg = scale > 1 and has_neg_prompt
            d.uncond = None
        return d

    def negative_prompt(self, request: SampleRequest) -> str | None:
        return request.negative_prompt if self.has_negative_prompt(request) else None

    # ---- latents -----------------------------------------------------------------------------
    def vae_factor(self) -> int:
        return 2 ** len(self.vae_config()["temperal_downsample"])

    def latent_shape(self, request: SampleRequest) -> tuple[int, ...]:
        """(z_dim, h, w), h and w even (`prepare_latents`); the pipeline's extra frame axis of
        size 1 changes no value drawn."""
        f = self.vae_factor()
        return (self.vae_config()["z_dim"], 2 * (request.height // (f * 2)),
                2 * (request.width // (f * 2)))

    # ---- one step ----------------------------------------------------------------------------
    def guide(self, cond: torch.Tensor, uncond: torch.Tensor, d: Denoising) -> torch.Tensor:
        cond, uncond = pack(cond), pack(uncond)
        comb = uncond + d.guidance * (cond - uncond)
        cond_norm = torch.norm(cond, dim=-1, keepdim=True)
        noise_norm = torch.norm(comb, dim=-1, keepdim=True)
        return unpack(comb * (cond_norm / noise_norm), d.latents)

    # ---- decoding ----------------------------------------------------------------------------
    def decode(self, vae, latents: torch.Tensor) -> torch.Tensor:
        return wan_vae_decoded(vae, latents[:, :, None])[:, 0]  # a video VAE: one frame

    # ---- the reference -----------------------------------------------------------------------
    def reference_arguments(self, pipe, request: SampleRequest, steps: int,
                            guidance: float) -> dict:
        arguments = super().reference_arguments(pipe, request, steps, guidance)
        del arguments["guidance_scale"]  # the distilled models' input: the scale is true CFG's
        return {**arguments, "negative_prompt": self.negative_prompt(request),
                "true_cfg_scale": guidance}


class QwenImageEditSampling(QwenImageSampling):
    """See the module docstring: the reference at the pipeline's ~1 MP size."""

    needs_control = True

    def reference_parts(self, denoiser, request: SampleRequest) -> dict:
        # The processor as the spec loads it (Qwen2VLProcessor needs torchvision for its video
        # half; `load_processor` falls back to its image + text part).
        from dpipe.models.qwen_image.edit import load_processor

        return {"processor": load_processor(self.path / "processor")}

    def control_size(self, request: SampleRequest) -> tuple[int, int]:
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

        width, height, _ = calculate_dimensions(1024 * 1024, request.width / request.height)
        return width, height

    def control_image(self, request: SampleRequest):
        """The control image as dpipe's sampler encodes it: fitted to `control_size` (as
        `dpipe.images.load_image` does), 8-bit RGB; the pipeline keeps that size."""
        from dpipe.images import fit, open_rgb

        return fit(open_rgb(request.control), *self.control_size(request))

    def reference_arguments(self, pipe, request: SampleRequest, steps: int,
                            guidance: float) -> dict:
        arguments = super().reference_arguments(pipe, request, steps, guidance)
        # The edit pipeline cuts nothing with max_sequence_length (and refuses > 1024): the
        # image's vision tokens and the instruction are all kept, as encode_prompts_with_controls
        # keeps them.
        del arguments["max_sequence_length"]
        return {**arguments, "image": self.control_image(request)}


class QwenImageEditPlusSampling(QwenImageEditSampling):
    """Qwen-Image-Edit-2509 / 2511: every reference fitted to the ~1 MP `control_size` (the
    pipeline's VAE_IMAGE_SIZE), as one reference is, and handed to the pipeline in order (it shows
    each to the VL encoder at ~384x384 pixels and VAE-encodes it at that size)."""

    def control_size(self, request: SampleRequest) -> tuple[int, int]:
        from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

        return plus.calculate_dimensions(plus.VAE_IMAGE_SIZE, request.width / request.height)

    def control_image(self, request: SampleRequest):
        from dpipe.images import fit, open_rgb

        return [fit(open_rgb(path), *self.control_size(request)) for path in request.controls]
