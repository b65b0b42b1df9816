"""How a family samples: its diffusers pipeline's denoising loop, one step at a time.

A family's `ModelSpec.sampling()` returns a `FamilySampling`. dpipe's sampler (`dpipe.sample`)
drives it: it builds each step's denoiser inputs with the family's own `make_inputs` (the tuple
the pipeline layers take in training), runs them forward through the pipeline stages, and hands
the last layer's output back here to become the next latents. Everything else that decides the
picture lives here and follows the family's diffusers pipeline: the latent shape and how the
noise is drawn from the seed, the scheduler and its timesteps, guidance, and the VAE decode. So
dpipe's sample equals what that pipeline makes from the same weights, prompt, seed and steps;
`diffusers_sample` runs that pipeline for the comparison (tests, benchmarks).

The defaults are those of a flow-matching family with a KL image VAE and classifier-free
guidance; families override what differs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from dpipe.models.common.latent_packing import unpack
from dpipe.models.diffusers_folder import read_json


@dataclass(frozen=True)
class SampleRequest:
    """One sample to make: an item of `sample.prompts` with the defaults filled in."""

    index: int  # position in sample.prompts: names the file (<index>.png)
    prompt: str
    negative_prompt: str
    seed: int
    width: int
    height: int
    frames: int = 1
    # An image path (edit and image-to-video families); a tuple of paths, in order, for
    # several references (families whose spec takes them: `ModelSpec.references`).
    control: str | tuple[str, ...] | None = None
    last_frame: str | None = None  # an image path: the clip's last frame (first-last-frame)
    audio_guidance: float | None = None  # the sound's own scale; None: the family's usual

    @property
    def controls(self) -> tuple[str, ...]:
        """The request's control images, in order; () without any."""
        if self.control is None:
            return ()
        return (self.control,) if isinstance(self.control, str) else self.control

    @property
    def label(self) -> str:
        sound = "" if self.audio_guidance is None else f", audio guidance {self.audio_guidance:g}"
        return f"{self.prompt} (seed {self.seed}, {self.width}x{self.height}" + (
            f"x{self.frames}" if self.frames > 1 else "") + f"{sound})"


@dataclass
class Denoising:
    """One request while it is denoised."""

    request: SampleRequest
    latents: torch.Tensor  # the current x_t, (1, C, h, w) or (1, C, F, h, w), float32
    scheduler: Any  # the family's diffusers scheduler, its timesteps set
    timesteps: torch.Tensor
    text: dict[str, torch.Tensor]  # cached embeddings of the prompt, batch of 1
    uncond: dict[str, torch.Tensor] | None  # of the negative prompt, with classifier-free guidance
    guidance: float
    # Latents of the control image, batch of 1; several references: (1, R, C, h, w)
    control: torch.Tensor | None = None
    state: dict[str, Any] = field(default_factory=dict)  # what a family keeps between steps

    @property
    def index(self) -> int:
        """The index in `timesteps` of the step being taken, where the scheduler steps (the last
        stage: `prediction`, `guide`, `step`): the scheduler's step_index (None, here 0, before
        its first step)."""
        return self.scheduler.step_index or 0


