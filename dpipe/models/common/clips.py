"""The families that train on clips as well as images, through one `encode_images`."""

from __future__ import annotations

from typing import Any

import torch


class EncodesClips:
    """A family whose `encode_images` takes (B, 3, F, H, W) clips (images as F = 1) as well as
    images. The data pipeline encodes clips through `encode_videos` and takes clips only from a
    family that has it: here it is `encode_images`."""

    def encode_videos(self, encoders: Any, pixels: torch.Tensor) -> torch.Tensor:
        return self.encode_images(encoders, pixels)
