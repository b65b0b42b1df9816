"""LTX-2 samples video as `LTX2Pipeline` computes its video stream, with the transformer run the
way dpipe trains it: video only (`isolate_modalities=True`, no audio-to-video attention).

As the pipeline: noise N(0, 1) in (C, (F-1)/8 + 1, H/32, W/32) from the seed (drawn before the
audio noise, which dpipe does not need), sigmas linspace(1, 1/steps, steps) shifted by
mu = calculate_shift(video tokens, 1024, 4096, 0.95, 2.05) (the scheduler's config where it has
them) and stretched to its terminal 0.1; the transformer's velocity becomes x0 = x - sigma v,
classifier-free guidance on x0 (x0_cond + (g - 1)(x0_cond - x0_uncond), g = 3.0) rescaled by
`guidance_rescale` 0.7 (`rescale_noise_cfg` against x0_cond), back to the velocity
(x - x0) / sigma, Euler steps; rotary positions at 24 fps; 30 steps; latents un-normalised
(x * latents_std / scaling_factor + latents_mean) and decoded at decode_timestep 0 (no decode
noise, the pipeline's default). Clips of 8k+1 frames; 1 frame is an image.

Image-to-video (an item with `first_frame`, or `control`; needed with `model.i2v=true`), as
`LTX2ImageToVideoPipeline`: the first latent frame of the noise is replaced by the image's
latents (the VAE posterior's mode, normalised, as the pipeline encodes it with "argmax" and as
dpipe caches it), its tokens get t = 0 while the audio and the prompt modulation read the
step's sigma, guidance runs on the whole x0 as above, and only the later frames are stepped.
One difference, on purpose: the pipeline first re-compresses the image as one H.264 frame at
CRF 33 (`image_crf`, for Gemma 3 checkpoints), dpipe conditions on the image as given, as it
trains on a clip's own first frame; `diffusers_sample` passes `image_crf=0`.

From a last frame (an item with `last_frame`, with or without a first), as
`LTX2ConditionPipeline` with the last frame at latent index -1 (and the first at 0): the noise is
drawn over the packed tokens with the last frame's appended (h * w more), kept here as one more
latent frame after the clip's, which holds the frame's own latents (encoded alone, as training
caches them) and is never stepped, as the pipeline's conditioning mask keeps those tokens; the
shift's token count, the guidance and its rescale take the appended frame as the pipeline does;
`output_latents` leaves it out of the decode. The pipeline's CRF re-compression is skipped as
above (`crf=0` on its conditions in `diffusers_sample`).

What differs from the pipeline's default video, and why. dpipe's pipeline layers hold the video
stream only (dpipe trains LTX-2 video-only, see layers.py), so no prediction here can see the
audio stream. LTX2Pipeline's defaults need three things that do:
  * its cond/uncond passes run the joint audio-video transformer (`isolate_modalities=False`):
    the video reads the audio stream through the audio-to-video cross-attention;
  * modality-isolation guidance (`modality_scale` 3.0) adds (3 - 1)(x0_joint - x0_video_only);
  * spatio-temporal guidance (`stg_scale` 1.0, block 28) adds x0_cond - x0_perturbed, from a
    third pass with that block's self-attention skipped, which dpipe's loop (the prompt and the
    negative prompt, two micro-batches per step) does not run.
A run with model.audio=true, which trains the joint computation, samples it with its sound
(av_sampling.py); this module is the model.audio=false sampler.
dpipe's sampler is the video-only computation: both passes isolated, no modality or STG term
(with everything isolated the modality term would be 0 anyway). `diffusers_sample` runs the real
LTX2Pipeline with exactly those changes and nothing else: stg_scale = audio_stg_scale = 0,
modality_scale = audio_modality_scale = 1, and its transformer called with
`isolate_modalities=True` (the audio stream still runs there, and its guidance, but it no longer
reaches the video). With them the two are equal.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from dpipe.models.frame_modes import BOTH, FIRST, LAST, NONE
from dpipe.models.ltx_video.packing import unpack
from dpipe.models.ltx_video.sampling import FirstFrameSampling
from dpipe.models.sampling import Denoising, SampleRequest

GUIDANCE_RESCALE = 0.7  # LTX2Pipeline's guidance_rescale default


def calculate_shift(image_seq_len, base_seq_len, max_seq_len, base_shift, max_shift) -> float:
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * m + base_shift - m * base_seq_len


def rescale_noise_cfg(noise_cfg: torch.Tensor, noise_pred_text: torch.Tensor,
                      guidance_rescale: float) -> torch.Tensor:
    """diffusers' `rescale_noise_cfg`, as pipeline_ltx2.py applies it (to x0 predictions)."""
    dims = list(range(1, noise_pred_text.ndim))
    std_text = noise_pred_text.std(dim=dims, keepdim=True)
    std_cfg = noise_cfg.std(dim=dims, keepdim=True)
    rescaled = noise_cfg * (std_text / std_cfg)
    return guidance_rescale * rescaled + (1 - guidance_rescale) * noise_cfg


