"""LTX-2 / LTX-2.3 with model.audio=true sample video and sound together, as `LTX2Pipeline`
computes both streams, through the joint pipeline layers (av_layers.py).

As the pipeline: the video noise (sampling.py) and then the audio noise N(0, 1) in
(latent_channels, L, mel_bins / 4) are drawn from the seed's generator, L = round(frames / 24 *
sample_rate / mel_hop_length / 4) (the audio VAE's config), packed to (L, C * M) tokens; the
audio stream has its own scheduler, a copy of the video's with the same shifted sigmas (the
pipeline's `audio_scheduler`), so both streams run at one t per step, as dpipe trains them. Each
step's two transformer passes (prompt, negative prompt) run the joint computation
(`isolate_modalities=False`); each stream's velocity becomes x0 = x - sigma v, guided as
x0_cond + (g - 1)(x0_cond - x0_uncond) and rescaled by 0.7 against x0_cond: g = sample.guidance
(3.0) for the video, sample.audio_guidance (the pipeline's `audio_guidance_scale`, 7.0 by
default) for the sound; the negative prompt's pass runs unless both scales are <= 1 (then
neither stream is guided, as in the pipeline); Euler steps. Without spatio-temporal and
modality-isolation guidance, as sampling.py explains for the video (their passes are not in
dpipe's loop): `diffusers_sample` runs LTX2Pipeline with stg_scale = audio_stg_scale = 0 and
modality_scale = audio_modality_scale = 1 and nothing else changed.

The sound is decoded as the pipeline decodes it: the packed latents un-normalised with the audio
VAE's latents_mean / latents_std, unpacked, decoded to a mel spectrogram by the audio VAE and
turned into a waveform by the vocoder, at its output_sampling_rate (24 kHz for LTX-2.0, 48 kHz
for LTX-2.3's vocoder with bandwidth extension). Its causal decoder gives 4L - 3 mel frames, so
the sound ends up to ~70 ms before the clip does, as the pipeline's.

`Denoising.latents` carries both streams in one tensor (`dpipe.models.common.joined_latents`):
the video latents (1, C, F', h, w) as sampling.py keeps them, then the packed, normalised audio
latents; the last stage's two outputs travel as one (`output`).
"""

from __future__ import annotations

import copy
import dataclasses
from functools import cached_property

import torch

from dpipe.models.common import joined_latents
from dpipe.models.diffusers_folder import read_json
from dpipe.models.ltx_video.ltx2.sampling import GUIDANCE_RESCALE, LTX2Sampling, rescale_noise_cfg
from dpipe.models.ltx_video.ltx2.audio import pack_audio, unpack_audio
from dpipe.models.sampling import Denoising, SampleRequest

AUDIO_COMPRESSION = 4  # AutoencoderKLLTX2Audio's LATENT_DOWNSAMPLE_FACTOR (time and mel bins)


