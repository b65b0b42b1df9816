"""Helpers shared by the data tests (this module holds no tests): configs, files, a fake spec."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from PIL import Image

from dpipe.config.schema import DatasetConfig, ModelConfig


def dataset_config(**values) -> DatasetConfig:
    """A validated DatasetConfig; the cache goes to the session's DPIPE_CACHE unless given."""
    values.setdefault("cache_dir", str(Path(os.environ["DPIPE_CACHE"]) / "latents"))
    merged = OmegaConf.merge(OmegaConf.structured(DatasetConfig), values)
    return OmegaConf.to_object(merged)


def write_image(path: Path, size=(32, 32), seed: int = 0, caption: str | None = "a photo",
                mode: str = "RGB") -> Path:
    """A random image (and a same-stem caption unless None)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    w, h = size
    pixels = np.random.default_rng(seed).integers(0, 255, (h, w, 3), np.uint8)
    Image.fromarray(pixels).convert(mode).save(path)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption)
    return path


def write_video(path: Path, frames: int, fps: int = 8, size=(32, 24), codec: str = "mpeg4",
                caption: str | None = "a clip", tones: list[tuple[float, float]] | None = None,
                audio_codec: str = "aac", rate: int = 48000, audio_start: float = 0.0) -> Path:
    """A clip whose frame i is flat grey at level 10 * i (so tests can tell frames apart); with
    `tones` [(Hz, seconds), ...] a mono audio track playing them one after the other, from
    `audio_start` seconds after the first frame."""
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    w, h = size
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        sound = container.add_stream(audio_codec, rate=rate) if tones else None
        if sound is not None:
            sound.layout = "mono"
        for i in range(frames):
            frame = np.full((h, w, 3), (10 * i) % 256, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
        if sound is not None:
            wave = tone_wave(tones, rate)
            s16 = audio_codec.startswith("pcm_s16")
            for start in range(0, len(wave), 1024):
                chunk = wave[None, start:start + 1024]
                chunk = (chunk * 32767).astype(np.int16) if s16 else chunk
                frame = av.AudioFrame.from_ndarray(chunk, format="s16" if s16 else "fltp",
                                                   layout="mono")
                frame.sample_rate, frame.pts = rate, start + round(audio_start * rate)
                for packet in sound.encode(frame):
                    container.mux(packet)
            for packet in sound.encode():
                container.mux(packet)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption)
    return path


def write_clips_with_sound(folder: Path, frames: int, fps: int) -> Path:
    """An audio-video dataset folder: two 64x64 clips of `frames` frames with two tones on their
    track, and two random images (no sound), each with a caption."""
    for i in range(2):
        write_video(folder / f"clip{i}.mp4", frames=frames, fps=fps, size=(64, 64), caption=None,
                    tones=[(330 + 110 * i, 0.6), (880, 0.6)])
        (folder / f"clip{i}.txt").write_text(f"a grey fade with a tone, clip {i}")
        pixels = np.random.default_rng(10 + i).integers(0, 255, (64, 64, 3), np.uint8)
        Image.fromarray(pixels).save(folder / f"image{i}.png")
        (folder / f"image{i}.txt").write_text("a blue circle on a green background")
    return folder


def tone_wave(tones: list[tuple[float, float]], rate: int) -> np.ndarray:
    """float32 samples at half scale playing each (Hz, seconds) tone in turn, phase-continuous."""
    hz = np.concatenate([np.full(round(seconds * rate), f) for f, seconds in tones])
    return (0.5 * np.sin(2 * np.pi * np.cumsum(hz) / rate)).astype(np.float32)


def write_wav(path: Path, tones: list[tuple[float, float]], rate: int = 22050,
              codec: str = "pcm_s16le") -> Path:
    """A mono .wav (or .flac with codec="flac") playing the tones."""
    import av

    wave = tone_wave(tones, rate)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=rate)
        stream.layout = "mono"
        fmt = "s16" if codec == "pcm_s16le" else stream.format.name
        data = (wave * 32767).astype(np.int16) if fmt.startswith("s16") else wave
        frame = av.AudioFrame.from_ndarray(data[None], format=fmt, layout="mono")
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def pitch(wave: torch.Tensor, rate: int) -> float:
    """The frequency of a pure tone (Hz), from its upward zero crossings."""
    x = wave.double().numpy()
    crossings = np.flatnonzero((x[:-1] < 0) & (x[1:] >= 0))
    return (len(crossings) - 1) / ((crossings[-1] - crossings[0]) / rate)


def frame_levels(clip: torch.Tensor) -> list[int]:
    """The grey level of each frame of a (3, F, H, W) clip in [-1, 1], rounded to tens."""
    return [int(round(float((clip[:, f].mean() + 1) * 127.5) / 10) * 10)
            for f in range(clip.shape[1])]


class FakeSpec:
    """Enough of a ModelSpec for the data pipeline, with no weights: latents are 4x average-
    pooled pixels (4 channels), text embeddings a hash of the caption. Counts what it encodes."""

    family = "fake"
    pixel_multiple = 8

    def __init__(self, version: str = "1", videos: bool = False):
        self.version = version
        self.encoded: list[tuple] = []  # (kind, batch size)
        if videos:
            self.encode_videos = self._encode_videos

    def encoder_fingerprint(self, kind: str) -> dict:
        return {"family": "fake", "kind": kind, "version": self.version}

    def load_encoders(self, device, dtype):
        return None

    def frame_modes(self) -> dict[str, float]:  # text-to-image: no frames to condition on
        return {"none": 1.0}

    def encode_images(self, encoders, pixels: torch.Tensor) -> torch.Tensor:
        self.encoded.append(("image", len(pixels)))
        pooled = torch.nn.functional.avg_pool2d(pixels, 4)
        return torch.cat([pooled, pooled.mean(1, keepdim=True)], dim=1)

    def _encode_videos(self, encoders, pixels: torch.Tensor) -> torch.Tensor:
        self.encoded.append(("video", len(pixels)))
        b, c, f, h, w = pixels.shape
        pooled = torch.nn.functional.avg_pool3d(pixels, (1, 4, 4))
        return torch.cat([pooled, pooled.mean(1, keepdim=True)], dim=1)

    def encode_prompts(self, encoders, prompts: list[str]) -> dict[str, torch.Tensor]:
        self.encoded.append(("text", len(prompts)))
        codes = [[(hash(p) >> s) % 97 / 97 for s in range(8)] for p in prompts]
        return {"t5": torch.tensor(codes).view(len(prompts), 1, 8).repeat(1, 4, 1),
                "pooled": torch.tensor(codes)}

    def count(self, kind: str) -> int:
        return sum(n for k, n in self.encoded if k == kind)


def tiny_flux_spec():
    """The real tiny FLUX.1 spec (VAE, CLIP, T5), made once per test session."""
    from dpipe.models.registry import build_spec

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), {
        "family": "flux", "path": str(Path(os.environ["DPIPE_CACHE"]) / "models" / "tiny-flux"),
        "tiny": True, "max_text_tokens": 32}))
    spec = build_spec(cfg)
    spec.ensure_available()
    return spec