class LTX2Sampling(FirstFrameSampling):  # image-to-video: LTX2ImageToVideoPipeline
    default_steps = 30
    default_guidance = 3.0
    fps = 24.0  # LTX2Pipeline's frame_rate (motion_speed 1): the rotary positions' rate

    def check(self, request: SampleRequest) -> str | None:
        problem = super().check(request)
        if problem is None and self.image_to_video(request) and request.frames == 1:
            # The pipeline would hand the image back: its one latent frame is the condition.
            return (f"frames=1 with a first frame: {self.spec.family} makes the frames after "
                    f"it; ask for {self.frame_step + 1} or more frames, or leave out "
                    "`first_frame` for text-to-image")
        return problem

    # ---- latents (kept unpacked, (1, C, F', h, w): the pipeline's element-wise steps and its
    # whole-sample std in the rescale do not depend on the layout) ----------------------------
    def image_tokens(self, latents: torch.Tensor) -> int:
        p, pt = self.spec._patches
        f, h, w = latents.shape[-3:]
        return (f // pt) * (h // p) * (w // p)  # the packed sequence length

    def shift_mu(self, scheduler, latents: torch.Tensor) -> float:
        c = scheduler.config  # with the pipeline's fallbacks
        return calculate_shift(self.image_tokens(latents), c.get("base_image_seq_len", 1024),
                               c.get("max_image_seq_len", 4096), c.get("base_shift", 0.95),
                               c.get("max_shift", 2.05))

    def set_timesteps(self, scheduler, steps: int, latents: torch.Tensor) -> torch.Tensor:
        import numpy as np

        sigmas = np.linspace(1.0, 1 / steps, steps)
        scheduler.set_timesteps(steps, device=latents.device, sigmas=sigmas,
                                mu=self.shift_mu(scheduler, latents))
        return scheduler.timesteps

    def initial_latents(self, request: SampleRequest) -> torch.Tensor:
        if request.last_frame is None:
            return super().initial_latents(request)
        # LTX2ConditionPipeline draws its noise over the packed tokens, the last frame's
        # appended ones included: (1, F' * h * w + h * w, C), here as one more latent frame.
        c, f, h, w = self.latent_shape(request)
        p, pt = self.spec._patches
        generator = torch.Generator().manual_seed(request.seed)
        noise = torch.randn((1, (f + 1) * (h // p) * (w // p), c), generator=generator)
        return unpack(noise, (f + 1, h // p, w // p), p, pt)

    def start(self, request, steps, guidance, text, uncond, control, device) -> Denoising:
        d = super().start(request, steps, guidance, text, uncond, control, device)
        if self.image_to_video(request):
            if control is None:
                raise ValueError(f"{self.spec.family} (i2v) samples from a first frame")
            d.latents = self.with_first_frame(d.latents, control.to(d.latents))
        if request.last_frame is not None:
            # Its own latent in the slot after the clip's frames (keyframes.py), clean.
            d.latents[:, :, -1:] = self.last_frame_latents(request).to(d.latents)
        return d

    def last_frame_latents(self, request: SampleRequest) -> torch.Tensor:
        """(1, C, 1, h, w): the request's last frame fitted to its size as dpipe loads images,
        encoded alone as the training cache encodes a clip's last frame."""
        from pathlib import Path
        from types import SimpleNamespace

        from dpipe.images import load_image

        vae = self.load_vae(torch.device("cpu"), torch.float32)
        pixels = load_image(Path(request.last_frame), request.width, request.height)[None]
        return self.spec.encode_images(SimpleNamespace(vae=vae), pixels)  # the VAE alone

    def output_latents(self, request: SampleRequest, latents: torch.Tensor) -> torch.Tensor:
        """The clip's latents, without a given last frame's slot."""
        return latents[:, :, :self.latent_shape(request)[1]]

    def with_first_frame(self, latents: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        """The noise with its first latent frame replaced by the image's latents (1, C, 1, h, w),
        as LTX2ImageToVideoPipeline's prepare_latents mixes them (its conditioning mask)."""
        out = latents.clone()
        out[:, :, :1] = image[:, :, :1]
        return out

    def batch(self, d: Denoising, t: torch.Tensor, text: dict[str, torch.Tensor]):
        first, last = self.image_to_video(d.request), d.request.last_frame is not None
        mode = (BOTH if first else LAST) if last else (FIRST if first else NONE)
        batch = replace(super().batch(d, t, text), frame_mode=torch.tensor([mode]))
        if d.latents.shape[2] == 1 or last:
            return batch
        # A clip's batch ends with the slot of its last frame's own latent, as cached
        # (keyframes.py); these modes leave it unread.
        slot = torch.zeros_like(d.latents[:, :, :1])
        return replace(batch, **{k: torch.cat([getattr(batch, k), slot], dim=2)
                                 for k in ("latents", "noisy", "target", "noise")})

    # ---- one step ----------------------------------------------------------------------------
    def _sigma(self, d: Denoising) -> torch.Tensor:
        return d.scheduler.sigmas[d.index]

    def prediction(self, output: torch.Tensor, d: Denoising) -> torch.Tensor:
        """Packed velocity -> x0 = x - sigma v (`convert_velocity_to_x0`), unpacked."""
        p, pt = self.spec._patches
        grid = (d.latents.shape[2] // pt, d.latents.shape[3] // p, d.latents.shape[4] // p)
        velocity = unpack(output.float(), grid, p, pt)
        return d.latents - velocity * self._sigma(d)

    def guide(self, cond: torch.Tensor, uncond: torch.Tensor, d: Denoising) -> torch.Tensor:
        guided = cond + (d.guidance - 1) * (cond - uncond)
        return rescale_noise_cfg(guided, cond, GUIDANCE_RESCALE) if GUIDANCE_RESCALE > 0 else guided

    def step(self, d: Denoising, t: torch.Tensor, prediction: torch.Tensor) -> None:
        velocity = (d.latents - prediction) / self._sigma(d)  # convert_x0_to_velocity
        # The pipelines keep the given frames (a first one, a last one's slot) as they are: its
        # velocity there is 0 after the conditioning mask; the other frames step.
        start = 1 if self.image_to_video(d.request) else 0
        end = d.latents.shape[2] - (d.request.last_frame is not None)
        stepped = d.scheduler.step(velocity[:, :, start:end], t, d.latents[:, :, start:end],
                                   return_dict=False)[0]
        d.latents = torch.cat([d.latents[:, :, :start], stepped, d.latents[:, :, end:]], dim=2)

    # ---- the reference -----------------------------------------------------------------------
    # The transformer as dpipe trains it with model.audio=false: video only.
    isolate_modalities = True

    def reference_class(self, request: SampleRequest) -> str:
        """LTX2Pipeline; LTX2ImageToVideoPipeline given a first frame, LTX2ConditionPipeline
        given a last one."""
        return ("LTX2ConditionPipeline" if request.last_frame is not None
                else "LTX2ImageToVideoPipeline" if self.image_to_video(request) else "LTX2Pipeline")

    def load_reference(self, denoiser, request: SampleRequest):
        pipe = super().load_reference(denoiser, request)
        if request.height % 32 or request.width % 32:
            # The pipeline asks for multiples of 32, its VAE's factor in the real model; a model
            # with a smaller one (the tiny) samples multiples of its own: the size test (the only
            # use check_inputs makes of the size) is told a multiple of 32.
            check_inputs = pipe.check_inputs

            def sizes_of_32(*args, **kwargs):
                return check_inputs(*args, **{**kwargs, "height": 32, "width": 32})

            pipe.check_inputs = sizes_of_32
        return pipe

    def reference_arguments(self, pipe, request: SampleRequest, steps: int,
                            guidance: float) -> dict:
        """The request's arguments with dpipe's guidance, no spatio-temporal and no
        modality-isolation guidance; the given frames fitted to the request's size as dpipe
        loads them, not re-compressed (`image_crf=0`, `crf=0`: see the module's docstring)."""
        arguments = {**super().reference_arguments(pipe, request, steps, guidance),
                     "frame_rate": self.fps, "guidance_rescale": GUIDANCE_RESCALE,
                     "stg_scale": 0.0, "audio_stg_scale": 0.0, "modality_scale": 1.0,
                     "audio_modality_scale": 1.0}
        if request.last_frame is not None:
            # LTX2ConditionPipeline's conditions: the first frame (where given) at latent index
            # 0, the last at -1.
            from diffusers.pipelines.ltx2.pipeline_ltx2_condition import LTX2VideoCondition

            given = [(request.control, 0)] if self.image_to_video(request) else []
            arguments["conditions"] = [
                LTX2VideoCondition(self.loaded_image(path, request), index=index, crf=0)
                for path, index in [*given, (request.last_frame, -1)]]
        elif self.image_to_video(request):
            arguments.update(image=self.loaded_image(request.control, request), image_crf=0)
        return arguments

    def diffusers_sample(self, denoiser, request: SampleRequest, steps: int,
                         guidance: float) -> torch.Tensor:
        final = {}
        self.run_pipeline(denoiser, request, steps, guidance, final)
        return self.unpacked(final["latents"], request)

    def unpacked(self, packed: torch.Tensor, request: SampleRequest) -> torch.Tensor:
        """The pipeline's packed video latents -> (1, C, F', h, w); (1, C, F' + 1, h, w) with a
        last frame, whose tokens LTX2ConditionPipeline appends."""
        shape = self.latent_shape(request)
        p, pt = self.spec._patches
        frames = shape[1] // pt + (request.last_frame is not None)
        return unpack(packed, (frames, shape[2] // p, shape[3] // p), p, pt)

    def run_pipeline(self, denoiser, request: SampleRequest, steps: int, guidance: float,
                     final: dict, **kwargs):
        """The reference pipeline run on the request with `reference_arguments` and `kwargs`;
        `final["latents"]` gets its packed, normalised video latents after the last step.
        Returns its output."""
        pipe = self.load_reference(denoiser, request)

        def keep(_pipe, _i, _t, tensors):
            final["latents"] = tensors["latents"]  # packed and normalised, after the step
            return {}

        forward = denoiser.__dict__.get("forward")
        joint = denoiser.forward

        def isolated(*args, **kwargs):  # the transformer as dpipe trains it: video only
            kwargs["isolate_modalities"] = True
            return joint(*args, **kwargs)

        if self.isolate_modalities:
            denoiser.forward = isolated
        try:
            return pipe(**{**self.reference_arguments(pipe, request, steps, guidance),
                           "callback_on_step_end": keep,
                           "callback_on_step_end_tensor_inputs": ["latents"], **kwargs})
        finally:
            if forward is None:
                denoiser.__dict__.pop("forward", None)
            else:
                denoiser.forward = forward
