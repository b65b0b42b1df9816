"""Wan samples as its diffusers pipelines do (`WanPipeline`, `WanImageToVideoPipeline`): noise in
(z, F', h, w) from the seed, the folder's UniPC scheduler (flow sigmas with its fixed
`flow_shift`) set by `set_timesteps(steps)`, classifier-free guidance with the negative prompt
(5.0 and 50 steps, the pipelines' defaults), and the VAE decode after undoing the latent
normalisation (z * latents_std + latents_mean), (3, F, H, W) in [-1, 1].

What each kind of folder adds, fed to `WanSpec.make_inputs` as the training cache feeds it:
- Wan 2.1 I2V (and 2.2 I2V-A14B): `batch.latents` carries, after the z noisy channels, the
  latents of [first frame, black frames...] and (2.1) the CLIP tokens of the first frame, as the
  cache holds them for an i2v clip. The control (`d.control`, the cache's encoding of the image
  as a 1-frame clip) holds both for one latent frame; a longer clip's condition video is encoded
  here, on the first stage, with the folder's VAE, exactly as `encode_images` encodes a training
  clip (and as WanImageToVideoPipeline encodes it).
- Wan 2.2 TI2V-5B takes a control where given (text-to-video without one, as WanPipeline):
  then the first latent frame is the control's latents at t = 0 in every step and replaces the
  sampled one at the end, as WanImageToVideoPipeline does with `expand_timesteps`; the inputs are
  those `model.i2v` trains on (and are made so where the run trained text-to-video). A control
  needs a clip of 5+ frames: with one frame, the pipeline would hand the control image back.
  An i2v-trained TI2V sampled without a control gets every frame at t (as WanPipeline).
- Wan 2.2 A14B (two experts): see `WanSampling` below.
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from pathlib import Path

import torch

from dpipe.models.diffusers_folder import wan_vae_decoded
from dpipe.models.sampling import Denoising, FamilySampling, SampleRequest
from dpipe.models.frame_modes import FRAME_MODES
from dpipe.models.wan.frames import condition_video
from dpipe.models.wan.variant import pack_tokens, unpack_tokens


class WanSampling(FamilySampling):
    """Wan 2.1 / 2.2 sampling.

    Wan 2.2 A14B: the pipeline denoises with the high-noise expert (`transformer/`) while the
    scheduler's timestep is >= boundary_ratio * 1000 and with the low-noise one
    (`transformer_2/`) below it. dpipe trains one expert per run, so the pipeline stages hold only
    that one: its steps go through the stages; the steps of the other expert are computed on the
    last stage with that expert loaded frozen from the folder (the trained expert's forward of
    those steps is discarded). The sample then equals WanPipeline with the trained expert in its
    slot and the folder's other expert in the other. The frozen expert is whole on one GPU (for
    A14B, 14B parameters: ~29 GB in bf16) and is freed when every request of the round is done;
    where it does not fit, those samples fail with the out-of-memory error and training goes on.
    A folder without the other expert samples every step with the trained one (there is no
    pipeline to compare with then; the reference is WanPipeline with that expert alone).
    """

    default_steps = 50  # WanPipeline / WanImageToVideoPipeline defaults
    default_guidance = 5.0
    scheduler_class = "UniPCMultistepScheduler"
    schedule = "steps"  # as the pipelines call set_timesteps
    video = True

    def __init__(self, spec):
        super().__init__(spec)
        self.variant = spec.variant
        self._frozen = None  # (device, dtype, module): the other A14B expert while in use
        self._users: list[weakref.ref] = []  # the requests that may still need it

    # ---- what the folder is ------------------------------------------------------------------
    @property
    def frame_step(self) -> int:
        return self.variant.temporal

    @property
    def fps(self) -> float:  # Wan 2.1 and A14B make 16 fps clips, TI2V-5B 24
        return 24.0 if self.variant.expand_timesteps else 16.0

    @property
    def needs_control(self) -> bool:  # the i2v checkpoints sample from their first frame
        return self.variant.concat_condition

    @property
    def takes_control(self) -> bool:  # TI2V-5B: image-to-video where a first frame is given
        return self.variant.expand_timesteps

    def first_frame(self, d: Denoising) -> bool:
        """TI2V-5B given a first frame: its latents are the clip's first latent frame."""
        return self.takes_control and d.control is not None and d.latents.shape[2] > 1

    def check(self, request: SampleRequest) -> str | None:
        problem = super().check(request)
        if problem is None and self.takes_control and request.control and request.frames == 1:
            return ("frames=1 with a control: Wan 2.2 TI2V's control is the first frame of a "
                    f"clip, which would be the whole sample; ask for {self.frame_step + 1} or "
                    "more frames, or leave out `control` for text-to-image")
        if problem is None and self.variant.condition_modes == ("both",) and (
                request.last_frame is None):
            return ("Wan 2.1 FLF2V samples from a first and a last frame: give the item a "
                    "`last_frame` (and `first_frame`), and 5 or more frames")
        return problem

    def frame_mode(self, d: Denoising) -> str:
        """What an image-to-video checkpoint's sample conditions on: "both" with a last frame."""
        return "both" if d.request.last_frame is not None else "first"

    @property
    def other_expert(self) -> str | None:
        """The A14B expert that this run does not train, when the folder holds it."""
        if self.variant.boundary is None:
            return None
        other = "transformer_2" if self.spec.expert == "transformer" else "transformer"
        return other if (self.path / other / "config.json").is_file() else None

    def expert_at(self, scheduler, t: torch.Tensor) -> str:
        """The expert WanPipeline denoises with at scheduler timestep t."""
        boundary = self.variant.boundary * scheduler.config.num_train_timesteps
        return "transformer" if t >= boundary else "transformer_2"

    # ---- latents -----------------------------------------------------------------------------
    def latent_shape(self, request: SampleRequest) -> tuple[int, ...]:
        v = self.variant
        return (v.z_dim, (request.frames - 1) // v.temporal + 1, request.height // v.spatial,
                request.width // v.spatial)

    def start(self, request, steps, guidance, text, uncond, control, device) -> Denoising:
        d = super().start(request, steps, guidance, text, uncond, control, device)
        if self.other_expert is not None:
            self._users.append(weakref.ref(d))
        return d

    # ---- one step ----------------------------------------------------------------------------
    def model_time(self, t: torch.Tensor) -> torch.Tensor:
        """The scheduler's timestep (sigma * 1000) -> the t that `make_inputs` maps into
        [min_t, max_t] (`train_timesteps`): its inverse, so the transformer gets sigma."""
        sigma = t.reshape(1).float() / 1000
        lo, hi = self.spec.cfg.min_t, self.spec.cfg.max_t
        x = sigma if (lo, hi) == (0.0, 1.0) else (sigma - lo) / (hi - lo)
        # Of the float32 values next to x, one whose trip through make_inputs and the embedding
        # (train_timesteps, then * 1000) gives the pipeline's timestep exactly, where one does.
        wanted = t.reshape(1).float().cpu()
        x = x.cpu()
        for k in range(9):
            candidate = x
            for _ in range(k // 2 + k % 2):
                candidate = torch.nextafter(candidate, candidate + (1 if k % 2 else -1))
            if torch.equal(self.spec.train_timesteps(candidate) * 1000, wanted):
                x = candidate
                break
        return x.to(t.device)

    def batch(self, d: Denoising, t: torch.Tensor, text: dict[str, torch.Tensor]):
        batch = super().batch(d, t, text)
        x, v = d.latents, self.variant
        if v.concat_condition:  # [x_t, condition video latents, (CLIP tokens)], as cached
            mode = self.frame_mode(d)
            condition = self._condition(d).to(x)
            # The request's condition in its mode's channels, the other modes' left empty.
            parts = [x] + [condition if m == mode else torch.zeros_like(condition)
                           for m in v.condition_modes]
            if v.clip_tokens:
                parts.append(pack_tokens(self._tokens(d), x.shape).to(x))
            return replace(batch, latents=torch.cat(parts, dim=1),
                           frame_mode=torch.tensor([FRAME_MODES.index(mode)]))
        if self.first_frame(d):  # with model.i2v, make_inputs takes frame 0 from the latents
            latents = x.clone()
            latents[:, :, :1] = d.control[:, :v.z_dim, :1].to(x)
            return replace(batch, latents=latents)
        return batch

    def inputs(self, d: Denoising, t: torch.Tensor, text: dict[str, torch.Tensor]) -> tuple:
        inputs = super().inputs(d, t, text)
        if self.first_frame(d) and not self.spec.i2v:
            # Trained text-to-video: the first frame goes in as model.i2v's training gives it,
            # the clean latents at t = 0 (WanImageToVideoPipeline's first_frame_mask).
            hidden, t_in, *rest = inputs
            hidden = hidden.clone()
            hidden[:, :, :1] = d.control[:, :self.variant.z_dim, :1].to(hidden)
            t_in = t_in[:, None].repeat(1, hidden.shape[2])
            t_in[:, 0] = 0
            inputs = (hidden, t_in, *rest)
        elif (self.takes_control and self.spec.i2v and d.control is None
              and d.latents.shape[2] > 1):
            # Trained image-to-video, sampled from the prompt alone: make_inputs gave the first
            # (noisy) frame t = 0; every frame is at t, as in WanPipeline.
            hidden, t_in, *rest = inputs
            inputs = (hidden, t_in[:, 1], *rest)
        return inputs

    def _condition(self, d: Denoising) -> torch.Tensor:
        """Latents of the condition video [first frame, black..., (last frame)] (i2v
        checkpoints), once per request: the control's own for one latent frame, else encoded from
        the request's images."""
        if "condition" not in d.state:
            mode, frames = self.frame_mode(d), d.request.frames
            if frames == 1:
                d.state["condition"] = d.control[:, self.variant.condition_channels(mode)]
            else:
                given = self._frames(d)
                clip = given[0].new_zeros(1, 3, frames, *given[0].shape[-2:])
                clip[:, :, 0], clip[:, :, -1] = given[0], given[-1]
                vae = self.load_vae(d.latents.device, torch.float32)
                d.state["condition"] = self.spec._vae_encode(vae, condition_video(clip, mode))
                del vae
        return d.state["condition"]

    def _frames(self, d: Denoising) -> list[torch.Tensor]:
        """The request's first frame and, where given, its last, (1, 3, H, W) in [-1, 1]."""
        from dpipe.images import load_image

        r = d.request
        paths = [r.control] + ([r.last_frame] if r.last_frame is not None else [])
        return [load_image(Path(p), r.width, r.height)[None] for p in paths]

    def _tokens(self, d: Denoising) -> torch.Tensor:
        """The CLIP tokens (Wan 2.1 i2v): the control's cached ones; with a last frame (FLF2V),
        those of both frames, from the image encoder once per request."""
        v = self.variant
        if d.request.last_frame is None:
            return unpack_tokens(d.control[:, v.tokens_start:], v.image_tokens, v.image_dim)
        if "tokens" not in d.state:
            pipe = self.spec.load_image_encoder(d.latents.device, torch.float32)
            d.state["tokens"] = self.spec.clip_tokens(pipe, self._frames(d))
            del pipe
        return d.state["tokens"]

    def prediction(self, output: torch.Tensor, d: Denoising) -> torch.Tensor:
        d.state["dtype"] = output.dtype  # the stages' compute dtype, for a frozen expert
        return super().prediction(output, d)

    def step(self, d: Denoising, t: torch.Tensor, prediction: torch.Tensor) -> None:
        other = self.other_expert
        if other is not None and self.expert_at(d.scheduler, t) == other:
            prediction = self._frozen_prediction(d, t, other)
        super().step(d, t, prediction)
        if d.scheduler.step_index < len(d.timesteps):
            return
        # The last step.
        if self.first_frame(d):  # as the pipeline: (1 - first_frame_mask) * condition + ...
            d.latents = d.latents.clone()
            d.latents[:, :, :1] = d.control[:, :self.variant.z_dim, :1].to(d.latents)
        if other is not None:
            d.state["done"] = True
            self._release_if_unused()

    # ---- the other A14B expert ---------------------------------------------------------------
    def _frozen_prediction(self, d: Denoising, t: torch.Tensor, other: str) -> torch.Tensor:
        device, dtype = d.latents.device, d.state.get("dtype", torch.float32)
        if self._frozen is None or self._frozen[:2] != (device, dtype):
            from diffusers import WanTransformer3DModel

            self._frozen = None
            model = WanTransformer3DModel.from_pretrained(self.path, subfolder=other, dtype=dtype)
            self._frozen = (device, dtype, model.to(device).requires_grad_(False).eval())
        model = self._frozen[2]

        def predict(text):  # as WanPipeline calls it: the scheduler's timestep itself
            latents, _t, context, *image = (x.to(dtype) if x.is_floating_point() else x
                                            for x in self.inputs(d, t, text))
            return model(hidden_states=latents, timestep=t.reshape(1).to(device),
                         encoder_hidden_states=context,
                         encoder_hidden_states_image=image[0] if image else None,
                         return_dict=False)[0].float()

        with torch.no_grad():
            cond = predict(d.text)
            return cond if d.uncond is None else self.guide(cond, predict(d.uncond), d)

    def _release_if_unused(self) -> None:
        self._users = [ref for ref in self._users
                       if ref() is not None and not ref().state.get("done")]
        if not self._users and self._frozen is not None:
            device = self._frozen[0]
            self._frozen = None
            if device.type == "cuda":
                torch.cuda.empty_cache()

    # ---- decoding ----------------------------------------------------------------------------
    def decode(self, vae, latents: torch.Tensor) -> torch.Tensor:
        return wan_vae_decoded(vae, latents)

    # ---- the reference -----------------------------------------------------------------------
    def image_to_video(self, request: SampleRequest) -> bool:
        """Whether the reference is WanImageToVideoPipeline: an i2v checkpoint, or TI2V-5B given
        a first frame of a clip."""
        return self.variant.concat_condition or (
            self.takes_control and request.control is not None and request.frames > 1)

    def reference_class(self, request: SampleRequest) -> str:
        return "WanImageToVideoPipeline" if self.image_to_video(request) else "WanPipeline"

    def reference_parts(self, denoiser, request: SampleRequest) -> dict:
        import diffusers

        parts = {}
        if self.variant.boundary is not None:
            parts[self.spec.expert] = denoiser
            other = self.other_expert
            if other is None:  # the trained expert alone, at every step
                parts.update(transformer=denoiser, transformer_2=None, boundary_ratio=None)
            else:
                parts[other] = diffusers.WanTransformer3DModel.from_pretrained(
                    self.path, subfolder=other, dtype=torch.float32)
        if self.image_to_video(request) and not self.variant.clip_tokens:
            parts.update(image_encoder=None, image_processor=None)
        return parts

    def reference_arguments(self, pipe, request: SampleRequest, steps: int,
                            guidance: float) -> dict:
        arguments = super().reference_arguments(pipe, request, steps, guidance)
        if self.image_to_video(request):
            arguments["image"] = self.fitted(request.control, request)
            if request.last_frame is not None:
                arguments["last_image"] = self.fitted(request.last_frame, request)
        return arguments
