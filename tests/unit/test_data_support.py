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
                caption: str | None = "a clip") -> Path:
    """A clip whose frame i is flat grey at level 10 * i (so tests can tell frames apart)."""
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    w, h = size
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for i in range(frames):
            frame = np.full((h, w, 3), (10 * i) % 256, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption)
    return path


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
