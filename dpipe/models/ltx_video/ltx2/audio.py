"""LTX-2's audio encoder: waveform -> the log-mel spectrogram its audio VAE was trained on ->
AutoencoderKLLTX2Audio -> latents normalised as LTX2Pipeline normalises audio latents.

The spectrogram is LTX-2's own preprocessing (ltx-core's audio processor): a magnitude STFT
(1024-point periodic Hann window and FFT, `mel_hop_length` hop, centred with reflection padding),
`mel_bins` triangular Slaney-scale filters with Slaney area normalisation from 0 Hz to Nyquist,
then log(max(x, 1e-5)); per channel, (B, channels, frames, mel_bins). torchaudio computes the same
thing; dpipe builds it from torch.stft and the filterbank below instead of depending on it.

Length: LTX2Pipeline gives a clip of `num_frames` at `frame_rate` round(duration_s *
sample_rate / hop / 4) latent frames (4 = the VAE's temporal compression). The causal encoder
turns 4L spectrogram frames into L latent frames, so the spectrogram is cut (or the sound padded
with silence, by under a hop) to exactly 4L frames.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import torch

N_FFT = 1024  # LTX-2's STFT size and window length (ltx-core's audio processor)
LOG_FLOOR = 1e-5  # magnitudes are clamped to this before the log


def _hz_to_mel(hz: float) -> float:
    """The Slaney mel scale: linear (3 mel per 200 Hz) up to 1 kHz, logarithmic above."""
    if hz < 1000.0:
        return 3.0 * hz / 200.0
    return 15.0 + math.log(hz / 1000.0) / (math.log(6.4) / 27.0)


def _mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    linear = 200.0 * mel / 3.0
    log = 1000.0 * torch.exp((math.log(6.4) / 27.0) * (mel - 15.0))
    return torch.where(mel < 15.0, linear, log)


@lru_cache(maxsize=8)
def mel_filterbank(sample_rate: int, n_fft: int, mel_bins: int) -> torch.Tensor:
    """(n_fft // 2 + 1, mel_bins) float64: triangles evenly spaced on the Slaney mel scale from
    0 Hz to sample_rate / 2, each scaled to unit area (2 / its width in Hz)."""
    freqs = torch.linspace(0, sample_rate // 2, n_fft // 2 + 1, dtype=torch.float64)
    edges = _mel_to_hz(torch.linspace(_hz_to_mel(0.0), _hz_to_mel(sample_rate / 2),
                                      mel_bins + 2, dtype=torch.float64))
    lower, centre, upper = edges[:-2], edges[1:-1], edges[2:]
    rising = (freqs[:, None] - lower) / (centre - lower)
    falling = (upper - freqs[:, None]) / (upper - centre)
    triangles = torch.clamp(torch.minimum(rising, falling), min=0.0)
    return triangles * (2.0 / (upper - lower))


def log_mel(waveforms: torch.Tensor, sample_rate: int, hop: int, mel_bins: int) -> torch.Tensor:
    """(B, channels, samples) -> (B, channels, 1 + samples // hop, mel_bins), float32."""
    b, channels, samples = waveforms.shape
    flat = waveforms.reshape(b * channels, samples).float()
    window = torch.hann_window(N_FFT, device=flat.device)  # periodic, as torch's default
    spectrum = torch.stft(flat, N_FFT, hop_length=hop, win_length=N_FFT, window=window,
                          center=True, pad_mode="reflect", return_complex=True).abs()
    bank = mel_filterbank(sample_rate, N_FFT, mel_bins).to(flat.device, torch.float32)
    mel = torch.einsum("nft,fm->ntm", spectrum, bank)
    return torch.log(torch.clamp(mel, min=LOG_FLOOR)).reshape(b, channels, -1, mel_bins)


def latent_frames(samples: int, sample_rate: int, hop: int, compression: int) -> int:
    """Audio latent frames of a clip whose sound is `samples` long: LTX2Pipeline's
    round(duration_s * audio_latents_per_second)."""
    return round(samples / sample_rate * (sample_rate / hop / float(compression)))


@torch.no_grad()
def encode_audio(pipe: Any, waveforms: torch.Tensor) -> torch.Tensor:
    """Waveforms (B, channels, samples) in [-1, 1] at the audio VAE's rate -> normalised latents
    (B, C, L, M) as LTX2Pipeline takes them (`audio_latents`, unpacked)."""
    vae = pipe.audio_vae
    config = vae.config
    rate, hop = config.sample_rate, config.mel_hop_length
    length = latent_frames(waveforms.shape[-1], rate, hop, vae.temporal_compression_ratio)
    wanted = length * vae.temporal_compression_ratio  # spectrogram frames
    # 1 + samples // hop frames: pad so there are at least `wanted`, then cut to them.
    short = (wanted - 1) * hop - waveforms.shape[-1]
    if short > 0:
        waveforms = torch.nn.functional.pad(waveforms, (0, short))
    mel = log_mel(waveforms.to(vae.device), rate, hop, config.mel_bins)[:, :, :wanted]
    latents = vae.encode(mel.to(vae.dtype)).latent_dist.mode()[:, :, :length]
    if latents.shape[2] != length:
        raise RuntimeError(f"the audio VAE gave {latents.shape[2]} latent frames for {wanted} "
                           f"spectrogram frames; LTX2Pipeline expects {length}")
    mel_bins = latents.shape[3]
    packed = pipe._pack_audio_latents(latents)
    packed = pipe._normalize_audio_latents(packed, vae.latents_mean, vae.latents_std)
    return pipe._unpack_audio_latents(packed, length, mel_bins)


def pack_audio(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, L, M) audio latents -> (B, L, C * M) tokens, as LTX2Pipeline._pack_audio_latents."""
    return latents.transpose(1, 2).flatten(2, 3)


def unpack_audio(tokens: torch.Tensor, mel_bins: int) -> torch.Tensor:
    """The inverse of `pack_audio`, as LTX2Pipeline._unpack_audio_latents."""
    return tokens.unflatten(2, (-1, mel_bins)).transpose(1, 2)
