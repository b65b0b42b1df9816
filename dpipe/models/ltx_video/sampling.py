"""LTX-Video samples as `LTXPipeline` does (`LTXImageToVideoPipeline` with `model.i2v=true`):
noise in (C, (F-1)/8 + 1, H/32, W/32) from the seed (C = the transformer's in_channels), sigmas
linspace(1, 1/steps, steps) with mu = calculate_shift(latent frames x height x width) from the
scheduler's config (used where it shifts dynamically; its shift and shift_terminal otherwise),
Euler steps, the frame rate 25 in the rotary positions, classifier-free guidance 3.0 with the
negative prompt (guidance_rescale 0, the pipeline's default), 50 steps. dpipe keeps the latents
unpacked (C, f, h, w): `make_inputs` packs them into tokens, `prediction` unpacks the output, as
the pipeline's _pack_latents / _unpack_latents do. The decode un-normalises with the VAE's
latents_mean / latents_std and scaling_factor and, for a timestep-conditioned VAE (0.9.1 and
later), passes the pipeline's default decode_timestep 0.0 (its decode noise scale defaults to
that timestep, so no noise is mixed in).

Image-to-video (an item with a first frame, `control` or `first_frame`; needed with
`model.i2v=true`, as LTXImageToVideoPipeline and as dpipe trains it): the first
latent frame is the control image's latents, its tokens get t = 0, and only the later frames are
stepped. One difference from the pipeline, on purpose: the pipeline encodes the image with a
*sample* of the VAE posterior (mean + std * noise from the seed's generator), dpipe with its mode
(the mean), which is what the training cache holds and what `d.control` carries, so that the
condition is the one the model trained on (the shared layer hands a family the mode only, not
the posterior's std, so the pipeline's draw cannot be rebuilt here). dpipe still draws that
posterior noise from the generator first, so the video's noise equals the pipeline's; the two
differ by the std * noise on the image latents and what follows from it (with the tiny model's
random VAE, std ~ 1: latents apart by up to ~4; with the posterior's mean in both, ~1e-6). The
pipeline normalises the image latents without scaling_factor, the cache with it: the same for
LTX-Video, whose VAEs have scaling_factor 1.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from dpipe.models.frame_modes import FIRST, NONE
from dpipe.models.ltx_video.packing import unpack
from dpipe.models.sampling import Denoising, FamilySampling, SampleRequest


class FirstFrameSampling(FamilySampling):
    """What LTX-Video and LTX-2 sample alike: latent frames of `temporal_ratio` frames, and
    image-to-video from a first frame (`control` or `first_frame`) with any checkpoint (their
    image-to-video pipelines take the text-to-video weights), which a model.i2v run needs; the
    latents (C, F', h, w), C the transformer's in_channels, and their decode."""

    video = True

    @property
    def frame_step(self) -> int:
        return self.spec.temporal_ratio

    @property
    def needs_control(self) -> bool:  # trained image-to-video (model.i2v): a first frame
        return self.spec.i2v

    takes_control = True

    def latent_shape(self, request: SampleRequest) -> tuple[int, ...]:
        spatial, temporal = self.spec._ratios()
        channels = self.spec.part_config("transformer")["in_channels"]
        return (channels, (request.frames - 1) // temporal + 1, request.height // spatial,
                request.width // spatial)

    @torch.no_grad()
    def decode(self, vae, latents: torch.Tensor) -> torch.Tensor:
        """Un-normalised (x * latents_std / scaling_factor + latents_mean) and decoded at
        decode_timestep 0 where the VAE is timestep-conditioned (the pipelines' default: its
        noise scale defaults to that timestep, so no noise is mixed in)."""
        x = latents.to(vae.device, torch.float32)
        mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(x)
        std = vae.latents_std.view(1, -1, 1, 1, 1).to(x)
        x = (x * std / vae.config.scaling_factor + mean).to(vae.dtype)
        timestep = (torch.zeros(1, device=x.device, dtype=x.dtype)
                    if vae.config.timestep_conditioning else None)
        video = vae.decode(x, timestep, return_dict=False)[0][0].float()
        return video[:, 0] if video.shape[1] == 1 else video

    @staticmethod
    def image_to_video(request: SampleRequest) -> bool:
        return request.control is not None

    @staticmethod
    def loaded_image(path: str, request: SampleRequest):
        """The image at `path` fitted to the request's size as dpipe loads it (its 8-bit RGB
        from `load_image`'s pixels): a reference pipeline's conditioning image."""
        from PIL import Image

        from dpipe.images import load_image

        pixels = load_image(Path(path), request.width, request.height)
        pixels = ((pixels + 1) * 127.5).round().clamp(0, 255).byte().permute(1, 2, 0)
        return Image.fromarray(pixels.numpy())


class LTXVideoSampling(FirstFrameSampling):
    default_steps = 50
    default_guidance = 3.0

    @property
    def fps(self) -> float:  # the pipeline's frame_rate (25): it scales the rotary positions
        return float(self.spec.default_fps)

    def batch(self, d: Denoising, t: torch.Tensor, text: dict[str, torch.Tensor]):
        mode = FIRST if self.image_to_video(d.request) else NONE
        return replace(super().batch(d, t, text), frame_mode=torch.tensor([mode]))

    # ---- latents -----------------------------------------------------------------------------
    def image_tokens(self, latents: torch.Tensor) -> int:
        """The pipeline's video_sequence_length: latent frames x height x width (unpatched)."""
        return latents.shape[-3] * latents.shape[-2] * latents.shape[-1]

    def start(self, request, steps, guidance, text, uncond, control, device) -> Denoising:
        if not self.image_to_video(request):
            return super().start(request, steps, guidance, text, uncond, control, device)
        if control is None:
            raise ValueError(f"{self.spec.family} (i2v) samples from a control image")
        generator = torch.Generator().manual_seed(request.seed)
        shape = (1, *self.latent_shape(request))
        # The pipeline first samples the image's VAE posterior with the generator (its noise,
        # shaped as one latent frame), then draws the video's noise: draw both, keep the mode.
        torch.randn((*shape[:2], 1, *shape[3:]), generator=generator)
        noise = torch.randn(shape, generator=generator)
        latents = noise.clone()
        latents[:, :, :1] = control.to(noise)[:, :, :1]
        d = super().start(request, steps, guidance, text, uncond, control, device)
        d.latents = latents.to(device)
        return d

    # ---- one step ----------------------------------------------------------------------------
    def prediction(self, output: torch.Tensor, d: Denoising) -> torch.Tensor:
        p, pt = self.spec._patches
        _, _, f, h, w = d.latents.shape
        return unpack(output.float(), (f // pt, h // p, w // p), p, pt)

    def step(self, d: Denoising, t: torch.Tensor, prediction: torch.Tensor) -> None:
        if not self.image_to_video(d.request):
            return super().step(d, t, prediction)
        # LTXImageToVideoPipeline steps the frames after the first (the condition) alone.
        later = d.scheduler.step(prediction[:, :, 1:], t, d.latents[:, :, 1:], return_dict=False)[0]
        d.latents = torch.cat([d.latents[:, :, :1], later], dim=2)

    # ---- the reference -----------------------------------------------------------------------
    def reference_class(self, request: SampleRequest) -> str:
        return "LTXImageToVideoPipeline" if self.image_to_video(request) else "LTXPipeline"

    def reference_arguments(self, pipe, request: SampleRequest, steps: int,
                            guidance: float) -> dict:
        arguments = {**super().reference_arguments(pipe, request, steps, guidance),
                     "frame_rate": self.fps}
        if self.image_to_video(request):
            arguments["image"] = self.loaded_image(request.control, request)
        return arguments

    def reference_latents(self, pipe, packed: torch.Tensor,
                          request: SampleRequest) -> torch.Tensor:
        p, pt = self.spec._patches
        _, f, h, w = self.latent_shape(request)
        return unpack(packed, (f // pt, h // p, w // p), p, pt)
