"""What a Wan diffusers folder is (read from its configs), and how Wan 2.1 i2v's CLIP tokens ride
in the cached latents."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class WanVariant:
    """What a Wan folder is, read from its configs."""

    pipeline: str  # WanPipeline or WanImageToVideoPipeline
    z_dim: int  # latent channels
    spatial: int  # VAE downscale (8 for 2.1, 16 for 2.2)
    temporal: int  # VAE temporal compression (4): clips have 4k+1 frames
    patch: tuple[int, int, int]
    concat_condition: bool  # 2z+4 input channels: mask + first-frame latents (i2v)
    clip_tokens: int  # CLIP image tokens (Wan 2.1 i2v), 0 without an image encoder
    image_dim: int
    # Wan 2.1 FLF2V: the image embedding's position table spans the CLIP tokens of two frames
    # (`pos_embed_seq_len` in its transformer config), the first and the last.
    flf2v: bool
    expand_timesteps: bool  # per-token timesteps (Wan 2.2 TI2V-5B)
    boundary: float | None  # two experts split at this t (Wan 2.2 A14B)

    @property
    def condition_modes(self) -> tuple[str, ...]:
        """The frame modes whose condition video the cache holds, in their channel order
        (after the z latent channels): those the checkpoint takes. Wan 2.1 I2V's image embedding
        takes one frame's CLIP tokens and FLF2V's two (WanImageToVideoPipeline with
        `last_image`), so each has one mode; Wan 2.2 I2V-A14B (no CLIP) takes a first frame with
        or without a last one."""
        if not self.concat_condition:
            return ()
        if self.clip_tokens:
            return ("both",) if self.flf2v else ("first",)
        return ("first", "both")

    def condition_channels(self, mode: str) -> slice:
        """Where `mode`'s condition video latents lie in the cached channels."""
        start = self.z_dim * (1 + self.condition_modes.index(mode))
        return slice(start, start + self.z_dim)

    @property
    def tokens_start(self) -> int:
        """The first cached channel of the packed CLIP tokens."""
        return self.z_dim * (1 + len(self.condition_modes))

    @property
    def image_tokens(self) -> int:
        """CLIP tokens the transformer takes: one frame's, two for FLF2V."""
        return self.clip_tokens * (2 if self.flf2v else 1)


def read_variant(config: Callable[[str], dict[str, Any]]) -> WanVariant:
    """`config(relative path)` reads a JSON file of the folder."""
    index = config("model_index.json")
    transformer = config("transformer/config.json")
    vae = config("vae/config.json")
    z_dim = vae.get("z_dim", 16)
    clip_tokens = 0
    if transformer.get("image_dim"):
        vision = config("image_encoder/config.json")
        clip_tokens = (vision["image_size"] // vision["patch_size"]) ** 2 + 1
    two_experts = index.get("transformer_2", [None])[0] is not None
    return WanVariant(
        pipeline=index["_class_name"], z_dim=z_dim,
        spatial=vae.get("scale_factor_spatial") or 8,
        temporal=vae.get("scale_factor_temporal") or 4,
        patch=tuple(transformer.get("patch_size", (1, 2, 2))),
        concat_condition=transformer.get("in_channels", z_dim) == 2 * z_dim + 4,
        clip_tokens=clip_tokens, image_dim=transformer.get("image_dim") or 0,
        flf2v=bool(transformer.get("pos_embed_seq_len")),
        expand_timesteps=bool(index.get("expand_timesteps")),
        boundary=index.get("boundary_ratio") if two_experts else None,
    )


def pack_tokens(tokens: torch.Tensor, latent_shape: torch.Size) -> torch.Tensor:
    """(B, N, D) image tokens -> (B, K, F, h, w) channels: flattened, zero-padded to whole
    channels of the latents' F * h * w positions."""
    b, positions = tokens.shape[0], math.prod(latent_shape[2:])
    flat = tokens.reshape(b, -1)
    channels = -(-flat.shape[1] // positions)
    flat = F.pad(flat, (0, channels * positions - flat.shape[1]))
    return flat.view(b, channels, *latent_shape[2:])


def unpack_tokens(channels: torch.Tensor, tokens: int, dim: int) -> torch.Tensor:
    return channels.reshape(channels.shape[0], -1)[:, :tokens * dim].reshape(-1, tokens, dim)