class FamilySampling:
    """A family's sampling recipe; `spec` is its ModelSpec."""

    default_steps: ClassVar[int] = 28
    default_guidance: ClassVar[float] = 3.5
    # "cfg": classifier-free guidance, a second prediction from the negative prompt where the
    # scale exceeds 1; "embedded": a guidance-distilled model takes the scale as an input;
    # "distilled": no guidance at all (sample.guidance is refused).
    guidance_kind: ClassVar[str] = "cfg"
    scheduler_class: ClassVar[str] = "FlowMatchEulerDiscreteScheduler"
    # The max_shift that the pipeline's calculate_shift call assumes where the scheduler's
    # config has none (SD3's pipeline: 1.16).
    default_max_shift: ClassVar[float] = 1.15
    # How the pipeline sets its timesteps: "sigmas", sigmas 1 -> 1/steps shifted by the
    # scheduler (with mu where it shifts by resolution); "to_zero", sigmas linspace(1, 0,
    # steps + 1) without the last, shifted by the scheduler's fixed shift; "steps",
    # `num_inference_steps` alone, spaced by the scheduler itself.
    schedule: ClassVar[str] = "sigmas"
    # FLUX's 2x2 packing (`dpipe.models.common.latent_packing`): the denoiser's output and the
    # pipeline's latents are (1, h/2 * w/2, 4C) tokens (the target's first, where reference
    # tokens follow them), the sampler's latents (1, C, h, w).
    packed: ClassVar[bool] = False
    # Video families: frames must be `frame_step` * k + 1; `fps` of the written clips.
    video: ClassVar[bool] = False
    frame_step: ClassVar[int] = 4
    fps: ClassVar[float] = 24.0
    # Whether decoding adds the VAE's shift_factor back (some pipelines divide by the scale alone).
    decode_shift: ClassVar[bool] = True
    # Families that need a control image for every sample (edits, image-to-video), and those
    # that take one where given (FLUX.2's references, Wan 2.2 TI2V's first frame).
    needs_control: ClassVar[bool] = False
    takes_control: ClassVar[bool] = False
    # Families that guide their sound with a scale of its own (sample.audio_guidance): its
    # usual value; None where a family makes no sound or guides it with the picture's scale.
    default_audio_guidance: ClassVar[float | None] = None

    def __init__(self, spec):
        self.spec = spec
        self.path = spec.path

    def clip_frames(self, longest: int) -> int:
        """The longest clip of at most `longest` frames that the family takes (1: an image)."""
        if not self.video or longest < 1:
            return 1
        return (longest - 1) // self.frame_step * self.frame_step + 1

    # ---- the request ------------------------------------------------------------------------
    def check(self, request: SampleRequest) -> str | None:
        """What is wrong with the request for this family, or None. Sizes are checked by the
        caller against `spec.pixel_multiple`."""
        if self.video and (request.frames - 1) % self.frame_step:
            return (f"frames={request.frames}: {self.spec.family} makes clips of "
                    f"{self.frame_step}k+1 frames (1, {self.frame_step + 1}, "
                    f"{2 * self.frame_step + 1}, ...)")
        if not self.video and request.frames != 1:
            return f"frames={request.frames}: {self.spec.family} makes images (frames=1)"
        if self.needs_control and request.control is None:
            return f"{self.spec.family} samples from a control image: give the item a `control`"
        if request.control is not None and not (self.needs_control or self.takes_control):
            return (f"control={request.control}: {self.spec.family} takes no control image; "
                    "remove `control`")
        if len(request.controls) > self.spec.references:
            return (f"control: {len(request.controls)} images, but {self.spec.family} takes at "
                    f"most {self.spec.references}; give fewer")
        if request.last_frame is not None:
            return self.last_frame_problem(request)
        return self.sound_problem(request)

    def last_frame_problem(self, request: SampleRequest) -> str | None:
        """What is wrong with a request's `last_frame`, or None: the checkpoint must take a
        last frame (`ModelSpec.frame_modes`), and a clip must have one besides its first."""
        modes = self.spec.frame_modes()
        if "both" not in modes and "last" not in modes:
            return (f"last_frame={request.last_frame}: model.family={self.spec.family} at "
                    f"{self.path} takes no last frame (its frame modes: {', '.join(modes)}); "
                    "remove `last_frame`")
        if "last" not in modes and request.control is None:
            return (f"last_frame={request.last_frame}: {self.spec.family} takes a last frame "
                    "with a first one; give the item a `first_frame` too")
        if request.frames == 1:
            return (f"last_frame={request.last_frame} with frames=1: a one-frame sample has no "
                    f"last frame besides its first; ask for {self.frame_step + 1} or more frames")
        return None

    def sound_problem(self, request: SampleRequest) -> str | None:
        """What is wrong with the request's sound settings (`audio_guidance`), or None."""
        if request.audio_guidance is not None and self.default_audio_guidance is None:
            how = ("has no guidance scale for its sound alone" if self.makes_sound()
                   else "makes no sound here")
            return (f"audio_guidance={request.audio_guidance} (or sample.audio_guidance): "
                    f"{self.spec.family} {how}; leave audio_guidance unset")
        return None

    def control_size(self, request: SampleRequest) -> tuple[int, int]:
        """(width, height) the control image is fitted to, for its latents and, where the text
        encoder sees it, for the prompt: the request's size, as training fits control images to
        the target's; a family whose pipeline resizes its references overrides it."""
        return request.width, request.height

    def uses_uncond(self, guidance: float) -> bool:
        return self.guidance_kind == "cfg" and guidance > 1.0

    # ---- latents -----------------------------------------------------------------------------
    def vae_config(self) -> dict[str, Any]:
        return read_json(self.path / "vae" / "config.json")

    def latent_shape(self, request: SampleRequest) -> tuple[int, ...]:
        """(C, h, w) of a KL image VAE's latents; video families add frames."""
        vae = self.vae_config()
        factor = 2 ** (len(vae["block_out_channels"]) - 1)
        return (vae["latent_channels"], request.height // factor, request.width // factor)

    def initial_latents(self, request: SampleRequest) -> torch.Tensor:
        """The starting noise, drawn from the seed as the family's pipeline draws it (a CPU
        generator, float32, in the pipeline's shape before any packing)."""
        generator = torch.Generator().manual_seed(request.seed)
        return torch.randn((1, *self.latent_shape(request)), generator=generator)

    # ---- the schedule ------------------------------------------------------------------------
    def new_scheduler(self):
        import diffusers

        cls = getattr(diffusers, self.scheduler_class)
        return cls.from_pretrained(self.path, subfolder="scheduler")

    def set_timesteps(self, scheduler, steps: int, latents: torch.Tensor) -> torch.Tensor:
        """The pipeline's timesteps for `steps` steps, as `schedule` names them."""
        import numpy as np

        if self.schedule == "steps":
            scheduler.set_timesteps(steps, device=latents.device)
            return scheduler.timesteps
        if self.schedule == "to_zero":
            sigmas = np.linspace(1.0, 0.0, steps + 1)[:-1]
            scheduler.set_timesteps(sigmas=sigmas, device=latents.device)
            return scheduler.timesteps
        sigmas = np.linspace(1.0, 1 / steps, steps)
        kwargs = {}
        if scheduler.config.get("use_dynamic_shifting"):
            kwargs["mu"] = self.shift_mu(scheduler, latents)
        scheduler.set_timesteps(sigmas=sigmas, device=latents.device, **kwargs)
        return scheduler.timesteps

    def image_tokens(self, latents: torch.Tensor) -> int:
        """Tokens of the image in the denoiser (for resolution-dependent shifts): 2x2 patches."""
        return math.prod(latents.shape[-2:]) // 4

    def shift_mu(self, scheduler, latents: torch.Tensor) -> float:
        """diffusers' `calculate_shift`: mu linear in the image's token count."""
        c = scheduler.config
        base_len, max_len = c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096)
        base, top = c.get("base_shift", 0.5), c.get("max_shift", self.default_max_shift)
        m = (top - base) / (max_len - base_len)
        return self.image_tokens(latents) * m + base - m * base_len

    def training_shift(self, latents: torch.Tensor) -> float:
        """The shift of t (`dpipe.diffusion.timesteps.shift_timesteps`) that this family's
        schedule applies at `latents`' size, for `train.timesteps.shift=auto`: with dynamic
        shifting in the scheduler's config, exp(mu) (or mu, time_shift_type "linear") with
        `shift_mu`; else its fixed `shift` (`flow_shift` for flow sigmas of UniPC and DPM-Solver);
        1.0 for a scheduler of another kind (DDPM families). The schedule's other changes
        (shift_terminal, Karras sigmas) have no counterpart in the t training draws."""
        from dpipe.diffusion.timesteps import shift_of_mu

        scheduler = self.new_scheduler()
        c = scheduler.config
        flow_sigmas = bool(c.get("use_flow_sigmas"))
        if "shift" not in c and not flow_sigmas:
            return 1.0
        if c.get("use_dynamic_shifting"):
            return shift_of_mu(self.shift_mu(scheduler, latents),
                               c.get("time_shift_type", "exponential"))
        return float(c["flow_shift"] if flow_sigmas else c["shift"])

    def start(self, request: SampleRequest, steps: int, guidance: float,
              text: dict[str, torch.Tensor], uncond: dict[str, torch.Tensor] | None,
              control: torch.Tensor | None, device: torch.device) -> Denoising:
        latents = self.initial_latents(request).to(device)
        scheduler = self.new_scheduler()
        timesteps = self.set_timesteps(scheduler, steps, latents)
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(0)
        return Denoising(request, latents, scheduler, timesteps, text,
                         uncond if self.uses_uncond(guidance) else None, guidance, control)

    # ---- one step ----------------------------------------------------------------------------
    def model_time(self, t: torch.Tensor) -> torch.Tensor:
        """The scheduler's timestep -> the t in [0, 1] that `make_inputs` takes (t / 1000, as the
        flow-matching pipelines pass it)."""
        return t.reshape(1).float() / 1000

    def batch(self, d: Denoising, t: torch.Tensor, text: dict[str, torch.Tensor]):
        """The NoisedBatch that `make_inputs` turns into the first layer's inputs at timestep t."""
        from dpipe.models.spec import NoisedBatch

        x = d.latents
        r = d.request
        return NoisedBatch(
            latents=x, noise=torch.zeros_like(x), timesteps=self.model_time(t).to(x.device),
            noisy=x, target=x, text=text, control=d.control,
            original_size=torch.tensor([[r.height, r.width]]),
            crop_top_left=torch.tensor([[0, 0]]),
            fps=torch.tensor([self.fps]) if self.video and r.frames > 1 else None,
            guidance=torch.full((1,), float(d.guidance)) if self.guidance_kind == "embedded"
            else None)

    def inputs(self, d: Denoising, t: torch.Tensor, text: dict[str, torch.Tensor]) -> tuple:
        inputs, _labels = self.spec.make_inputs(self.batch(d, t, text))
        return inputs

    def output(self, y: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The last pipeline layer's output -> the one tensor `prediction` takes (and the last
        stage keeps): its first, where a head returns more for the training loss."""
        return y if isinstance(y, torch.Tensor) else y[0]

    def prediction(self, output: torch.Tensor, d: Denoising) -> torch.Tensor:
        """The last layer's output -> the prediction in the latents' layout: unpacked (the
        target's tokens) where `packed`, else the output already is."""
        if self.packed:
            h, w = d.latents.shape[-2:]
            return unpack(output[:, : (h // 2) * (w // 2)].float(), d.latents)
        return output.reshape(d.latents.shape).float()

    def guide(self, cond: torch.Tensor, uncond: torch.Tensor, d: Denoising) -> torch.Tensor:
        return uncond + d.guidance * (cond - uncond)

    def step(self, d: Denoising, t: torch.Tensor, prediction: torch.Tensor) -> None:
        d.latents = d.scheduler.step(prediction, t, d.latents, return_dict=False)[0]

    # ---- decoding ----------------------------------------------------------------------------
    def load_vae(self, device: torch.device, dtype: torch.dtype):
        """The VAE alone (no text encoder), frozen."""
        import diffusers

        cls_name = read_json(self.path / "model_index.json")["vae"][1]
        vae = getattr(diffusers, cls_name).from_pretrained(self.path, subfolder="vae", dtype=dtype)
        return vae.to(device).requires_grad_(False).eval()

    @torch.no_grad()
    def decode(self, vae, latents: torch.Tensor) -> torch.Tensor:
        """Final latents (1, ...) -> pixels in [-1, 1]: (3, H, W), or (3, F, H, W) for video."""
        c = vae.config
        shift = (c.shift_factor or 0.0) if self.decode_shift else 0.0
        x = latents.to(vae.device, vae.dtype) / c.scaling_factor + shift
        return vae.decode(x, return_dict=False)[0][0].float()

    # ---- the soundtrack (joint audio-video families) -----------------------------------------
    def output_latents(self, request: SampleRequest, latents: torch.Tensor) -> torch.Tensor:
        """A finished sample's latents as decoded and saved: those it denoised (a family whose
        sampler carries more, such as a given frame's own latents, leaves those out)."""
        return latents

    def makes_sound(self) -> bool:
        """Whether the final latents hold a soundtrack too, which `decode_sound` decodes."""
        return False

    def load_sound_decoder(self, device: torch.device, dtype: torch.dtype):
        """What `decode_sound` decodes with (the audio VAE, with a vocoder where the family has
        one), frozen."""
        raise NotImplementedError(f"{self.spec.family} makes no sound")

    @torch.no_grad()
    def decode_sound(self, decoder, latents: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Final latents (1, ...) -> (waveform (channels, samples) float32 in [-1, 1], its
        sample rate in Hz), as the family's pipeline decodes its audio."""
        raise NotImplementedError(f"{self.spec.family} makes no sound")

    # ---- the reference -----------------------------------------------------------------------
    # The diffusers pipeline that `diffusers_sample` runs, by its class name in diffusers (a
    # family whose pipeline depends on the folder or the request overrides `reference_class`);
    # None: no diffusers reference (or a family that runs its own `diffusers_sample`).
    reference_pipeline: ClassVar[str | None] = None

    def diffusers_sample(self, denoiser, request: SampleRequest, steps: int,
                         guidance: float) -> torch.Tensor:
        """The family's diffusers pipeline, loaded from the model folder with `denoiser` as its
        transformer, run with the request's prompt, seed and size: its final latents in the
        layout of `Denoising.latents` (before decoding)."""
        if self.reference_class(request) is None:
            raise NotImplementedError(f"{self.spec.family}: no diffusers reference sampler")
        pipe = self.load_reference(denoiser, request)
        out = pipe(**self.reference_arguments(pipe, request, steps, guidance))
        return self.reference_latents(pipe, out.frames if self.video else out.images, request)

    def reference_class(self, request: SampleRequest) -> str | None:
        return self.reference_pipeline

    def load_reference(self, denoiser, request: SampleRequest):
        """The reference pipeline from the model folder in float32, `denoiser` as its
        transformer, with `reference_parts` in place of the folder's."""
        import diffusers

        cls = getattr(diffusers, self.reference_class(request))
        parts = {"transformer": denoiser, **self.reference_parts(denoiser, request)}
        return cls.from_pretrained(self.path, dtype=torch.float32, **parts)

    def reference_parts(self, denoiser, request: SampleRequest) -> dict[str, Any]:
        """The pipeline's components loaded otherwise than by its `from_pretrained` (and in
        place of `transformer=denoiser`, where a family names it): none."""
        return {}

    def reference_arguments(self, pipe, request: SampleRequest, steps: int,
                            guidance: float) -> dict[str, Any]:
        """The pipeline call's arguments as most pipelines take them: the prompt and negative
        prompt, the size (and a video's frames), steps, guidance_scale and max_sequence_length
        (the run's `model.max_text_tokens`), the seed's CPU generator, latents out. A family
        adds, changes or removes what its pipeline takes otherwise."""
        arguments = dict(
            prompt=request.prompt, negative_prompt=request.negative_prompt,
            height=request.height, width=request.width, num_inference_steps=steps,
            guidance_scale=guidance, max_sequence_length=self.spec.cfg.max_text_tokens,
            generator=torch.Generator().manual_seed(request.seed), output_type="latent")
        if self.video:
            arguments["num_frames"] = request.frames
        return arguments

    @staticmethod
    def fitted(path, request: SampleRequest):
        """The image at `path` fitted to the request's size as training fits control images,
        8-bit RGB: a reference pipeline's image, as dpipe's sampler sees it."""
        from dpipe.images import fit, open_rgb

        return fit(open_rgb(path), request.width, request.height)

    def reference_latents(self, pipe, latents: torch.Tensor,
                          request: SampleRequest) -> torch.Tensor:
        """The pipeline's output latents -> the layout of `Denoising.latents`: the same, unless a
        family samples in another layout (`packed` latents are unpacked)."""
        if self.packed:
            return unpack(latents.float(), torch.empty(1, *self.latent_shape(request)))
        return latents

    def diffusers_media(self, denoiser, request: SampleRequest, steps: int, guidance: float
                        ) -> tuple[torch.Tensor, tuple[torch.Tensor, int]]:
        """For a family that makes sound: its pipeline's decoded sample, as `diffusers_sample`
        runs it: (frames (3, F, H, W) in [0, 1], (waveform (channels, samples), sample rate))."""
        raise NotImplementedError(f"{self.spec.family}: no diffusers reference with sound")
