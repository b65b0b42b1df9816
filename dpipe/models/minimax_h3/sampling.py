"""MiniMax H3's sampling, as MiniMaxH3ModularPipeline's t2va workflow runs it.

The pipeline denoises the video and its soundtrack together, in one packed sequence: the video
noise (1, C, F, h, w) and then the audio noise (2n audio rows) drawn from the request's generator
in that order, two MiniMaxH3Scheduler schedules (`scheduler/`, shift 12, for the video;
`audio_scheduler/`, shift 3, for the audio) stepped with one transformer call per step, no
guidance (the checkpoint is guidance-distilled). The scheduler's grid of `num_inference_steps`
points holds its terminal zero, so it makes num_inference_steps - 1 model calls: `sample.steps`
counts model calls here and the reference runs the pipeline with one point more.

`Denoising.latents` holds both streams, which the stages share: the video latents
(1, C, F, h, w) with the audio rows' values in k more columns, (1, C, F, h, w + k) (`join`; the
shape alone tells them apart), so each step's Euler update (elementwise) is the pipeline's.
Clips are 17k+5 frames of 5 to 15 seconds at 24 fps, as the pipeline makes them. Both are
decoded as the pipeline decodes them: the video by its VAE, the soundtrack by the audio VAE into
a stereo waveform (`decode_sound`), which the .mp4 carries.
"""

from __future__ import annotations

import math

import torch

from dpipe.models.common import joined_latents
from dpipe.models.diffusers_folder import read_json
from dpipe.models.minimax_h3.layers import AUDIO_CHANNELS
from dpipe.models.minimax_h3.spec import PIXEL_MEAN, PIXEL_STD, split_prediction
from dpipe.models.sampling import Denoising, FamilySampling, SampleRequest

FPS, AUDIO_LATENTS_PER_SECOND = 24, 40  # MINIMAX_H3_FPS, MINIMAX_H3_AUDIO_LATENTS_PER_SECOND
MIN_SECONDS, MAX_SECONDS = 5.0, 15.0  # MiniMaxH3ModularPipeline.min_duration / max_duration