class LTX2AVSampling(LTX2Sampling):
    default_audio_guidance = 7.0  # LTX2Pipeline's audio_guidance_scale default

    def check(self, request: SampleRequest) -> str | None:
        problem = super().check(request)
        if problem is None and request.last_frame is not None:
            return (f"last_frame={request.last_frame}: model.audio=true samples video and sound "
                    "from a prompt or a first frame (a last frame trains, but samples only "
                    "with model.audio=false); remove `last_frame` here")
        if problem or not self.path.is_dir():  # not made yet: the tiny one gets both parts
            return problem
        missing = [part for part in ("audio_vae", "vocoder")
                   if not (self.path / part / "config.json").is_file()]
        if missing:
            return (f"model.audio=true samples with sound, which needs the model folder's "
                    f"{' and '.join(missing)} ({self.path}); use a complete LTX-2 folder, or "
                    "set model.audio=false for video-only samples")
        return None

    def uses_uncond(self, guidance: float) -> bool:
        return True  # the sound may be guided whatever the picture's scale: `start` decides

    def audio_guidance(self, request: SampleRequest) -> float:
        """The request's scale for the sound (sample.audio_guidance), or the pipeline's usual."""
        return (self.default_audio_guidance if request.audio_guidance is None
                else request.audio_guidance)

    # ---- the two streams in one tensor ------------------------------------------------------
    @cached_property
    def _audio_vae(self) -> dict:
        return read_json(self.path / "audio_vae" / "config.json")

    def audio_shape(self, latent_frames: int) -> tuple[int, int, int]:
        """(C, L, M) of the audio latents of a clip of `latent_frames` video latent frames, as
        LTX2Pipeline sizes them for its frames at 24 fps."""
        c = self._audio_vae
        frames = (latent_frames - 1) * self.spec.temporal_ratio + 1
        per_second = c["sample_rate"] / c["mel_hop_length"] / float(AUDIO_COMPRESSION)
        return (c["latent_channels"], round(frames / self.fps * per_second),
                c["mel_bins"] // AUDIO_COMPRESSION)

    def streams(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Joined latents -> (video latents (1, C, F', h, w), packed audio latents (1, L, C*M))."""
        c, length, mel = self.audio_shape(latents.shape[2])
        video, audio = joined_latents.split(latents, c * length * mel)
        return video, audio.reshape(1, length, c * mel)

    def initial_latents(self, request: SampleRequest) -> torch.Tensor:
        generator = torch.Generator().manual_seed(request.seed)
        video = torch.randn((1, *self.latent_shape(request)), generator=generator)
        audio = torch.randn((1, *self.audio_shape(video.shape[2])), generator=generator)
        return joined_latents.join(video, pack_audio(audio))

    def with_first_frame(self, latents: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        video, audio = self.streams(latents)
        return joined_latents.join(super().with_first_frame(video, image), audio)

    # ---- the schedule ------------------------------------------------------------------------
    def set_timesteps(self, scheduler, steps: int, latents: torch.Tensor) -> torch.Tensor:
        return super().set_timesteps(scheduler, steps, self.streams(latents)[0])

    def start(self, request, steps, guidance, text, uncond, control, device) -> Denoising:
        d = super().start(request, steps, guidance, text, uncond, control, device)
        d.state["audio_scheduler"] = copy.deepcopy(d.scheduler)  # its sigmas set, begin index 0
        if guidance <= 1.0 and self.audio_guidance(request) <= 1.0:
            d.uncond = None  # the pipeline's do_classifier_free_guidance: neither stream guided
        return d

    # ---- one step ----------------------------------------------------------------------------
    def batch(self, d: Denoising, t: torch.Tensor, text: dict[str, torch.Tensor]):
        video, audio = self.streams(d.latents)
        batch = super().batch(dataclasses.replace(d, latents=video), t, text)
        audio = unpack_audio(audio, self.audio_shape(video.shape[2])[2])
        return dataclasses.replace(batch, audio_noisy=audio, audio_target=audio)

    def output(self, y) -> torch.Tensor:
        """The head's (video, audio) velocities as one flat tensor (the video's first)."""
        video, audio = y
        return torch.cat([video.reshape(-1), audio.reshape(-1)])

    def prediction(self, output: torch.Tensor, d: Denoising) -> torch.Tensor:
        """Both streams' velocities -> their x0 (`convert_velocity_to_x0`), joined."""
        video, audio = self.streams(d.latents)
        flat = output.float().reshape(-1)
        p, pt = self.spec._patches
        tokens = video.shape[2] // pt * (video.shape[3] // p) * (video.shape[4] // p)
        x0_video = super().prediction(flat[:video.numel()].reshape(1, tokens, -1),
                                      dataclasses.replace(d, latents=video))
        sigma = d.state["audio_scheduler"].sigmas[d.index]
        x0_audio = audio - flat[video.numel():].reshape(audio.shape) * sigma
        return joined_latents.join(x0_video, x0_audio)

    def guide(self, cond: torch.Tensor, uncond: torch.Tensor, d: Denoising) -> torch.Tensor:
        (video, audio), (video_u, audio_u) = self.streams(cond), self.streams(uncond)
        guided = audio + (self.audio_guidance(d.request) - 1) * (audio - audio_u)
        if GUIDANCE_RESCALE > 0:
            guided = rescale_noise_cfg(guided, audio, GUIDANCE_RESCALE)
        return joined_latents.join(super().guide(video, video_u, d), guided)

    def step(self, d: Denoising, t: torch.Tensor, prediction: torch.Tensor) -> None:
        (video, audio), (x0_video, x0_audio) = self.streams(d.latents), self.streams(prediction)
        scheduler = d.state["audio_scheduler"]
        velocity = (audio - x0_audio) / scheduler.sigmas[d.index]  # convert_x0_to_velocity
        audio = scheduler.step(velocity, t, audio, return_dict=False)[0]
        # The video's step, as sampling.py takes it (its scheduler counts the step),
        # on a copy: a step that fails leaves d.latents whole, as the other stages expect it.
        video_only = dataclasses.replace(d, latents=video)
        super().step(video_only, t, x0_video)
        d.latents = joined_latents.join(video_only.latents, audio)

    # ---- decoding ----------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, vae, latents: torch.Tensor) -> torch.Tensor:
        return super().decode(vae, self.streams(latents.reshape(1, *latents.shape[-4:]))[0])

    def makes_sound(self) -> bool:
        return True

    def load_sound_decoder(self, device: torch.device, dtype: torch.dtype):
        """The audio VAE and the vocoder (the class model_index.json names), in float32 (both
        are small; the pipeline's precision of the tests)."""
        import diffusers
        from diffusers.pipelines.ltx2 import vocoder as vocoders

        vocoder_class = read_json(self.path / "model_index.json")["vocoder"][1]
        parts = torch.nn.ModuleDict({
            "audio_vae": diffusers.AutoencoderKLLTX2Audio.from_pretrained(
                self.path, subfolder="audio_vae", dtype=torch.float32),
            "vocoder": getattr(vocoders, vocoder_class).from_pretrained(
                self.path, subfolder="vocoder", dtype=torch.float32)})
        return parts.to(device).requires_grad_(False).eval()

    @torch.no_grad()
    def decode_sound(self, decoder, latents: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Joined latents -> (waveform (channels, samples), the vocoder's rate), as LTX2Pipeline
        decodes its audio latents."""
        audio_vae, vocoder = decoder["audio_vae"], decoder["vocoder"]
        _, audio = self.streams(latents.reshape(1, *latents.shape[-4:]))
        audio = audio.to(audio_vae.device, torch.float32)
        audio = audio * audio_vae.latents_std.to(audio) + audio_vae.latents_mean.to(audio)
        mel = audio_vae.decode(unpack_audio(audio, self.audio_shape(1)[2]), return_dict=False)[0]
        waveform = vocoder(mel)[0].float()
        return waveform, int(vocoder.config.output_sampling_rate)

    # ---- the reference -----------------------------------------------------------------------
    isolate_modalities = False  # the pipeline's transformer calls as they are: the joint ones

    def reference_arguments(self, pipe, request: SampleRequest, steps: int,
                            guidance: float) -> dict:
        return {**super().reference_arguments(pipe, request, steps, guidance),
                "audio_guidance_scale": self.audio_guidance(request),
                "audio_guidance_rescale": GUIDANCE_RESCALE}

    def diffusers_sample(self, denoiser, request: SampleRequest, steps: int,
                         guidance: float) -> torch.Tensor:
        """LTX2Pipeline's final latents of both streams, joined as `Denoising.latents` (the
        audio's as the pipeline returns them, un-normalised: normalised and packed again)."""
        from diffusers import AutoencoderKLLTX2Audio

        final = {}
        out = self.run_pipeline(denoiser, request, steps, guidance, final)
        vae = AutoencoderKLLTX2Audio.from_pretrained(self.path, subfolder="audio_vae",
                                                     dtype=torch.float32)
        audio = (pack_audio(out.audio.float()) - vae.latents_mean) / vae.latents_std
        return joined_latents.join(self.unpacked(final["latents"], request), audio)

    def diffusers_media(self, denoiser, request: SampleRequest, steps: int, guidance: float
                        ) -> tuple[torch.Tensor, tuple[torch.Tensor, int]]:
        """LTX2Pipeline's decoded sample: (frames (3, F, H, W) in [0, 1], (waveform (channels,
        samples), the vocoder's rate))."""
        out = self.run_pipeline(denoiser, request, steps, guidance, {}, output_type="pt")
        rate = read_json(self.path / "vocoder" / "config.json")["output_sampling_rate"]
        return out.frames[0].permute(1, 0, 2, 3).float(), (out.audio[0].float(), int(rate))


def ltx2_sampling(spec) -> LTX2Sampling:
    """The sampler of an LTX-2 spec (its `sampler`): video only with model.audio=false, video
    and sound together with model.audio=true."""
    return LTX2AVSampling(spec) if spec.cfg.audio else LTX2Sampling(spec)