class MiniMaxH3Sampling(FamilySampling):
    default_steps = 30
    default_guidance = 1.0
    guidance_kind = "distilled"  # no negative prompt, no guidance input
    scheduler_class = "MiniMaxH3Scheduler"
    video = True
    fps = float(FPS)

    # ---- the request ------------------------------------------------------------------------
    def check(self, request: SampleRequest) -> str | None:
        _, clip, per_chunk = self.spec.vae_geometry
        frames = request.frames
        seconds = frames / FPS
        if frames % clip != per_chunk or not MIN_SECONDS <= seconds <= MAX_SECONDS:
            return (f"frames={frames}: MiniMax H3 makes clips of {clip}k+{per_chunk} frames from "
                    f"{MIN_SECONDS:g} to {MAX_SECONDS:g} s at {FPS} fps (124, 141, ..., 345)")
        if request.control is not None:
            return f"control={request.control}: MiniMax H3's t2va takes no control image"
        return self.sound_problem(request)

    def clip_frames(self, longest: int) -> int:
        _, clip, per_chunk = self.spec.vae_geometry
        return 1 if longest < per_chunk else (longest - per_chunk) // clip * clip + per_chunk

    def uses_uncond(self, guidance: float) -> bool:
        return False

    # ---- latents -----------------------------------------------------------------------------
    def latent_shape(self, request: SampleRequest) -> tuple[int, ...]:
        spatial, clip, per_chunk = self.spec.vae_geometry
        frames = (request.frames - per_chunk) // clip * per_chunk + 2
        channels = self.vae_config()["latent_channels"]
        return channels, frames, request.height // spatial, request.width // spatial

    def audio_rows(self, latent_frames: int) -> tuple[int, int]:
        """(rows, channels) of the soundtrack of a clip of `latent_frames` latent frames: 40
        latents per second per stereo channel."""
        _, clip, per_chunk = self.spec.vae_geometry
        frames = (latent_frames - 2) // per_chunk * clip + per_chunk
        latents = int(round(frames / FPS * AUDIO_LATENTS_PER_SECOND))
        channels = read_json(self.path / "audio_vae" / "config.json").get("latent_channels", 32)
        return AUDIO_CHANNELS * latents, channels

    def join(self, video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        """Video latents (1, C, F, h, w) and audio rows (1, R, Ca) -> (1, C, F, h, w + k)
        (`dpipe.models.common.joined_latents`)."""
        return joined_latents.join(video, audio)

    def split(self, joined: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The inverse of `join`: (video latents, audio rows)."""
        rows, channels = self.audio_rows(joined.shape[2])
        video, audio = joined_latents.split(joined, rows * channels)
        return video, audio.reshape(1, rows, channels)

    def initial_latents(self, request: SampleRequest) -> torch.Tensor:
        generator = torch.Generator().manual_seed(request.seed)
        c, f, h, w = self.latent_shape(request)
        video = torch.randn((1, c, f, h, w), generator=generator)
        audio = torch.randn(self.audio_rows(f), generator=generator)
        return self.join(video, audio[None])

    def unpatchify(self, rows: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """(1, rows, C*4) -> latents of `shape` (1, C, F, h, w): the pipeline's unpatchify."""
        _, c, f, h, w = shape
        p_t, p_h, p_w = self.spec.patch
        x = rows.reshape(1, f // p_t, h // p_h, w // p_w, c, p_t, p_h, p_w)
        return x.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(shape)

    # ---- the schedule ------------------------------------------------------------------------
    def set_timesteps(self, scheduler, steps: int, latents: torch.Tensor) -> torch.Tensor:
        scheduler.set_timesteps(steps + 1, device=latents.device)
        return scheduler.timesteps

    def training_shift(self, latents: torch.Tensor) -> float:
        return float(self.new_scheduler().config["shift"])

    def start(self, request, steps, guidance, text, uncond, control, device) -> Denoising:
        import diffusers

        d = super().start(request, steps, guidance, text, None, None, device)
        audio = diffusers.MiniMaxH3Scheduler.from_pretrained(self.path, subfolder="audio_scheduler")
        audio.set_timesteps(steps + 1, device=device)
        d.state.update(audio_scheduler=audio, audio_timesteps=audio.timesteps)
        return d

    # ---- one step ----------------------------------------------------------------------------
    def model_time(self, t: torch.Tensor) -> torch.Tensor:
        """The scheduler's t (1 - sigma) -> dpipe's t, the sigma that `make_inputs` takes."""
        return 1 - t.reshape(1).float()

    def batch(self, d: Denoising, t: torch.Tensor, text: dict[str, torch.Tensor]):
        x, audio = self.split(d.latents)
        step = int((d.timesteps == t).nonzero()[0])
        return _sampling_batch()(
            latents=x, noise=torch.zeros_like(x), noisy=x, target=x, text=text,
            timesteps=self.model_time(t).to(x.device), audio_noisy=audio,
            audio_timesteps=self.model_time(d.state["audio_timesteps"][step]).to(x.device))

    def prediction(self, output: torch.Tensor, d: Denoising) -> torch.Tensor:
        """The head's joined rows -> the layout of `Denoising.latents`."""
        video, audio = self.split(d.latents)
        patch = math.prod(self.spec.patch)
        rows = (1, math.prod(video.shape[2:]) // patch, video.shape[1] * patch)
        v_rows, a_rows = split_prediction(output.reshape(1, -1).float(), rows, audio.shape)
        return self.join(self.unpatchify(v_rows, video.shape), a_rows)

    def step(self, d: Denoising, t: torch.Tensor, prediction: torch.Tensor) -> None:
        video, audio = self.split(d.latents)
        v_pred, a_pred = self.split(prediction)
        step = int((d.timesteps == t).nonzero()[0])
        video = d.scheduler.step(v_pred, t, video, return_dict=False)[0]
        audio = d.state["audio_scheduler"].step(a_pred, d.state["audio_timesteps"][step], audio,
                                                return_dict=False)[0]
        d.latents = self.join(video, audio)

    # ---- decoding ----------------------------------------------------------------------------
    def load_vae(self, device: torch.device, dtype: torch.dtype):
        from diffusers import AutoencoderKLMiniMaxH3

        # The release's VAE is float32 (its encoder and norms are kept so in any case).
        vae = AutoencoderKLMiniMaxH3.from_pretrained(self.path, subfolder="vae",
                                                     dtype=torch.float32)
        return vae.to(device).requires_grad_(False).eval()

    @torch.no_grad()
    def decode(self, vae, latents: torch.Tensor) -> torch.Tensor:
        """Joined rows -> (3, F, H, W) in [-1, 1], as MiniMaxH3VideoDecodeStep decodes: the
        latents denormalised, decoded, the VAE's ImageNet-normalised RGB reverted."""
        z, _ = self.split(latents.reshape(1, *latents.shape[-4:]))
        z = z.to(vae.device, torch.float32)
        shape = (1, -1, 1, 1, 1)
        z = (z * torch.tensor(vae.config.latents_std, device=z.device).view(shape)
             + torch.tensor(vae.config.latents_mean, device=z.device).view(shape))
        rgb = vae.decode(z, return_dict=False)[0][0].float()
        mean = torch.tensor(PIXEL_MEAN, device=rgb.device).view(3, 1, 1, 1)
        std = torch.tensor(PIXEL_STD, device=rgb.device).view(3, 1, 1, 1)
        return ((rgb * std + mean).clamp(0, 1) * 2 - 1)

    # ---- the soundtrack --------------------------------------------------------------------
    def makes_sound(self) -> bool:
        return True  # the t2va workflow's soundtrack, denoised with the video

    def load_sound_decoder(self, device: torch.device, dtype: torch.dtype):
        from diffusers import AutoencoderKLMiniMaxH3Audio

        # float32, as the video VAE: the pipeline's components load so.
        vae = AutoencoderKLMiniMaxH3Audio.from_pretrained(self.path, subfolder="audio_vae",
                                                          dtype=torch.float32)
        return vae.to(device).requires_grad_(False).eval()

    @torch.no_grad()
    def decode_sound(self, decoder, latents: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Joined rows -> the stereo waveform, as MiniMaxH3AudioDecodeStep decodes: the rows
        (channel-major) as one batch item per stereo channel (2, C, L), denormalised with the
        audio VAE's latents_mean / latents_std, decoded by the (mono) audio VAE; at its
        sampling_rate."""
        _, rows = self.split(latents.reshape(1, *latents.shape[-4:]))
        c = decoder.config
        z = rows.to(decoder.device, torch.float32).reshape(AUDIO_CHANNELS, -1, rows.shape[-1])
        z = z.permute(0, 2, 1)  # (stereo channel, latent channel, L)
        z = (z * torch.tensor(c.latents_std, device=z.device).view(1, -1, 1)
             + torch.tensor(c.latents_mean, device=z.device).view(1, -1, 1))
        waveform = decoder.decode(z, return_dict=False)[0]  # (2, 1, samples)
        return waveform.float()[:, 0], int(c.sampling_rate)

    # ---- the reference -----------------------------------------------------------------------
    def diffusers_sample(self, denoiser, request: SampleRequest, steps: int,
                         guidance: float) -> torch.Tensor:
        """MiniMaxH3ModularPipeline's t2va with `denoiser` as its transformer: its final video
        latents and audio rows, in the layout of `Denoising.latents`."""
        out = self.run_pipeline(denoiser, request, steps, output=["latents", "audio_latents"])
        video, audio = out["latents"], out["audio_latents"]
        rows = audio.permute(0, 2, 1).reshape(1, -1, audio.shape[1])  # channel-major rows
        return self.join(video.float(), rows.float())

    def diffusers_media(self, denoiser, request: SampleRequest, steps: int, guidance: float
                        ) -> tuple[torch.Tensor, tuple[torch.Tensor, int]]:
        """The t2va pipeline's decoded sample: (frames (3, F, H, W) in [0, 1], (the stereo
        waveform, its sampling rate))."""
        out = self.run_pipeline(denoiser, request, steps, output_type="pt",
                                output=["videos", "audio", "sampling_rate"])
        return (out["videos"][0].permute(1, 0, 2, 3).float(),
                (out["audio"][0].float(), int(out["sampling_rate"])))

    def run_pipeline(self, denoiser, request: SampleRequest, steps: int, **kwargs):
        """MiniMaxH3ModularPipeline's t2va from the model folder with `denoiser` as its
        transformer, run on the request (with one grid point more than `steps` model calls)."""
        from diffusers import ModularPipeline

        from dpipe.models.minimax_h3.processor import load_processor

        pipe = ModularPipeline.from_pretrained(str(self.path), workflow="t2va")
        names = [n for n in pipe.pretrained_component_names
                 if n not in ("processor", "transformer")]
        pipe.load_components(names=names, dtype=torch.float32)
        pipe.update_components(processor=load_processor(self.path / "processor"),
                               transformer=denoiser)
        return pipe(prompt=request.prompt, num_frames=request.frames, height=request.height,
                    width=request.width, num_inference_steps=steps + 1,
                    generator=torch.Generator().manual_seed(request.seed), **kwargs)


def _sampling_batch():
    """A NoisedBatch with the audio rows' own t (`make_inputs` reads `audio_timesteps`)."""
    from dataclasses import dataclass

    from dpipe.models.spec import NoisedBatch

    @dataclass(frozen=True)
    class SamplingBatch(NoisedBatch):
        audio_timesteps: torch.Tensor | None = None
        sampling: bool = True  # the model's plain prediction, never CFG-augmented

    return SamplingBatch
